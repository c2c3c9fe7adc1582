"""Forward passes of the roles: action log-probs (and entropy), values, sequence scores.

All outputs are aligned with ``input_ids`` (see `rlhf.learner.batch`): ``out[:, t]`` belongs to
token ``t``, computed from the hidden state at ``t − 1``; position 0 is 0.

With ``packing_samples`` the rows run padding-free: `pack` lays their real tokens end to end in
one row of N tokens with position ids restarting at 0 for each sequence, the model runs on that
row without an attention mask (transformers then keeps attention within each sequence — a
block-causal mask for ``sdpa``/``eager``, variable-length kernels for ``flash_attention_2``),
and the outputs are scattered back into the padded (B, L) layout, so objectives and loss
aggregation see the same per-sequence rows either way. `check_packing` verifies on a probe that
a model really keeps packed sequences apart.

With ``chunked_lm_head`` `token_logprobs` runs the model's body only and projects its hidden
states through ``lm_head`` chunk by chunk inside `rlhf.algos.linear_logprobs_and_entropy`, so
the (tokens × vocabulary) logits never exist at once, in the forward or the backward pass.
`check_chunked_lm_head` verifies on a probe that the model's logits are that plain projection.
A backend whose parameters are whole only inside a forward method (FSDP2) gives the model a
``forward_with_head(fn)`` method, registered as a forward, that returns ``fn(body, lm_head)``:
the chunked computation then runs inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf.algos import linear_logprobs_and_entropy, logprobs_and_entropy
from rlhf.learner.batch import Batch


def _shift_right(x: Tensor) -> Tensor:
    """(B, L−1) → (B, L) with a zero first column."""
    return torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)


@dataclass(frozen=True)
class Packed:
    """The real tokens of a right-padded (B, L) batch laid end to end in one row.

    Attributes:
        input_ids: (1, N) the N real tokens, row after row.
        position_ids: (1, N) each token's position within its own sequence.
        rows: (N,) the padded row of each packed token.
        cols: (N,) its column there.
        shape: (B, L) of the padded batch.
    """

    input_ids: Tensor
    position_ids: Tensor
    rows: Tensor
    cols: Tensor
    shape: tuple[int, int]

    def unpack(self, values: Tensor, *, shifted: bool = False) -> Tensor:
        """(1, N, ...) packed outputs → (B, L, ...) padded, 0 at padding.

        Args:
            values: One value (or vector) per packed token.
            shifted: ``values[:, p]`` was computed from token ``p − 1``: at the first token of
                each sequence that is the previous sequence's last token, so it is zeroed
                (column 0, as in the padded layout).
        """
        flat = values[0]
        if shifted:
            first = (self.cols == 0).view(-1, *([1] * (flat.dim() - 1)))
            flat = torch.where(first, torch.zeros_like(flat), flat)
        out = flat.new_zeros((*self.shape, *flat.shape[1:]))
        return out.index_put((self.rows, self.cols), flat)


def pack(input_ids: Tensor, attention_mask: Tensor) -> Packed:
    """Lay the real tokens of ``input_ids`` (B, L), right-padded, end to end in one row.

    Position ids count real tokens within each row, so every sequence starts at 0 — the
    boundary transformers reads from them.
    """
    mask = attention_mask > 0
    rows, cols = mask.nonzero(as_tuple=True)
    positions = (mask.long().cumsum(dim=1) - 1)[rows, cols]
    return Packed(
        input_ids=input_ids[rows, cols][None],
        position_ids=positions[None],
        rows=rows,
        cols=cols,
        shape=(int(input_ids.shape[0]), int(input_ids.shape[1])),
    )


FORWARD_WITH_HEAD = "forward_with_head"
"""The method a sharded model may offer: ``model.forward_with_head(fn)`` → ``fn(body, lm_head)``
run as one of the model's forwards (its parameters gathered while it runs)."""


def _logits(model: torch.nn.Module) -> Callable[..., Tensor]:
    return lambda **inputs: model(**inputs, use_cache=False).logits


