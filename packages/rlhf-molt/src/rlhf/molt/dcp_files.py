"""DCP checkpoints as safetensors and JSON: nothing in them is unpickled when a run resumes.

torch.distributed.checkpoint's own files pickle the checkpoint's ``.metadata`` and
``torch.save`` every tensor chunk and non-tensor item: a checkpoint directory from elsewhere
could run code on load. This module keeps DCP's planning (sharding, resharding to another rank
count, the state-dict flattening) and replaces its storage:

- `SafetensorsWriter`: each rank writes its chunks to ``__<rank>.safetensors`` (key
  ``<fqn>@<offsets>``), and its non-tensor items (optimizer hyper-parameters: floats, tuples,
  booleans, parameter-name lists), encoded by `rlhf.learner.state_codec`, as JSON in that
  file's header; the coordinator writes ``metadata.json``: every item's global shape, dtype
  and chunks, where each chunk is stored, and DCP's flattening map.
- `SafetensorsReader`: reads ``metadata.json`` back into DCP's metadata classes by their
  fields and serves chunks from the safetensors files; `JsonLoadPlanner` decodes the
  non-tensor items. Anything malformed is a `CheckpointError` naming the file.

`save` and `load` wrap ``torch.distributed.checkpoint.save``/``load`` with them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from rlhf.learner import state_codec
from rlhf.learner.checkpoint import CheckpointError

METADATA_FILE = "metadata.json"
"""The coordinator's description of the checkpoint (DCP's pickled ``.metadata``, as JSON)."""

_ITEMS_KEY = "rlhf.dcp.items"
"""The safetensors header key holding a rank file's non-tensor items (JSON)."""

FORMAT = "rlhf-dcp-safetensors-1"


def _key(index: MetadataIndex) -> str:
    offsets = "" if index.offset is None else ",".join(str(int(x)) for x in index.offset)
    return f"{index.fqn}@{offsets}"


def _dtype(name: str, *, source: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{source} names dtype {name!r}, which torch does not have")
    return value


class JsonSavePlanner(DefaultSavePlanner):
    """`DefaultSavePlanner` whose non-tensor items are `state_codec` JSON, not ``torch.save``."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        value = object
        if write_item.type != WriteItemType.BYTE_IO:
            return value
        tensors, skeleton = state_codec.encode(value)
        if tensors:
            raise TypeError(f"checkpoint item {write_item.index.fqn!r} holds tensors in a value")
        return io.BytesIO(json.dumps(skeleton).encode())


class JsonLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that decodes `JsonSavePlanner`'s non-tensor items."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            decoded = state_codec.decode(json.loads(value.getvalue()), {})
        except (ValueError, state_codec.StateCodecError) as exc:
            raise CheckpointError(
                f"checkpoint item {fqn!r} is not a readable value: {exc}"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], decoded)
        else:
            self.state_dict[fqn] = decoded


def _done(value: Any) -> Future:
    future: Future = Future()  # DCP waits on torch's futures
    future.set_result(value)
    return future


class SafetensorsWriter(StorageWriter):
    """DCP's storage writer for ``path``: one safetensors file per rank, ``metadata.json``."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = pathlib.Path(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = pathlib.Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(plan, storage_data=f"__{rank}.safetensors")
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from safetensors.torch import save_file

        name = plan.storage_data
        tensors: dict[str, torch.Tensor] = {}
        items: dict[str, str] = {}
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            key = _key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                items[key] = data.getvalue().decode()
                size = len(items[key])
            else:
                assert isinstance(data, torch.Tensor)
                # A copy on the host: chunks may be views sharing storage, which
                # safetensors refuses (and DCP copies each chunk to the host too).
                tensors[key] = data.detach().to("cpu", copy=True).contiguous()
                size = tensors[key].numel() * tensors[key].element_size()
            results.append(WriteResult(item.index, size, {"file": name, "key": key}))
        save_file(
            tensors,
            str(self.path / name),
            metadata={_ITEMS_KEY: json.dumps(items), "format": FORMAT},
        )
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        entries = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                props = meta.properties
                entries[fqn] = {
                    "dtype": str(props.dtype).removeprefix("torch."),
                    "size": list(meta.size),
                    "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks],
                }
            else:
                entries[fqn] = {"bytes": True}
        storage = [
            [r.index.fqn, None if r.index.offset is None else list(r.index.offset), r.storage_data]
            for rank in results
            for r in rank
        ]
        planner_data = metadata.planner_data or {}
        document = {
            "format": FORMAT,
            "version": metadata.version,
            "items": entries,
            "storage": storage,
            "flattening": {fqn: list(path) for fqn, path in planner_data.items()},
        }
        (self.path / METADATA_FILE).write_text(json.dumps(document))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))


