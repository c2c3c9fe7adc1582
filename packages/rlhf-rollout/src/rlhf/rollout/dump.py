"""Rollout dumps: every step's `Rollout` on disk, to train again from it without sampling
(replay) or to read a divergence offline.

The format (``rlhf-rollout-dump/1``), no pickle anywhere::

    <directory>/dump.json                     {"format": ..., "meta": {...}}
    <directory>/step-000001/samples.safetensors
    <directory>/step-000001/rollout.json

``meta`` is the writer's description of what produced the samples (the CLI records the
policy's weights digest and the sampling settings; `RolloutDump.check_meta` compares it). Step
directories are named by the 1-based step that trained on them (as ``metrics.jsonl`` counts).
``samples.safetensors`` holds the trajectories of the step, ragged streams flattened with
offsets (B trajectories, N tokens in all, M turns in all):

- ``token_ids`` int64 (N,), ``action_mask`` int8 (N,), ``rollout_logprobs`` float64 (N,),
  ``offsets`` int64 (B + 1,): trajectory ``i`` is ``[offsets[i], offsets[i + 1])``;
- ``prompt_length``, ``prompt_index``, ``sample_index`` int64 (B,); ``weight_version`` int64
  (B,), −1 where unknown; ``reward``, ``score`` float64 (B,); ``truncated`` int8 (B,);
- ``turn_rewards`` float64 (M,) with ``turn_offsets`` int64 (B + 1,); ``turn_ends`` int64 with
  ``turn_end_offsets`` int64 (B + 1,).

``rollout.json`` holds the step (0-based, as `Rollout.step`), the step's metrics, the prompt
sampler's state, each trajectory's data source, finish reason and metrics. Floats are float64
in the tensors and Python's shortest round-trip text in JSON, so a dump reads back equal to the
rollout it was written from (bit for bit). A step directory appears whole or not at all (written
beside, then renamed).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import torch

from rlhf.rollout.schedule import Rollout

DUMP_FORMAT = "rlhf-rollout-dump/1"
"""The ``format`` of ``dump.json``."""


class DumpError(ValueError):
    """A dump directory that is missing, of another format, or holds no such step."""


def _offsets(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0) if lengths else out[1:]
    return out


def _flat(rows: list[tuple[Any, ...]], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=dtype)


class RolloutDump:
    """One dump directory: `create` (or reopen) it to `write` rollouts, `open` it to `read`.

    Attributes:
        directory: The dump's directory.
        meta: What produced the samples, as the writer described it.
    """

    def __init__(self, directory: pathlib.Path, meta: Mapping[str, Any]) -> None:
        self.directory = directory
        self.meta = dict(meta)

    @classmethod
    def create(cls, directory: str | os.PathLike[str], *, meta: Mapping[str, Any]) -> RolloutDump:
        """A dump in ``directory`` described by ``meta``: a new one, or the one there with the
        same ``meta`` (a resumed run goes on writing it).

        Raises:
            DumpError: ``directory`` holds a dump of other samples (its differing ``meta``
                keys named) or of another format.
        """
        root = pathlib.Path(directory)
        if (root / "dump.json").exists():
            dump = cls.open(root)
            differing = dump.check_meta(meta)
            if differing:
                listed = "; ".join(differing)
                raise DumpError(
                    f"{root} already holds a rollout dump of other samples ({listed}); dump into "
                    "another directory"
                )
            return dump
        root.mkdir(parents=True, exist_ok=True)
        staged = root / "dump.json.tmp"
        staged.write_text(json.dumps({"format": DUMP_FORMAT, "meta": dict(meta)}, indent=1))
        os.replace(staged, root / "dump.json")
        return cls(root, meta)

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> RolloutDump:
        """The dump in ``directory``.

        Raises:
            DumpError: no ``dump.json`` there, or one of another format.
        """
        root = pathlib.Path(directory)
        try:
            head = json.loads((root / "dump.json").read_text())
        except FileNotFoundError:
            raise DumpError(f"{root} holds no rollout dump (no dump.json)") from None
        except ValueError as exc:
            raise DumpError(f"{root}/dump.json is not JSON ({exc})") from None
        if not isinstance(head, dict) or head.get("format") != DUMP_FORMAT:
            found = head.get("format") if isinstance(head, dict) else None
            raise DumpError(f"{root}/dump.json is format {found!r}, not {DUMP_FORMAT!r}")
        return cls(root, head.get("meta") or {})

    def check_meta(self, expected: Mapping[str, Any]) -> list[str]:
        """``key: dumped X, here Y`` for each key of ``expected`` whose dumped value differs."""
        return [
            f"{key}: dumped {self.meta.get(key)!r}, here {value!r}"
            for key, value in expected.items()
            if self.meta.get(key) != value
        ]

    def _step_dir(self, step: int) -> pathlib.Path:
        return self.directory / f"step-{step + 1:06d}"

    def steps(self) -> list[int]:
        """The 0-based steps the dump holds, in order."""
        found = []
        for path in self.directory.glob("step-*"):
            suffix = path.name.removeprefix("step-")
            if suffix.isdigit() and (path / "rollout.json").is_file():
                found.append(int(suffix) - 1)
        return sorted(found)

    def write(self, rollout: Rollout) -> pathlib.Path:
        """Write ``rollout`` as its step's directory (replacing one of the same step)."""
        from safetensors.torch import save_file

        trajectories = rollout.trajectories
        tensors = {
            "token_ids": _flat([t.token_ids for t in trajectories], torch.int64),
            "action_mask": _flat([t.action_mask for t in trajectories], torch.int8),
            "rollout_logprobs": _flat([t.rollout_logprobs for t in trajectories], torch.float64),
            "offsets": _offsets([len(t.token_ids) for t in trajectories]),
            "prompt_length": torch.tensor(
                [t.prompt_length for t in trajectories], dtype=torch.int64
            ),
            "prompt_index": torch.tensor([t.prompt_index for t in trajectories], dtype=torch.int64),
            "sample_index": torch.tensor([t.sample_index for t in trajectories], dtype=torch.int64),
            "weight_version": torch.tensor(
                [-1 if t.weight_version is None else t.weight_version for t in trajectories],
                dtype=torch.int64,
            ),
            "reward": torch.tensor([t.reward for t in trajectories], dtype=torch.float64),
            "score": torch.tensor([t.score for t in trajectories], dtype=torch.float64),
            "truncated": torch.tensor([t.truncated for t in trajectories], dtype=torch.int8),
            "turn_rewards": _flat([t.turn_rewards for t in trajectories], torch.float64),
            "turn_offsets": _offsets([len(t.turn_rewards) for t in trajectories]),
            "turn_ends": _flat([t.turn_ends for t in trajectories], torch.int64),
            "turn_end_offsets": _offsets([len(t.turn_ends) for t in trajectories]),
        }
        record = {
            "step": rollout.step,
            "metrics": dict(rollout.metrics),
            "sampler_state": dict(rollout.sampler_state),
            "sources": list(rollout.sources),
            "finish_reasons": [t.finish_reason for t in trajectories],
            "trajectory_metrics": [dict(t.metrics) for t in trajectories],
        }
        final = self._step_dir(rollout.step)
        staged = final.with_name(final.name + ".tmp")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        save_file(tensors, str(staged / "samples.safetensors"), metadata={"format": DUMP_FORMAT})
        (staged / "rollout.json").write_text(json.dumps(record))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)
        return final

    def read(self, step: int) -> Rollout:
        """The rollout of 0-based ``step``.

        Raises:
            DumpError: the dump holds no such step (naming the steps it holds).
        """
        from safetensors.torch import load_file

        from rlhf.agents import Trajectory

        where = self._step_dir(step)
        if not (where / "rollout.json").is_file():
            held = self.steps()
            holds = f"steps {held[0] + 1}-{held[-1] + 1}" if held else "no step"
            raise DumpError(
                f"{self.directory} holds no rollout for step {step + 1} (it holds {holds})"
            )
        record = json.loads((where / "rollout.json").read_text())
        t = load_file(str(where / "samples.safetensors"))

        def span(name: str, offsets: str, i: int) -> list[Any]:
            lo, hi = int(t[offsets][i]), int(t[offsets][i + 1])
            return t[name][lo:hi].tolist()

        trajectories = []
        for i in range(int(t["offsets"].numel()) - 1):
            version = int(t["weight_version"][i])
            trajectories.append(
                Trajectory(
                    token_ids=tuple(span("token_ids", "offsets", i)),
                    action_mask=tuple(span("action_mask", "offsets", i)),
                    rollout_logprobs=tuple(span("rollout_logprobs", "offsets", i)),
                    prompt_length=int(t["prompt_length"][i]),
                    reward=float(t["reward"][i]),
                    turn_rewards=tuple(span("turn_rewards", "turn_offsets", i)),
                    score=float(t["score"][i]),
                    truncated=bool(t["truncated"][i]),
                    finish_reason=record["finish_reasons"][i],
                    metrics=dict(record["trajectory_metrics"][i]),
                    prompt_index=int(t["prompt_index"][i]),
                    sample_index=int(t["sample_index"][i]),
                    weight_version=None if version < 0 else version,
                    turn_ends=tuple(span("turn_ends", "turn_end_offsets", i)),
                )
            )
        return Rollout(
            step=int(record["step"]),
            trajectories=trajectories,
            metrics=dict(record["metrics"]),
            sampler_state=dict(record["sampler_state"]),
            sources=list(record["sources"]),
        )
