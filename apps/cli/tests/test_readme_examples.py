"""The READMEs' examples do what they say: the root README's ``rlhf train`` command passes the
command's validation as written, and apps/cli's Python example trains and evaluates."""

from __future__ import annotations

import ast
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[3]


def _block(text: str, language: str, containing: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


READMES = [ROOT / "README.md", ROOT / "apps" / "cli" / "README.md", ROOT / "benchmarks" / "README.md",
           *sorted((ROOT / "packages").glob("*/README.md"))]  # fmt: skip


def _commands() -> list[tuple[str, list[str]]]:
    """Every ``rlhf …`` command line in the READMEs' shell blocks (continuations joined,
    comments and leading ``VAR=value`` assignments dropped), with where it stands."""
    found = []
    for path in READMES:
        text = path.read_text()
        for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if not re.match(r"^\s*([A-Z_]+=\S*\s+)*rlhf\s", line):
                    continue
                words = shlex.split(line, comments=True)
                while words[0] != "rlhf":
                    words = words[1:]
                where = f"{path.relative_to(ROOT)}: {' '.join(words[:3])}"
                found.append((where, words))
    return found


def _config(words: list[str]):
    """The config the command line parses into, as the command parses it (OpenRLHF's flags
    read too; tyro: unknown flags and bad values fail)."""
    from rlhf.cli.demo import DemoConfig
    from rlhf.cli.main import _parse, parse_rl, parse_serve_rm, parse_trainer

    command, rest = words[1], [w for w in words[2:] if w != "..."]
    if command == "train":
        kind, flags = rest[0], rest[1:]
        if kind in ("sft", "rm", "dpo"):
            return parse_trainer(kind, flags)
        return parse_rl(kind, flags)
    if command == "serve-rm":
        return parse_serve_rm(rest)
    return _parse(DemoConfig, rest, DemoConfig(), f"rlhf {command}")


@pytest.mark.parametrize(("where", "words"), _commands(), ids=[w for w, _ in _commands()])
def test_every_readme_command_parses_and_validates_as_written(where, words) -> None:
    """A full command line passes the command's validation as written; one with ``...``
    (the flags of a command shown before it) at least parses."""
    from rlhf.cli.main import main

    if words[1] in ("config", "env"):
        assert main(words[1:]) == 0, where
        return
    config = _config(words)
    if "..." not in words and hasattr(config, "validate"):
        config.validate()  # raises ConfigError naming every problem


def test_the_commands_are_found() -> None:
    """The reader above sees the commands (a changed fence or prompt would hide them)."""
    where = [w for w, _ in _commands()]
    assert "README.md: rlhf train grpo" in where  # the root README's 1.5B command
    assert "README.md: rlhf train ppo" in where  # its OpenRLHF command line
    for kind in ("sft", "rm", "dpo", "ppo"):
        assert f"apps/cli/README.md: rlhf train {kind}" in where


QWEN2_5_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
}  # fmt: skip
"""The shape of the model the root README's real-model example names (its config.json)."""


def test_the_real_model_example_plans_on_the_gpus_its_prose_states(tmp_path, capsys) -> None:
    import json

    from rlhf.cli.main import main

    text = (ROOT / "README.md").read_text()
    section = text.split("### The same command on a real model", 1)[1]
    stated = int(re.search(r"on (\d+) GPUs of one node", section).group(1))
    block = _block(section, "bash", "rlhf train grpo")
    model = tmp_path / "Qwen2.5-1.5B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN2_5_1_5B))
    words = shlex.split(block.replace("\\\n", " "))
    words = [str(model) if w == "/models/Qwen2.5-1.5B-Instruct" else w for w in words]
    assert main([*words[1:], "--dry_run"]) == 0  # it fits
    plan = capsys.readouterr().out
    gpus, nodes = re.search(r"\[capacity\] (\d+) GPU\(s\) .*?, (\d+) node\(s\)", plan).groups()
    assert (int(gpus), int(nodes)) == (stated, 1), plan


def test_the_root_readme_installs_the_command_with_its_engines() -> None:
    install = _block((ROOT / "README.md").read_text(), "bash", "pip install ./packages/rlhf-*")
    lines = [line for line in install.splitlines() if "./apps/cli" in line]
    assert lines and all('"./apps/cli[cpu]"' in x or '"./apps/cli[gpu]"' in x for x in lines)


def test_the_python_example_trains(tmp_path) -> None:
    code = _block(
        (ROOT / "apps" / "cli" / "README.md").read_text(),
        "python",
        "from rlhf.cli.rl import run_rl",
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-4000:]
    last = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert last["step"] == 2 and 0.0 <= last["eval/sort4/pass@1"] <= 1.0
    assert (tmp_path / "runs/python-example/rl/final/model.safetensors").is_file()
