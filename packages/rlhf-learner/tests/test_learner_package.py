"""The rlhf-learner distribution: namespace portion, version train, README example, light import."""

import importlib
import importlib.metadata
import importlib.resources
import os
import pathlib
import subprocess
import sys


def test_learner_imports_as_namespace_portion() -> None:
    rlhf = importlib.import_module("rlhf")
    assert getattr(rlhf, "__file__", None) is None
    module = importlib.import_module("rlhf.learner")
    assert importlib.resources.files(module).joinpath("py.typed").is_file()


def test_learner_version_train() -> None:
    version = importlib.metadata.version("rlhf-learner")
    requires = importlib.metadata.requires("rlhf-learner") or []
    siblings = [r for r in requires if r.startswith("rlhf-")]
    assert siblings and all(r.endswith(f"=={version}") for r in siblings), siblings


def test_import_needs_neither_deepspeed_nor_ray() -> None:
    code = "import sys, rlhf.learner; print(sorted({'deepspeed', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_readme_example_runs() -> None:
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    # A fresh user's environment: no process group of an earlier test in this process (its
    # RANK/MASTER_PORT would point the example at a port that test still holds).
    dist = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in dist}
    out = subprocess.run(
        [sys.executable, "-c", example],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_a_single_process_group_made_here_is_left_before_interpreter_teardown() -> None:
    # atexit runs its handlers last-registered first: the probe, registered before the group
    # is made, runs after the backend's handler and must find the group destroyed.
    code = (
        "import atexit, torch\n"
        "atexit.register(lambda: print('at exit initialized', torch.distributed.is_initialized()))\n"
        "from rlhf.learner.deepspeed_backend import init_distributed\n"
        "init_distributed()\n"
        "print('made', torch.distributed.get_world_size())\n"
    )
    dist = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in dist}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ours = [line for line in out.stdout.splitlines() if line.startswith(("made", "at exit"))]
    assert ours == ["made 1", "at exit initialized False"], out.stdout


def test_every_public_name_is_documented_in_the_readme() -> None:
    import rlhf.learner

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in rlhf.learner.__all__ if f"`{name}" not in text]
    assert not missing, missing
