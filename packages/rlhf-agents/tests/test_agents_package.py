"""The rlhf-agents distribution installs as a portion of the rlhf namespace."""

import importlib
import importlib.metadata
import importlib.resources


def test_agents_imports_as_namespace_portion() -> None:
    rlhf = importlib.import_module("rlhf")
    # PEP 420: the shared top level has no __init__.py, hence no __file__.
    assert getattr(rlhf, "__file__", None) is None
    module = importlib.import_module("rlhf.agents")
    assert importlib.resources.files(module).joinpath("py.typed").is_file()


def test_agents_version_train() -> None:
    version = importlib.metadata.version("rlhf-agents")
    requires = importlib.metadata.requires("rlhf-agents") or []
    siblings = [r for r in requires if r.startswith("rlhf-")]
    assert all(r.endswith(f"=={version}") for r in siblings), siblings


def test_readme_example_runs() -> None:
    import pathlib
    import subprocess
    import sys

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    out = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines[0] == "[1.0, 0.0]"
    assert lines[1] == "(0.0, 0.0, 1.0) False"


def test_every_public_name_is_documented_in_the_readme() -> None:
    import pathlib

    import rlhf.agents

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in rlhf.agents.__all__ if f"`{name}" not in text]
    assert not missing, missing


def test_imports_no_other_rlhf_package() -> None:
    import ast
    import pathlib

    source = pathlib.Path(__file__).parents[1] / "src" / "rlhf" / "agents"
    offenders = []
    for file in source.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{file.name}: {n}"
                for n in names
                if n.startswith("rlhf.") and not n.startswith("rlhf.agents")
            ]
    assert not offenders
