"""The rlhf-cli distribution installs as a portion of the rlhf namespace."""

import importlib
import importlib.metadata
import importlib.resources


def test_cli_imports_as_namespace_portion() -> None:
    rlhf = importlib.import_module("rlhf")
    # PEP 420: the shared top level has no __init__.py, hence no __file__.
    assert getattr(rlhf, "__file__", None) is None
    module = importlib.import_module("rlhf.cli")
    assert importlib.resources.files(module).joinpath("py.typed").is_file()


def test_cli_version_train() -> None:
    version = importlib.metadata.version("rlhf-cli")
    requires = importlib.metadata.requires("rlhf-cli") or []
    siblings = [r for r in requires if r.startswith("rlhf-")]
    assert all(r.endswith(f"=={version}") for r in siblings), siblings
