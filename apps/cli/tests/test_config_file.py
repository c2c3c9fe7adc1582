"""``--config FILE``: values nested like the flags, typed against the config classes, every
problem listed at once with file:line before anything starts."""

from __future__ import annotations

import pytest

from rlhf.cli.config import ConfigError, RLConfig
from rlhf.cli.config_file import load
from rlhf.cli.main import _parse, given_names
from rlhf.cli.presets import resolve

from .conftest import rlhf

GOOD = """\
rollout:
  batch_size: 8
  temperature: 1        # an integer for a float field
vllm:
  verify_sync: true     # read as the flag would: --vllm.verify_sync True
  enforce_eager: false
data:
  prompt_data_probs: [0.25, 0.75]
algo:
  kl:
    init_coef: 0.0
"""


def test_values_apply_over_the_preset_and_flags_win(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(GOOD)
    preset = resolve("grpo")
    config = load(preset, str(path))
    assert config.rollout.batch_size == 8
    assert config.rollout.temperature == 1.0 and isinstance(config.rollout.temperature, float)
    assert config.vllm.verify_sync == "True" and config.verify_mode == "full"
    assert config.vllm.enforce_eager is False
    assert config.data.prompt_data_probs == (0.25, 0.75)
    assert config.algo.kl.init_coef == 0.0
    # The rest of the preset's sections stays as the preset set it.
    assert config.algo.advantage == preset.algo.advantage
    assert config.rollout.n_samples_per_prompt == preset.rollout.n_samples_per_prompt
    flagged = _parse(RLConfig, ["--config", str(path), "--rollout.batch_size", "3"], preset, "x")
    assert flagged.rollout.batch_size == 3 and flagged.vllm.verify_sync == "True"
    (tmp_path / "run.json").write_text('{"train": {"num_steps": 7}}')
    assert load(preset, str(tmp_path / "run.json")).train.num_steps == 7


def test_an_alias_sets_its_field_as_a_flag_and_as_a_key(tmp_path) -> None:
    """``--train.agent_timeout_s`` (the spelling users bring) is ``--train.agent_step_timeout_s``
    in both its forms and in a --config file, and counts as given."""
    preset = resolve("grpo")
    assert preset.train.agent_step_timeout_s != 5.0
    for flags in (["--train.agent_timeout_s", "5"], ["--train.agent_timeout_s=5"]):
        assert _parse(RLConfig, flags, preset, "x").train.agent_step_timeout_s == 5.0
    (tmp_path / "run.yaml").write_text("train:\n  agent_timeout_s: 7\n")
    assert load(preset, str(tmp_path / "run.yaml")).train.agent_step_timeout_s == 7.0
    given = given_names(["--config", str(tmp_path / "run.yaml"), "--train.agent_timeout_s", "1"])
    assert "train.agent_step_timeout_s" in given and "train.agent_timeout_s" not in given


BAD = """\
algo: 5
rollout:
  batch_size: big
  nsamples: 4
train:
  num_steps: 2.5
vllm:
  enforce_eager: "yes"
  dtype: float64
"""


def test_every_problem_is_named_with_its_line(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    with pytest.raises(ConfigError) as raised:
        load(resolve("grpo"), str(path))
    message = str(raised.value)
    expected = [
        f"6 problems in {path}:",
        f"  - {path}:1: algo is a section (the --algo.* flags): expected its keys and values, "
        "got 5",
        f"  - {path}:3: rollout.batch_size (--rollout.batch_size) expects an integer, got 'big'",
        f"  - {path}:4: unknown key 'rollout.nsamples' (no flag --rollout.nsamples)",
        f"  - {path}:6: train.num_steps (--train.num_steps) expects an integer, got 2.5",
        f"  - {path}:8: vllm.enforce_eager (--vllm.enforce_eager) expects true or false or null, "
        "got 'yes'",
        f"  - {path}:7: vllm: vllm.dtype must be auto, float32, bfloat16 or float16",
    ]
    for line in expected:
        assert line in message, message


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("syntax.yaml", "rollout:\n  batch_size: [1, 2\n", "syntax.yaml:3:1: not valid YAML"),
        ("syntax.json", '{"rollout": {"batch_size": 8,}}', "syntax.json:1:30: not valid JSON"),
        ("list.yaml", "- 1\n- 2\n", "expected sections and values"),
        ("latin1.yaml", "run_dir: caf\xe9\n", "not UTF-8 text"),
    ],
)
def test_unreadable_files_are_named(tmp_path, name, text, message) -> None:
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load(resolve("grpo"), str(path))


def test_the_command_stops_before_starting_anything(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    out = rlhf("train", "grpo", "--config", str(path), "--run_dir", str(tmp_path))
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    assert f"rlhf: 6 problems in {path}:" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "config.json").exists()
    out = rlhf("train", "grpo", "--config", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2 and "no such file" in out.stderr
