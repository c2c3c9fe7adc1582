"""The rows: every flag of OpenRLHF 0.11.2's ``train_ppo_ray``, ``train_sft``, ``train_rm``,
``train_dpo`` and ``serve_rm`` (`TABLES`), and what 0.11.0 spelled otherwise (`EARLIER`)."""

from __future__ import annotations

from rlhf.cli.openrlhf.entries import Gathered, Row
from rlhf.cli.openrlhf.rows_ppo import ppo_rows
from rlhf.cli.openrlhf.rows_trainers import serve_rm_rows, trainer_rows


def _table(rows: list[Row]) -> dict[str, Row]:
    table = {row.name: row for row in rows}
    if len(table) != len(rows):
        raise AssertionError("a flag is listed twice")
    return table


TABLES: dict[str, dict[str, Row]] = {
    "train_ppo_ray": _table(ppo_rows()),
    "train_sft": _table(trainer_rows("sft")),
    "train_rm": _table(trainer_rows("rm")),
    "train_dpo": _table(trainer_rows("dpo")),
    "serve_rm": _table(serve_rm_rows()),
}
"""OpenRLHF entry point → its flags (name without ``--``) → `Row`."""

EARLIER: dict[str, dict[str, Row]] = {
    "train_ppo_ray": _table(
        [
            Row("algo.advantage.is_correction_enable", "switch", Gathered("correction")),
            Row("algo.advantage.is_correction_type", "one", Gathered("correction")),
        ]
    )
}
"""Flags of OpenRLHF 0.11.0 that 0.11.2 renamed, still read (its repository's example scripts
use them): the rollout correction's switch and type (tis, icepop, seq-mask-tis)."""

COMMANDS = {
    "train_ppo_ray": "rlhf train <rl preset>",
    "train_sft": "rlhf train sft",
    "train_rm": "rlhf train rm",
    "train_dpo": "rlhf train dpo",
    "serve_rm": "rlhf serve-rm",
}
"""OpenRLHF entry point → the ``rlhf`` command that reads its flags."""