def _metadata(document: Any, *, source: str) -> Metadata:
    """DCP's metadata from ``metadata.json``'s document, built by fields."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not a {FORMAT} checkpoint description")
    items: dict[str, Any] = {}
    for fqn, entry in document["items"].items():
        if entry.get("bytes"):
            items[fqn] = BytesStorageMetadata()
            continue
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
            for o, s in entry["chunks"]
        ]
        properties = TensorProperties(dtype=_dtype(entry["dtype"], source=source))
        items[fqn] = TensorStorageMetadata(properties, torch.Size(entry["size"]), chunks)
    storage = {
        MetadataIndex(fqn, offset): (where["file"], where["key"])
        for fqn, offset, where in document["storage"]
    }
    flattening = {fqn: tuple(path) for fqn, path in document["flattening"].items()}
    return Metadata(
        state_dict_metadata=items,
        planner_data=flattening,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=document.get("version"),
    )


class SafetensorsReader(StorageReader):
    """DCP's storage reader for what `SafetensorsWriter` wrote."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = pathlib.Path(path)
        self.storage: dict[MetadataIndex, tuple[str, str]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = pathlib.Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        source = self.path / METADATA_FILE
        try:
            document = json.loads(source.read_text())
            return _metadata(document, source=str(source))
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"{source} is not a readable checkpoint description: {exc!r}"
            ) from None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from safetensors import safe_open

        by_file: dict[str, list[ReadItem]] = {}
        for request in plan.items:
            by_file.setdefault(self.storage[request.storage_index][0], []).append(request)
        for name, requests in by_file.items():
            source = self.path / name
            try:
                handle = safe_open(str(source), framework="pt")
            except Exception as exc:
                raise CheckpointError(
                    f"{source} is not a readable safetensors file: {exc}"
                ) from None
            with handle as stored:
                header = stored.metadata() or {}
                values = json.loads(header.get(_ITEMS_KEY, "{}"))
                for request in requests:
                    key = self.storage[request.storage_index][1]
                    if request.type == LoadItemType.BYTE_IO:
                        if key not in values:
                            raise CheckpointError(f"{source} lacks the value {key!r}")
                        planner.load_bytes(request, io.BytesIO(values[key].encode()))
                        continue
                    try:
                        tensor = stored.get_tensor(key)
                    except Exception:
                        raise CheckpointError(f"{source} lacks the tensor {key!r}") from None
                    for dim, (start, length) in enumerate(
                        zip(request.storage_offsets, request.lengths, strict=True)
                    ):
                        tensor = tensor.narrow(dim, int(start), int(length))
                    target = planner.resolve_tensor(request).detach()
                    if target.size() != tensor.size():
                        raise CheckpointError(
                            f"{source}: {key!r} holds {tuple(tensor.shape)} where "
                            f"{tuple(target.shape)} is loaded"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(request, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def save(state: dict[str, Any], *, directory: str) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` to ``directory`` in this format
    (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dcp_save(state, storage_writer=SafetensorsWriter(directory), planner=JsonSavePlanner())


def load(state: dict[str, Any], *, directory: str) -> None:
    """``torch.distributed.checkpoint.load`` of ``directory`` into ``state`` (every rank); a
    malformed file comes out as the `CheckpointError` naming it."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    reader = SafetensorsReader(directory)
    reader.read_metadata()  # here first: DCP would fold this error into its own text
    try:
        dcp_load(state, storage_reader=reader, planner=JsonLoadPlanner())
    except CheckpointException as exc:
        ours = [f[0] for f in exc.failures.values() if isinstance(f[0], CheckpointError)]
        if ours:
            raise ours[0] from None
        raise
