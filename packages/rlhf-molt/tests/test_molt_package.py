"""The rlhf-molt distribution: a namespace portion whose README example runs."""

import importlib
import importlib.metadata
import importlib.resources
import os
import pathlib
import subprocess
import sys


def test_molt_imports_as_namespace_portion() -> None:
    rlhf = importlib.import_module("rlhf")
    # PEP 420: the shared top level has no __init__.py, hence no __file__.
    assert getattr(rlhf, "__file__", None) is None
    module = importlib.import_module("rlhf.molt")
    assert importlib.resources.files(module).joinpath("py.typed").is_file()


def test_molt_version_train() -> None:
    version = importlib.metadata.version("rlhf-molt")
    requires = importlib.metadata.requires("rlhf-molt") or []
    siblings = [r for r in requires if r.startswith("rlhf-")]
    assert all(r.endswith(f"=={version}") for r in siblings), siblings


def test_readme_example_runs_and_every_public_name_is_documented() -> None:
    import rlhf.molt

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in rlhf.molt.__all__ if f"`{name}" not in readme]
    assert not missing, missing
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    # The last line is the example's (a library may log above it); the tied head has no
    # parameter of its own.
    assert out.stdout.strip().splitlines()[-1].split() == ["True", "model.embed_tokens.weight"]


def test_a_single_process_group_made_here_is_left_before_interpreter_teardown() -> None:
    # The probe is registered first, so atexit runs it after the backend's own handler.
    code = (
        "import atexit, torch\n"
        "atexit.register(lambda: print('at exit initialized', torch.distributed.is_initialized()))\n"
        "from rlhf.molt import init_distributed\n"
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
