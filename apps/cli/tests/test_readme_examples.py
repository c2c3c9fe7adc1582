"""The READMEs' examples do what they say: the root README's ``rlhf train`` command passes the
command's validation as written, and apps/cli's Python example trains and evaluates."""

from __future__ import annotations

import ast
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[3]


def _block(text: str, language: str, containing: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


def test_the_root_readme_rl_command_is_valid_as_written() -> None:
    from rlhf.cli.main import _parse
    from rlhf.cli.presets import resolve

    command = _block((ROOT / "README.md").read_text(), "bash", "rlhf train grpo")
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:3] == ["rlhf", "train", "grpo"]
    config = _parse(type(resolve("grpo")), words[3:], resolve("grpo"), "rlhf train grpo")
    config.validate()  # raises ConfigError naming every problem
    assert config.rollout.max_new_tokens < config.rollout.max_len
    assert config.actor.num_ranks == 4 and config.vllm.num_engines == 4


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
