"""The rlhf-cli distribution: namespace portion, version train, documented names."""

import importlib
import importlib.metadata
import importlib.resources
import pathlib


def test_cli_imports_as_namespace_portion() -> None:
    rlhf = importlib.import_module("rlhf")
    assert getattr(rlhf, "__file__", None) is None
    module = importlib.import_module("rlhf.cli")
    assert importlib.resources.files(module).joinpath("py.typed").is_file()


def test_cli_version_train() -> None:
    version = importlib.metadata.version("rlhf-cli")
    requires = importlib.metadata.requires("rlhf-cli") or []
    # The packages it composes (extras, such as [gpu]'s rlhf-weights[nccl], carry a marker).
    siblings = [r for r in requires if r.startswith("rlhf-") and ";" not in r]
    assert len(siblings) == 6 and all(r.endswith(f"=={version}") for r in siblings), siblings


def test_every_public_name_is_documented_in_the_readme() -> None:
    import rlhf.cli

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in rlhf.cli.__all__ if f"`{name}" not in text]
    assert not missing, missing
