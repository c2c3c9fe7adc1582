"""Reading DCP checkpoints without running code from them.

torch.distributed.checkpoint unpickles a checkpoint's ``.metadata`` with plain `pickle` and its
non-tensor items (optimizer hyper-parameters, steps) with ``torch.load(weights_only=False)``:
a checkpoint directory from elsewhere could run code when a run resumes from it. `SafeReader`
checks the metadata with an unpickler that admits only the classes DCP metadata is made of,
and `SafeLoadPlanner` checks each non-tensor item with ``torch.load(weights_only=True)``,
before DCP's own readers see them; anything else is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from rlhf.learner.checkpoint import CheckpointError

_DCP_MODULES = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, ``torch.Size`` and torch dtypes; refuses the rest."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_MODULES.get(module, ()):
            return super().find_class(module, name)
        dtype = isinstance(getattr(torch, name, None), torch.dtype)
        if module == "torch" and (name == "Size" or dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_metadata(data: bytes, *, source: str) -> None:
    """Raise `CheckpointError` unless ``data`` unpickles into DCP metadata only."""
    try:
        _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{source} refers to {exc}, which DCP checkpoint metadata never holds: refusing to "
            "unpickle it (a checkpoint from elsewhere could run code on load); resume only "
            "from checkpoints this project wrote"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{source} is not readable DCP metadata: {exc!r}") from None


def safe_load(state: dict[str, Any], *, directory: str) -> None:
    """``torch.distributed.checkpoint.load`` of ``directory`` into ``state`` through
    `SafeReader` and `SafeLoadPlanner`; the metadata is checked here first, and a refusal
    inside DCP (wrapped in its `CheckpointException`) comes out as the `CheckpointError`."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    metadata = f"{directory}/.metadata"
    with open(metadata, "rb") as stream:
        check_metadata(stream.read(), source=metadata)
    try:
        load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner())
    except CheckpointException as exc:
        ours = [f[0] for f in exc.failures.values() if isinstance(f[0], CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata passes `check_metadata` before DCP unpickles it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            check_metadata(stream.read(), source=str(path))
        return super().read_metadata(*args, **kwargs)


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose non-tensor items must load with ``weights_only=True``
    (tensors and plain containers) before DCP loads them."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raw = value.read()
        try:
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} holds more than tensors and plain "
                f"values ({exc.__class__.__name__}): refusing to unpickle it; resume only from "
                "checkpoints this project wrote"
            ) from None
        super().load_bytes(read_item, io.BytesIO(raw))
