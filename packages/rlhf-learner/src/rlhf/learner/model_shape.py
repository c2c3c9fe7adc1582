"""A decoder model's shape from its ``config.json`` alone (no weights are read): the numbers
the capacity planners (`rlhf.learner.capacity`, `rlhf.molt.capacity`,
`rlhf.rollout.capacity`) multiply.

Covers the dense decoder families transformers writes with the usual field names (Llama,
Qwen2/Qwen3, Mistral, Gemma-style configs: ``hidden_size``, ``intermediate_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``vocab_size``, ``tie_word_embeddings``). Mixture-of-experts configs are refused by name.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from rlhf.learner.capacity import DTYPE_BYTES
from rlhf.learner.models import ModelLoadError

_BIASED_QKV = ("qwen2",)
"""Families whose q/k/v projections carry a bias although ``attention_bias`` is absent."""

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _positive(value: object) -> bool:
    """A positive integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes that decide memory.

    Attributes:
        hidden: Model width ``h``.
        intermediate: MLP width ``i`` (gate, up and down projections).
        layers: Decoder layers ``L``.
        heads: Query heads.
        kv_heads: Key/value heads (grouped-query attention; ``heads`` when absent).
        head_dim: Width of one head (``hidden / heads`` when absent).
        vocab: Vocabulary size ``V``.
        tied: The output head shares the input embedding's weight.
        qkv_bias: The q/k/v projections carry biases.
        o_bias: The output projection carries a bias (``attention_bias`` in Llama-style
            configs biases all four; Qwen2 biases q/k/v only).
        dtype_bytes: Bytes per element of the checkpoint's dtype (what vLLM's ``dtype auto``
            serves in).
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    dtype_bytes: int

    @classmethod
    def read(cls, model_dir: str | pathlib.Path, *, flag: str) -> ModelShape:
        """The shape in ``model_dir/config.json``; `ModelLoadError` naming ``flag`` when the file
        is missing, unreadable, lacks a field or describes a mixture-of-experts model."""
        path = pathlib.Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(
                f"{flag} {str(model_dir)!r}: no config.json there (the capacity plan reads only "
                "the model's config.json; the weights need not be present)"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(
                f"{flag}: cannot read {path}: {exc} (cut short or not JSON? restore the file "
                "from the model's source)"
            ) from None
        if not isinstance(raw, dict):
            raise ModelLoadError(
                f"{flag}: {path} holds a JSON {type(raw).__name__}, not the object of a "
                "transformers model config; restore the file from the model's source"
            )
        text = raw.get("text_config")
        return cls.from_dict(text if isinstance(text, dict) else raw, where=f"{flag} ({path})")

    @classmethod
    def from_dict(cls, raw: dict[str, object], *, where: str) -> ModelShape:
        """The shape of a parsed ``config.json``."""
        experts = [key for key in _EXPERT_FIELDS if raw.get(key)]
        if experts:
            raise ModelLoadError(
                f"{where}: a mixture-of-experts model ({experts[0]}={raw[experts[0]]}); the "
                "capacity plan covers dense models only"
            )

        required = ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "vocab_size")  # fmt: skip
        optional = ("num_key_value_heads", "head_dim")
        bad = [
            key
            for key in required + optional
            if (key in required or raw.get(key) is not None) and not _positive(raw.get(key))
        ]
        if bad:
            listed = ", ".join(f"{key!r} ({raw.get(key)!r})" for key in bad)
            raise ModelLoadError(f"{where}: a decoder config needs positive integers in {listed}")
        values = {key: raw[key] for key in required + optional if raw.get(key) is not None}
        ints = {key: int(value) for key, value in values.items() if isinstance(value, int)}
        hidden, heads = ints["hidden_size"], ints["num_attention_heads"]
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        return cls(
            hidden=hidden,
            intermediate=ints["intermediate_size"],
            layers=ints["num_hidden_layers"],
            heads=heads,
            kv_heads=ints.get("num_key_value_heads", heads),
            head_dim=ints.get("head_dim", hidden // heads),
            vocab=ints["vocab_size"],
            tied=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias")) or raw.get("model_type") in _BIASED_QKV,
            o_bias=bool(raw.get("attention_bias")),
            dtype_bytes=DTYPE_BYTES.get(dtype, 4),
        )

    @property
    def embedding_params(self) -> int:
        """The input embedding, plus the output head when it is not tied."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def layer_params(self) -> int:
        """One decoder layer: attention (q, k, v, o and their biases), the gated MLP and the
        two norms."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        attention += ((q + 2 * kv) if self.qkv_bias else 0) + (h if self.o_bias else 0)
        return attention + 3 * h * self.intermediate + 2 * h

    @property
    def layer_tensors(self) -> tuple[int, ...]:
        """Elements of each parameter tensor of one decoder layer (q, k, v, o, their biases,
        gate, up, down, the two norms): what a backend that keeps one host buffer per tensor
        allocates one at a time."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        biases = ((q, kv, kv) if self.qkv_bias else ()) + ((h,) if self.o_bias else ())
        return (h * q, h * kv, h * kv, q * h, *biases, i * h, i * h, h * i, h, h)

    @property
    def other_tensors(self) -> tuple[int, ...]:
        """Elements of the tensors outside the decoder layers: the embedding, an untied head
        and the final norm."""
        head = () if self.tied else (self.vocab * self.hidden,)
        return (self.vocab * self.hidden, *head, self.hidden)

    @property
    def params(self) -> int:
        """Every parameter, a tied head counted once."""
        return self.embedding_params + self.layers * self.layer_params + self.hidden

    def kv_bytes_per_token(self, *, dtype_bytes: int) -> int:
        """Key and value of one token over every layer: ``2 L kv_heads head_dim`` elements."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes
