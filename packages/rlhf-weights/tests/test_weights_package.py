"""The rlhf-weights distribution: a namespace portion that needs torch only."""

import importlib
import importlib.metadata
import importlib.resources
import subprocess
import sys


def test_weights_imports_as_namespace_portion() -> None:
    rlhf = importlib.import_module("rlhf")
    assert getattr(rlhf, "__file__", None) is None  # PEP 420: no rlhf/__init__.py
    module = importlib.import_module("rlhf.weights")
    assert importlib.resources.files(module).joinpath("py.typed").is_file()


def test_importing_needs_neither_ray_nor_cupy() -> None:
    code = "import sys, rlhf.weights; print(sorted(m for m in ('ray', 'cupy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_readme_example_runs_and_every_public_name_is_documented() -> None:
    import pathlib

    import rlhf.weights

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in rlhf.weights.__all__ if f"`{name}" not in readme]
    assert not missing, missing
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["2", "True"]
