"""A state (nested dicts, lists, tuples, tensors, numbers, strings and a few allowed data
classes) as flat tensors plus a JSON skeleton: what a checkpoint file holds instead of a
pickle, so reading it runs no code.

The skeleton is plain JSON. Numbers, strings, booleans, None and lists stand for themselves;
the other values are tagged objects:

    {"$tensor": "3"}                      the tensor stored under key "3"
    {"$dict": [[k, v], ...]}              a dict (keys of any encodable type, order kept)
    {"$odict": [[k, v], ...]}             a ``collections.OrderedDict``
    {"$tuple": [...]}, {"$size": [...]}   a tuple, a ``torch.Size``
    {"$enum": "mod.Name", "value": v}     a member of an allowed enum
    {"$object": "mod.Name", "fields": {...}}  an allowed class rebuilt from its ``__dict__``
                                          (``__new__`` then the fields; its ``__init__`` and
                                          any other code of it do not run)

`decode` refuses a tag it does not know and a class that is not in ``allowed``.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable, Mapping
from typing import Any

import torch


class StateCodecError(ValueError):
    """A value that cannot be encoded, or a skeleton that does not decode; says which."""


def qualified_name(cls: type) -> str:
    """``module.QualName`` of ``cls``: how the skeleton names it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def encode(state: Any, *, allowed: Iterable[type] = ()) -> tuple[dict[str, torch.Tensor], Any]:
    """``state`` as (tensors by key, JSON-serialisable skeleton).

    Tensors come back detached, on the CPU and contiguous; a tensor that shares its storage
    with another one (tied weights, views into a flat buffer) is copied, so that each key owns
    its bytes.

    Raises:
        StateCodecError: naming the path of a value of another type.
    """
    classes = tuple(allowed)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def tensor(t: torch.Tensor) -> dict[str, str]:
        flat = t.detach().cpu().contiguous()
        storage = flat.untyped_storage()
        whole = storage.nbytes() == flat.numel() * flat.element_size()
        if storage.data_ptr() in seen or not whole:
            flat = flat.clone()
        seen.add(flat.untyped_storage().data_ptr())
        key = str(len(tensors))
        tensors[key] = flat
        return {"$tensor": key}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return tensor(value)
        if isinstance(value, enum.Enum):  # before int: an IntEnum is an int
            if not isinstance(value, classes):
                raise StateCodecError(f"{path}: {qualified_name(type(value))} is not allowed")
            return {"$enum": qualified_name(type(value)), "value": walk(value.value, path)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Size):
            return {"$size": list(value)}
        if isinstance(value, Mapping):
            tag = "$odict" if isinstance(value, collections.OrderedDict) else "$dict"
            return {tag: [[walk(k, path), walk(v, f"{path}.{k}")] for k, v in value.items()]}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple) and type(value) is tuple:
            return {"$tuple": [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, classes):
            fields = {k: walk(v, f"{path}.{k}") for k, v in _fields(value).items()}
            return {"$object": qualified_name(type(value)), "fields": fields}
        raise StateCodecError(
            f"{path}: a {qualified_name(type(value))} has no encoding (allowed: tensors, "
            "numbers, strings, None, dicts, lists, tuples and the allowed classes)"
        )

    return tensors, walk(state, "state")


def _fields(value: Any) -> dict[str, Any]:
    if hasattr(value, "_asdict"):  # a named tuple
        return dict(value._asdict())
    return dict(vars(value))


def decode(
    skeleton: Any, tensors: Mapping[str, torch.Tensor], *, allowed: Iterable[type] = ()
) -> Any:
    """The state `encode` turned into ``(tensors, skeleton)``.

    Raises:
        StateCodecError: an unknown tag, a class not in ``allowed``, or a missing tensor.
    """
    classes = {qualified_name(c): c for c in allowed}

    def allowed_class(name: Any) -> type:
        if name not in classes:
            raise StateCodecError(f"the state names a class that is not allowed: {name!r}")
        return classes[name]

    def walk(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise StateCodecError(f"not a value of this encoding: {str(node)[:80]}")
        if "$tensor" in node:
            if node["$tensor"] not in tensors:
                raise StateCodecError(f"the state refers to a missing tensor {node['$tensor']!r}")
            return tensors[node["$tensor"]]
        if "$dict" in node or "$odict" in node:
            kind = dict if "$dict" in node else collections.OrderedDict
            pairs = node["$dict"] if "$dict" in node else node["$odict"]
            return kind((walk(k), walk(v)) for k, v in pairs)
        if "$tuple" in node:
            return tuple(walk(v) for v in node["$tuple"])
        if "$size" in node:
            return torch.Size(int(x) for x in node["$size"])
        if "$enum" in node:
            return allowed_class(node["$enum"])(walk(node["value"]))
        if "$object" in node:
            cls = allowed_class(node["$object"])
            fields = {k: walk(v) for k, v in node["fields"].items()}
            if hasattr(cls, "_make"):  # a named tuple
                return cls(**fields)
            obj: Any = object.__new__(cls)
            obj.__dict__.update(fields)
            return obj
        raise StateCodecError(f"unknown tag in {sorted(node)}")

    return walk(skeleton)
