"""Micro-batches: right-padded token sequences plus named per-token and per-sequence tensors.

Per-token tensors are aligned with ``input_ids``: position ``t`` of ``action_mask``,
``old_logprobs``, ``advantages``, … refers to token ``t`` (its log-prob is that of token ``t``
given tokens ``< t``; position 0, the first prompt token, is never an action). This is how
``rlhf.agents.Trajectory`` aligns them, so a trajectory's lists become a row as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar, cast, get_args

import torch
from torch import Tensor

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

FieldName = Literal[
    "action_mask",
    "advantages",
    "loss_mask",
    "margin",
    "old_logprobs",
    "old_values",
    "ref_logprobs",
    "ref_logps",
    "returns",
    "rollout_logprobs",
    "token_rewards",
]
"""The names a `Batch`'s fields are read by (type-checked: a misspelt or unknown name is a
type error where it is read, not a KeyError inside a rank). Per token (B, L): ``action_mask``,
``advantages``, ``loss_mask``, ``old_logprobs``, ``old_values``, ``ref_logprobs``,
``returns``, ``rollout_logprobs``, ``token_rewards``; per sequence (B,): ``margin``,
``ref_logps``."""


@dataclass
class Batch:
    """One micro-batch.

    Attributes:
        input_ids: (B, L) token ids, right-padded.
        attention_mask: (B, L) 1 on real tokens.
        fields: Named tensors, (B, L) per token or (B,) per sequence (``action_mask``,
            ``old_logprobs``, ``ref_logprobs``, ``rollout_logprobs``, ``advantages``,
            ``returns``, ``old_values``, ``loss_mask``, ``ref_logps``, …).
        packing_samples: Run the model padding-free: the forward functions of
            `rlhf.learner.forward` lay the rows end to end in one row (`pack`) and return
            their outputs in this padded layout. Backends set it from
            ``ModelConfig.packing_samples``.
        chunked_lm_head: `rlhf.learner.forward.token_logprobs` projects hidden states
            through ``lm_head`` in chunks instead of materialising the logits (from
            ``ModelConfig.chunked_lm_head``).
    """

    input_ids: Tensor
    attention_mask: Tensor
    fields: dict[FieldName, Tensor] = field(default_factory=dict)
    packing_samples: bool = False
    chunked_lm_head: bool = False

    def __getitem__(self, name: FieldName) -> Tensor:
        try:
            return self.fields[name]
        except KeyError:
            raise KeyError(
                f"this step needs batch field {name!r}; the batch has {sorted(self.fields)}"
            ) from None

    def get(self, name: FieldName) -> Tensor | None:
        """The field, or None when absent."""
        return self.fields.get(name)

    @property
    def size(self) -> int:
        """B."""
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> Batch:
        """A copy on ``device``."""
        return Batch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            {k: v.to(device) for k, v in self.fields.items()},
            self.packing_samples,
            self.chunked_lm_head,
        )

    def select(self, rows: Sequence[int]) -> Batch:
        """The rows ``rows``, trimmed to their longest sequence."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        mask = self.attention_mask[index]
        length = max(int(mask.sum(dim=1).max()), 1) if len(index) else 1
        per_token = self.input_ids.shape[1]
        fields: dict[FieldName, Tensor] = {
            k: (v[index][:, :length] if v.dim() >= 2 and v.shape[1] == per_token else v[index])
            for k, v in self.fields.items()
        }
        return Batch(
            self.input_ids[index][:, :length],
            mask[:, :length],
            fields,
            self.packing_samples,
            self.chunked_lm_head,
        )


def collate(
    rows: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    per_token: Mapping[FieldName, Sequence[Sequence[float]]] | None = None,
    per_sequence: Mapping[FieldName, Sequence[float]] | None = None,
) -> Batch:
    """Right-pad token rows (and aligned per-token values) into a `Batch`.

    Args:
        rows: Token ids per sequence.
        pad_token_id: Id written into padding positions (masked everywhere).
        per_token: Name → one list per row, each as long as its row (padding gets 0).
        per_sequence: Name → one number per row.
    """
    if not rows:
        raise ValueError("collate needs at least one row")
    length = max(len(r) for r in rows)
    # One tensor per field from padded Python rows: a tensor per row and a slice copy each
    # took 4 ms of the driver's step for 128 demo rows.
    ids = _padded(rows, length, pad_token_id, torch.long)
    mask = _padded([[1] * len(r) for r in rows], length, 0, torch.long)
    fields: dict[FieldName, Tensor] = {}
    for name, values in (per_token or {}).items():
        if len(values) != len(rows):
            raise ValueError(f"per_token[{name!r}] has {len(values)} rows, expected {len(rows)}")
        for i, (v, r) in enumerate(zip(values, rows, strict=True)):
            if len(v) != len(r):
                raise ValueError(
                    f"per_token[{name!r}] row {i} has {len(v)} values for {len(r)} tokens"
                )
        fields[name] = _padded(values, length, 0.0, torch.float32)
    for name, values in (per_sequence or {}).items():
        if len(values) != len(rows):
            raise ValueError(
                f"per_sequence[{name!r}] has {len(values)} values for {len(rows)} rows"
            )
        fields[name] = torch.tensor(list(values), dtype=torch.float32)
    return Batch(ids, mask, fields)


def _padded(
    rows: Sequence[Sequence[float]], length: int, fill: float, dtype: torch.dtype
) -> Tensor:
    """``rows`` right-padded with ``fill`` to ``length``, as one (len(rows), length) tensor."""
    return torch.tensor([[*r, *([fill] * (length - len(r)))] for r in rows], dtype=dtype)


