"""The rlhf-rollout distribution installs as a portion of the rlhf namespace."""

import importlib
import importlib.metadata
import importlib.resources


def test_rollout_imports_as_namespace_portion() -> None:
    rlhf = importlib.import_module("rlhf")
    # PEP 420: the shared top level has no __init__.py, hence no __file__.
    assert getattr(rlhf, "__file__", None) is None
    module = importlib.import_module("rlhf.rollout")
    assert importlib.resources.files(module).joinpath("py.typed").is_file()


def test_rollout_version_train() -> None:
    version = importlib.metadata.version("rlhf-rollout")
    requires = importlib.metadata.requires("rlhf-rollout") or []
    siblings = [r for r in requires if r.startswith("rlhf-")]
    assert all(r.endswith(f"=={version}") for r in siblings), siblings


def test_readme_example_runs() -> None:
    import os
    import pathlib
    import subprocess
    import sys

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, check=False, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # vLLM logs to stdout too; keep the example's own prints.
    lines = [line for line in out.stdout.splitlines() if line.strip() and line[0] != "("]
    assert lines[-3:] == ["2 [True, True]", "1", "True"]


def test_every_public_name_is_documented_in_the_readme() -> None:
    import pathlib

    import rlhf.rollout

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in rlhf.rollout.__all__ if f"`{name}" not in text]
    assert not missing, missing