def _outputs(
    run: Callable[..., Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    packing_samples: bool,
    head: Callable[[Tensor, Tensor], tuple[Tensor | None, ...]],
    *,
    shifted: bool,
) -> tuple[Tensor | None, ...]:
    """``head(run(inputs), input_ids)`` → per-token tensors, in the padded layout.

    ``run`` maps model inputs to the model's output tensor (b, n, ...) — logits, or hidden
    states for a chunked head; ``head`` maps it and the ids the model saw (b, n) to tensors
    of shape (b, n) (None passes through). With packing b = 1 and n = N and the results are
    unpacked.
    """
    if not packing_samples:
        return head(run(input_ids=input_ids, attention_mask=attention_mask), input_ids)
    packed = pack(input_ids, attention_mask)
    if packed.input_ids.shape[1] == 0:  # no real token anywhere: nothing to pack
        return head(run(input_ids=input_ids, attention_mask=attention_mask), input_ids)
    out = run(input_ids=packed.input_ids, position_ids=packed.position_ids)
    return tuple(
        None if x is None else packed.unpack(x, shifted=shifted)
        for x in head(out, packed.input_ids)
    )


def lm_head_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(body, lm_head) of a transformers causal LM, also behind a DeepSpeed engine or PEFT.

    Raises:
        ValueError: the model has no plain ``nn.Linear`` output projection (e.g. a LoRA-wrapped
            head, whose weight alone is not the projection).
    """
    # Duck-typed (a DeepSpeed engine wraps the module; PEFT and transformers methods follow):
    # torch types a Module's attributes as Tensor | Module, which hides them.
    inner: Any = getattr(model, "module", model)
    if hasattr(inner, "get_base_model"):  # PEFT
        inner = inner.get_base_model()
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"model.chunked_lm_head needs a plain nn.Linear lm_head; this model's is "
            f"{type(head).__name__}"
        )
    return inner.get_decoder(), head


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    packing_samples: bool = False,
    chunked_lm_head: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of every token given its prefix, on temperature-scaled logits.

    Args:
        model: A causal LM.
        input_ids: (B, L).
        attention_mask: (B, L), right-padded.
        temperature: The sampler's temperature (log-probs must match what it sampled from).
        with_entropy: Also return the entropy of each position's distribution.
        packing_samples: Run the rows padding-free (see the module docstring).
        chunked_lm_head: Never materialise the logits (see the module docstring).

    Returns:
        (B, L) float32 log-probs and (B, L) entropies or None; column 0 is 0.
    """
    if chunked_lm_head:

        def chunked(body: torch.nn.Module, lm_head: torch.nn.Linear) -> tuple[Tensor | None, ...]:
            def run(**inputs: Tensor) -> Tensor:
                return body(**inputs, use_cache=False).last_hidden_state

            def head(hidden: Tensor, ids: Tensor) -> tuple[Tensor | None, ...]:
                lp, ent = linear_logprobs_and_entropy(
                    hidden[:, :-1],
                    lm_head.weight,
                    ids[:, 1:],
                    bias=lm_head.bias,
                    temperature=temperature,
                    with_entropy=with_entropy,
                )
                return _shift_right(lp.float()), (
                    _shift_right(ent.float()) if ent is not None else None
                )

            return _outputs(run, input_ids, attention_mask, packing_samples, head, shifted=True)

        forward_with_head = getattr(model, FORWARD_WITH_HEAD, None)
        lp, ent = (
            forward_with_head(chunked) if forward_with_head else chunked(*lm_head_parts(model))
        )
    else:

        def head(logits: Tensor, ids: Tensor) -> tuple[Tensor | None, ...]:
            lp, ent = logprobs_and_entropy(
                logits[:, :-1], ids[:, 1:], temperature=temperature, with_entropy=with_entropy
            )
            return _shift_right(lp.float()), (
                _shift_right(ent.float()) if ent is not None else None
            )

        run = _logits(model)
        lp, ent = _outputs(run, input_ids, attention_mask, packing_samples, head, shifted=True)
    assert lp is not None
    return lp, ent


def batch_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` of a `Batch`, run with the forward options it carries
    (``packing_samples``, ``chunked_lm_head``)."""
    return token_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        temperature=temperature,
        with_entropy=with_entropy,
        packing_samples=batch.packing_samples,
        chunked_lm_head=batch.chunked_lm_head,
    )


def token_values(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    packing_samples: bool = False,
) -> Tensor:
    """Critic values V(s_t) of the state in which token ``t`` is chosen.

    Returns:
        (B, L) float32; column 0 is 0.
    """
    (values,) = _outputs(
        _logits(model),
        input_ids,
        attention_mask,
        packing_samples,
        lambda out, _: (_shift_right(out[:, :-1, 0].float()),),
        shifted=True,
    )
    assert values is not None
    return values


def sequence_scores(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    packing_samples: bool = False,
) -> Tensor:
    """Reward-model score of each sequence: the head at its last real token.

    Returns:
        (B,) float32.
    """
    (out,) = _outputs(
        _logits(model),
        input_ids,
        attention_mask,
        packing_samples,
        lambda logits, _: (logits[..., 0].float(),),
        shifted=False,
    )
    assert out is not None
    last = attention_mask.long().sum(dim=1).clamp(min=1) - 1
    return out.gather(1, last[:, None])[:, 0]


def _probe(device: torch.device | str) -> tuple[Tensor, Tensor]:
    """Two sequences of 5 and 3 tokens (ids below 9: inside any vocabulary), right-padded."""
    ids = torch.zeros((2, 5), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = torch.arange(5, device=device), 1
    ids[1, :3], mask[1, :3] = torch.tensor([1, 8, 3], device=device), 1
    return ids, mask


def _tolerance(reference: Tensor) -> float:
    """What rounding alone may move ``reference`` by: bf16/fp16 round differently in two
    layouts; a real difference (a leak across sequences, a missing logit transform) moves
    outputs by O(1)."""
    scale = float(reference.float().abs().max()) + 1.0
    return (2e-2 if reference.dtype in (torch.bfloat16, torch.float16) else 1e-4) * scale


def check_chunked_lm_head(model: torch.nn.Module, *, device: torch.device | str, flag: str) -> None:
    """Raise when projecting ``model``'s hidden states through its ``lm_head`` does not give
    its log-probs (a model that scales or soft-caps its logits, say).

    Args:
        model: The role's model (or its engine), in eval mode; every rank calls this.
        device: Where the probe runs.
        flag: The option that turned the chunked head on, for the message.
    """
    ids, mask = _probe(device)
    with torch.no_grad():
        try:
            chunked, _ = token_logprobs(model, ids, mask, chunked_lm_head=True)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}; turn {flag} off") from exc
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        plain, _ = token_logprobs(model, ids, mask)
    gap = float((chunked - plain).abs().max())
    tolerance = _tolerance(logits)
    if not gap <= tolerance:
        raise ValueError(
            f"{flag}: this model's logits are not its lm_head's projection of the final "
            f"hidden states (a probe's log-probs moved by {gap:.3g}, tolerance "
            f"{tolerance:.3g}); turn {flag} off"
        )


def check_packing(model: torch.nn.Module, *, device: torch.device | str, flag: str) -> None:
    """Raise when ``model`` lets packed sequences attend to each other.

    Runs a probe of two sequences packed into one row and compares the second sequence's
    outputs with a forward of it alone; a model whose attention ignores the position-id
    boundaries gives different outputs (its tokens see the first sequence).

    Args:
        model: The role's model (or its engine), in eval mode; every rank calls this.
        device: Where the probe runs.
        flag: The option that turned packing on, for the message.
    """
    ids, mask = _probe(device)
    with torch.no_grad():
        packed = pack(ids, mask)
        together = model(
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False
        ).logits[0, 5:]
        alone = model(input_ids=ids[1:, :3], use_cache=False).logits[0]
    gap = float((together.float() - alone.float()).abs().max())
    tolerance = _tolerance(alone)
    if not gap <= tolerance:
        raise ValueError(
            f"{flag}: this model's attention does not keep packed sequences apart (a probe's "
            f"outputs moved by {gap:.3g}, tolerance {tolerance:.3g}); its transformers "
            "implementation must derive the attention of packed rows from position_ids (as "
            f"transformers' sdpa, eager and flash_attention_2 paths do) — turn {flag} off"
        )
