"""Help a person can read: ``rlhf train --help`` lists the commands, ``rlhf train <command>
--help`` the common flags by section with their defaults and documentation, ``--help-all``
every flag; all of it within 80 columns. In-process: no subprocess, no Ray."""

from __future__ import annotations

import re

import pytest

from rlhf.cli.config import RLConfig
from rlhf.cli.help import COMMON, WIDTH, attribute_docs, first_sentence
from rlhf.cli.main import main
from rlhf.cli.preference import PreferenceConfig
from rlhf.cli.presets import PRESETS
from rlhf.cli.sft import SFTConfig
from rlhf.cli.switches import field_flags

COMMANDS = [*PRESETS, "sft", "rm", "dpo"]


def _help(capsys, *args: str) -> str:
    try:
        code = main(list(args))
    except SystemExit as exc:  # tyro and the grouped help end with SystemExit(0)
        code = exc.code
    assert code in (0, None)
    return capsys.readouterr().out


def _wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH]


def test_train_help_lists_every_command_within_80_columns(capsys) -> None:
    text = _help(capsys, "train", "--help")
    assert not _wide(text), _wide(text)
    listed = [line.split()[0] for line in text.splitlines() if re.match(r"  \S", line)]
    assert listed == COMMANDS
    assert "--help-all" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_groups_the_common_flags_within_80_columns(capsys, command) -> None:
    text = _help(capsys, "train", command, "--help")
    assert not _wide(text), _wide(text)
    kind = "rl" if command in PRESETS else "sft" if command == "sft" else "preference"
    lines = text.splitlines()
    for flag in COMMON[kind]:
        (i,) = [n for n, line in enumerate(lines) if line.startswith(f"  --{flag} ")]
        assert lines[i + 1].startswith("      ") and lines[i + 1].strip(), flag  # documented
    sections = {f.split(".")[0] for f in COMMON[kind] if "." in f} | {"run"}
    assert {
        line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")
    } >= sections
    assert f"rlhf train {command} --help-all" in " ".join(lines)


@pytest.mark.parametrize(("kind", "cls"), [("rl", RLConfig), ("sft", SFTConfig),
                                           ("preference", PreferenceConfig)])  # fmt: skip
def test_the_common_flags_are_flags(kind, cls) -> None:
    assert set(COMMON[kind]) <= field_flags(cls)


def test_help_all_lists_every_flag_and_the_openrlhf_spellings(capsys) -> None:
    text = _help(capsys, "train", "grpo", "--help-all")
    assert "--algo.policy_loss.clip_eps_low" in text  # not a common flag
    assert "OpenRLHF 0.11 train_ppo_ray flags read by this command" in text


def test_attribute_docs_and_first_sentences() -> None:
    docs = attribute_docs(SFTConfig)
    assert docs["max_len"] == "Truncate rows to this many tokens."
    assert first_sentence("Dr. GRPO (``x``): a. B c.") == "Dr. GRPO (x): a."
    assert first_sentence("no full stop") == "no full stop"


def test_the_readme_demo_numbers_are_written_by_their_generator() -> None:
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[3] / "benchmarks"))
    from demo_numbers import machine, rewrite, sentence

    runs = [
        {"start_pass@1": 0.341, "end_pass@1": 0.86, "wall_s": 27.4, "rl_wall_s": 22.6,
         "to_step_1_s": 7.44},
        {"start_pass@1": 0.341, "end_pass@1": 0.855, "wall_s": 29.2, "rl_wall_s": 24.1,
         "to_step_1_s": 7.21},
    ]  # fmt: skip
    text = sentence(runs, where="2-core Test CPU machine")
    assert text == (
        "Measured on a 2-core Test CPU machine (`nox -s demo-numbers`, 2 runs after a warm-up): "
        "held-out pass@1 **0.34 after SFT → 0.85-0.86 after 40 RL steps**, 27-29 s for the "
        "whole demo once installed (the RL stage 23-24 s, 7.2-7.4 s of it before step 1; the "
        "first run of an installation also compiles DeepSpeed's CPU communication op, ~30 s)."
    )
    readme = (pathlib.Path(__file__).parents[3] / "README.md").read_text()
    replaced = rewrite(readme, text)  # the README has the markers
    assert text in replaced and replaced.count("<!-- demo-numbers -->") == 1
    assert re.fullmatch(r"\d+-core .+ CPU machine", machine())
