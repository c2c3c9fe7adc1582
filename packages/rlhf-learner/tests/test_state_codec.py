"""`rlhf.learner.state_codec`: a state as safetensors-ready tensors and a JSON skeleton."""

from __future__ import annotations

import collections
import dataclasses
import enum
import json

import pytest
import torch

from rlhf.learner.state_codec import StateCodecError, decode, encode


class Stage(enum.IntEnum):
    two = 2


@dataclasses.dataclass
class Address:
    numel: int
    start: int


class Scaler:
    def __init__(self) -> None:
        raise AssertionError("decoding must not run __init__")


def _scaler() -> Scaler:
    obj = Scaler.__new__(Scaler)
    obj.cur_scale, obj.history = 1.0, [1, 2]
    return obj


def test_a_state_round_trips_through_json_and_flat_tensors() -> None:
    weight = torch.randn(4, 3)
    state = {
        "module": collections.OrderedDict(w=weight, tied=weight, row=weight[1]),
        "optimizer": {0: {"exp_avg": torch.zeros(2, dtype=torch.bfloat16), "step": 3}, 1: None},
        "shapes": [torch.Size([4, 3]), (1, "a", 2.5, True)],
        "stage": Stage.two,
        "mapping": {"w": Address(numel=12, start=0)},
        "scaler": _scaler(),
        "version": "0.19.8",
    }
    allowed = (Stage, Address, Scaler)
    tensors, skeleton = encode(state, allowed=allowed)
    text = json.dumps(skeleton)  # plain JSON
    # Tied and viewed tensors each own their bytes (safetensors refuses shared storage).
    ptrs = [t.untyped_storage().data_ptr() for t in tensors.values()]
    assert len(set(ptrs)) == len(ptrs) == 4
    assert all(
        t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors.values()
    )
    back = decode(json.loads(text), tensors, allowed=allowed)
    assert isinstance(back["module"], collections.OrderedDict)
    assert list(back["module"]) == ["w", "tied", "row"]
    assert torch.equal(back["module"]["tied"], weight) and torch.equal(
        back["module"]["row"], weight[1]
    )
    assert set(back["optimizer"]) == {0, 1} and back["optimizer"][0]["step"] == 3
    assert back["optimizer"][0]["exp_avg"].dtype == torch.bfloat16
    assert back["shapes"] == [torch.Size([4, 3]), (1, "a", 2.5, True)]
    assert isinstance(back["shapes"][0], torch.Size) and isinstance(back["shapes"][1], tuple)
    assert back["stage"] is Stage.two and back["mapping"]["w"] == Address(12, 0)
    assert isinstance(back["scaler"], Scaler) and vars(back["scaler"]) == vars(state["scaler"])
    assert back["version"] == "0.19.8"


def test_classes_outside_the_allowed_list_are_refused_both_ways() -> None:
    with pytest.raises(StateCodecError, match=r"state\.x: a .*Address has no encoding"):
        encode({"x": Address(1, 2)})
    with pytest.raises(StateCodecError, match=r"state\.s: .*Stage is not allowed"):
        encode({"s": Stage.two})
    tensors, skeleton = encode({"x": Address(1, 2)}, allowed=(Address,))
    with pytest.raises(StateCodecError, match=r"not allowed: '.*Address'"):
        decode(skeleton, tensors)  # a skeleton naming any class does not make it loadable
    forged = {"$object": "os.system", "fields": {}}
    with pytest.raises(StateCodecError, match="not allowed: 'os.system'"):
        decode(forged, {}, allowed=(Address,))
    with pytest.raises(StateCodecError, match="unknown tag"):
        decode({"$pickle": "..."}, {})
    with pytest.raises(StateCodecError, match="missing tensor '7'"):
        decode({"$tensor": "7"}, {})