def micro_batches(
    batch: Batch,
    *,
    max_tokens: int | None = None,
    max_rows: int | None = None,
    packing_samples: bool = False,
) -> list[list[int]]:
    """Rows of ``batch`` grouped into micro-batches, keeping row order.

    A micro-batch holds at most ``max_rows`` rows and at most ``max_tokens`` tokens — counted
    padded to its longest row, or, with ``packing_samples`` (the rows run end to end), as the
    sum of the rows' real tokens. A longer single row gets a micro-batch of its own.
    """
    lengths = batch.attention_mask.sum(dim=1).tolist()
    groups: list[list[int]] = []
    longest = 0
    total = 0
    for i, n in enumerate(lengths):
        if groups:
            rows = len(groups[-1]) + 1
            tokens = total + n if packing_samples else max(longest, n) * rows
            if (max_rows is None or rows <= max_rows) and (
                max_tokens is None or tokens <= max_tokens
            ):
                groups[-1].append(i)
                longest = max(longest, n)
                total += n
                continue
        groups.append([i])
        longest = n
        total = n
    return groups


def shard(groups: Sequence[Sequence[int]], world_size: int) -> list[list[list[int]]]:
    """Deal micro-batches to ranks round-robin; every rank gets at least one when possible.

    Returns:
        Per rank, its micro-batches (lists of row indices).
    """
    per_rank: list[list[list[int]]] = [[] for _ in range(world_size)]
    for i, g in enumerate(groups):
        per_rank[i % world_size].append(list(g))
    return per_rank


def check_fields(batch: Batch, objective: object) -> None:
    """Raise `MissingFieldsError` in the calling process when ``batch`` lacks a field that
    ``objective`` declares it reads (its ``fields()``; an objective that declares none is not
    checked), instead of a KeyError inside a rank after the batch was shipped."""
    declared = getattr(objective, "fields", None)
    if declared is None:
        return
    missing = sorted(set(declared()) - set(batch.fields))
    if missing:
        raise MissingFieldsError(
            f"{type(objective).__name__} reads batch fields {missing}, and the batch has "
            f"{sorted(batch.fields)}: the phase that makes them did not run (a reference for "
            "ref_logprobs, a critic for old_values/returns, the advantages step)"
        )


F = TypeVar("F", bound="DataclassInstance")


def field_names(fields: type[DataclassInstance]) -> frozenset[FieldName]:
    """The batch fields a fields dataclass (`ActorFields`, …) reads: its attributes'
    names, each a `FieldName`."""
    names = frozenset(f.name for f in dataclasses.fields(fields))
    unknown = names - set(get_args(FieldName))
    if unknown:
        raise TypeError(f"{fields.__name__}: attributes that are no FieldName: {sorted(unknown)}")
    return cast("frozenset[FieldName]", names)


def required_fields(fields: type[DataclassInstance]) -> frozenset[FieldName]:
    """The attributes of a fields dataclass without a default: the fields a batch must have."""
    return frozenset(
        cast("FieldName", f.name)
        for f in dataclasses.fields(fields)
        if f.default is dataclasses.MISSING
    )


def view(batch: Batch, fields: type[F], *, need: frozenset[FieldName] = frozenset()) -> F:
    """``batch``'s fields as the dataclass ``fields`` (an objective's typed view: attributes
    instead of names), the optional ones None where absent.

    Args:
        batch: The micro-batch.
        fields: A fields dataclass (`ActorFields`, …).
        need: Optional attributes this step needs all the same (an objective's ``fields()``).

    Raises:
        MissingFieldsError: a required or needed one is absent, naming it and what the batch
            has.
    """
    missing = sorted((required_fields(fields) | need) - set(batch.fields))
    if missing:
        raise MissingFieldsError(
            f"{fields.__name__} needs batch fields {missing}; the batch has {sorted(batch.fields)}"
        )
    present = {name: batch.fields[name] for name in field_names(fields) if name in batch.fields}
    return fields(**present)


@dataclass(frozen=True)
class ActorFields:
    """What the actor's policy loss reads (`rlhf.learner.PPOActorObjective`), each (B, L).

    Attributes:
        action_mask: 1 on tokens the policy produced.
        advantages: Per-token advantages.
        old_logprobs: π_old's log-probs; None: the current policy, detached.
        ref_logprobs: The reference's log-probs (the KL loss).
        rollout_logprobs: The sampler's log-probs (train/rollout correction, the gap metric).
    """

    action_mask: Tensor
    advantages: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None


@dataclass(frozen=True)
class CriticFields:
    """What the clipped value loss reads (`rlhf.learner.CriticObjective`), each (B, L)."""

    action_mask: Tensor
    old_values: Tensor
    returns: Tensor


@dataclass(frozen=True)
class LossMaskFields:
    """What token-NLL losses read (SFT, `rlhf.learner.sequence_logps`): ``loss_mask`` (B, L),
    1 on tokens to learn."""

    loss_mask: Tensor


@dataclass(frozen=True)
class RewardModelFields:
    """What the pairwise reward-model loss reads: an optional per-pair ``margin`` (B,)."""

    margin: Tensor | None = None


@dataclass(frozen=True)
class DPOFields:
    """What the DPO-family losses read: ``loss_mask`` (B, L) on response tokens and the
    reference's sequence log-probs ``ref_logps`` (B,)."""

    loss_mask: Tensor
    ref_logps: Tensor


class MissingFieldsError(KeyError):
    """A batch lacks a field its objective reads; the message names both."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
