"""OpenRLHF 0.11.2's flags read by ``rlhf`` (`rlhf.cli.openrlhf`) and bare boolean switches
(`rlhf.cli.switches`): parsing only, no run."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing
from typing import Any

import pytest

from rlhf.cli import openrlhf
from rlhf.cli.config import ConfigError, RLConfig
from rlhf.cli.main import parse_rl, parse_serve_rm, parse_trainer
from rlhf.cli.preference import PreferenceConfig
from rlhf.cli.serve_rm import ServeRMConfig
from rlhf.cli.sft import SFTConfig
from rlhf.cli.switches import boolean_flags

DATA = pathlib.Path(__file__).parent / "data" / "openrlhf_0.11.2_flags.json"
OPENRLHF = json.loads(DATA.read_text())["entry_points"]
README = pathlib.Path(__file__).parents[3] / "README.md"


def field_of(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


PARSERS: dict[str, tuple[type, Any]] = {
    "train_ppo_ray": (RLConfig, lambda flags: parse_rl("ppo", flags)),
    "train_sft": (SFTConfig, lambda flags: parse_trainer("sft", flags)),
    "train_rm": (PreferenceConfig, lambda flags: parse_trainer("rm", flags)),
    "train_dpo": (PreferenceConfig, lambda flags: parse_trainer("dpo", flags)),
    "serve_rm": (ServeRMConfig, parse_serve_rm),
}
"""OpenRLHF entry point → our config class and the parser of the command that reads it."""


def field_type(dotted: str, cls: Any = RLConfig) -> Any:
    kind: Any = None
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        kind = hints[part]
        members = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        cls = next((m for m in members if dataclasses.is_dataclass(m)), None)
    return kind


@pytest.mark.parametrize("entry_point", sorted(PARSERS))
def test_the_table_holds_every_flag_of_each_entry_point_with_its_arity(entry_point: str) -> None:
    table = openrlhf.TABLES[entry_point]
    flags = OPENRLHF[entry_point]
    assert sorted(table) == sorted(flags)
    wrong = {
        n: (table[n].arity, f["arity"]) for n, f in flags.items() if table[n].arity != f["arity"]
    }
    assert not wrong, wrong


@pytest.mark.parametrize("entry_point", sorted(PARSERS))
def test_a_same_flag_is_our_field_and_every_alias_names_fields(entry_point: str) -> None:
    ours = set(_dotted_fields(PARSERS[entry_point][0]))
    for row in openrlhf.TABLES[entry_point].values():
        if isinstance(row.entry, openrlhf.Same):
            assert row.name in ours, row.name
        if isinstance(row.entry, openrlhf.Alias):
            missing = [f for f in row.entry.fields if f not in ours]
            assert not missing, (row.name, missing)


def _dotted_fields(cls: Any, prefix: str = "") -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        members = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        nested = [m for m in members if dataclasses.is_dataclass(m)]
        names += _dotted_fields(nested[0], f"{prefix}{f.name}.") if nested else [prefix + f.name]
    return names


def _members(kind: Any) -> list[Any]:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(kind) if a is not type(None)]
    return [kind]


SAMPLES = {
    "algo.policy_loss.dual_clip": ["3.0"],
    "algo.policy_loss.name": ["gspo"],
    "algo.loss_agg_mode": ["seq-mean-token-mean"],
    "train.deepspeed_enable_sleep": ["True"],
    **{f"{r}.deepspeed.grad_accum_dtype": ["bf16"] for r in ("actor", "critic", "model")},
    **{f"{r}.deepspeed.hpz_partition_size": ["2"] for r in ("actor", "critic", "model")},
}
"""Values of fields whose validation rules out the generic sample."""

CONTEXT = {
    "actor.model.load_in_4bit": ["--ds.lora.rank", "4"],
    "model.model.load_in_4bit": ["--ds.lora.rank", "4"],
    "actor.deepspeed.deepcompile": ["--ds.param_dtype", "bf16"],
    "model.deepspeed.deepcompile": ["--ds.param_dtype", "bf16"],
    **{f"{r}.deepspeed.hpz_partition_size": ["--ds.zero_stage", "3"] for r in ("actor", "model")},
}
"""Flags a field's sample needs beside it (on both spellings)."""


def _sample(dotted: str, cls: Any = RLConfig) -> list[str]:
    """A valid value of our field ``dotted``."""
    if dotted in SAMPLES:
        return SAMPLES[dotted]
    members = _members(field_type(dotted, cls))
    if bool in members:
        return ["True"]
    if tuple in [typing.get_origin(m) for m in members]:
        return ["0.125", "0.75"] if "float" in str(members) else ["q_proj", "v_proj"]
    if int in members:
        return ["3"]
    if float in members:
        return ["0.125"]
    return ["/some/where"]


PLAIN_ALIASES = [
    (entry_point, row)
    for entry_point, table in openrlhf.TABLES.items()
    for row in table.values()
    if isinstance(row.entry, openrlhf.Alias) and row.entry.fields and row.entry.values is None
]


@pytest.mark.parametrize(
    ("entry_point", "row"), PLAIN_ALIASES, ids=[f"{e}:{r.name}" for e, r in PLAIN_ALIASES]
)
def test_each_alias_parses_to_the_fields_it_claims(entry_point: str, row: openrlhf.Row) -> None:
    cls, parse = PARSERS[entry_point]
    fields = row.entry.fields
    context = CONTEXT.get(fields[0], [])
    if row.arity == "switch":  # bare means True; an explicit False reaches the field too
        for theirs, value in (([], True), (["False"], False)):
            parsed = parse([*context, f"--{row.name}", *theirs])
            ours = parse([*context, *(t for f in fields for t in (f"--{f}", str(value)))])
            assert parsed == ours and {field_of(parsed, f) for f in fields} == {value}
        return
    value = _sample(fields[0], cls)
    theirs = parse([*context, f"--{row.name}", *value])
    ours = parse([*context, *(t for f in fields for t in (f"--{f}", *value))])
    assert theirs == ours
    default = parse(context)
    for target in fields:
        assert field_of(theirs, target) != field_of(default, target), target


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--ds.param_dtype", "bf16"],
            {"actor.deepspeed.bf16": True, "critic.deepspeed.bf16": True},
        ),
        (["--vllm.sync_backend", "nccl"], {"train.weight_transport": "broadcast"}),
        (["--vllm.sync_with_ray"], {"train.weight_transport": "object_store"}),
        (["--data.prompt_probs", "0.25,0.75"], {"data.prompt_data_probs": (0.25, 0.75)}),
        (["--actor.lr_scheduler", "cosine_with_min_lr"], {"actor.optimizer.schedule": "cosine"}),
        (
            ["--critic.lr_scheduler", "constant_with_warmup"],
            {"critic.optimizer.schedule": "constant"},
        ),
        (["--ckpt.best_metric_key", "eval_math_pass1"], {"eval.best_metric": "eval/math/pass@1"}),
        (
            ["--actor.eps_clip_low_high", "0.2", "0.28"],
            {"algo.policy_loss.clip_eps_low": 0.2, "algo.policy_loss.clip_eps_high": 0.28},
        ),
        (["--actor.num_nodes", "2", "--actor.num_gpus_per_node", "3"], {"actor.num_ranks": 6}),
        (["--actor.num_nodes", "1"], {"actor.num_ranks": 8}),  # OpenRLHF's 8 GPUs per node
        (["--critic.num_gpus_per_node", "2"], {"critic.num_ranks": 2}),
        (["--train.enable_ema"], {"actor.optimizer.ema_decay": 0.992}),
        (["--train.enable_ema", "--train.ema_beta", "0.9"], {"actor.optimizer.ema_decay": 0.9}),
        (["--train.ema_beta", "0.9"], {"actor.optimizer.ema_decay": None}),
        (
            ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096"],
            {"train.max_tokens_per_micro_batch": 4096},
        ),
        (["--train.dynamic_batch_enable"], {"train.max_tokens_per_micro_batch": 16192}),
        (["--ds.zpg", "1", "--ds.value_head_prefix", "score"], {}),
        (["--algo.advantage.is_correction_level", "off"], {"algo.rollout_correction": None}),
        (
            ["--ds.zero_stage", "1", "--ds.enable_sleep"],
            {
                "actor.deepspeed.zero_stage": 1,
                "critic.deepspeed.zero_stage": 1,
                "train.deepspeed_enable_sleep": True,
            },
        ),
        (
            ["--ds.zero_stage", "3", "--ds.enable_sleep"],
            {"actor.deepspeed.zero_stage": 3, "train.deepspeed_enable_sleep": True},
        ),
        (["--train.num_episodes", "2"], {"train.num_episodes": 2}),
        (
            [
                "--actor.optim",
                "muon",
                "--actor.muon.lr",
                "0.01",
                "--actor.muon.momentum",
                "0.9",
                "--actor.muon.ns_steps",
                "5",
                "--actor.muon.nesterov",
                "--actor.adam.lr",
                "3e-4",
            ],
            {
                "actor.optimizer.name": "muon",
                "actor.optimizer.muon_lr": 0.01,
                "actor.optimizer.muon_momentum": 0.9,
                "actor.optimizer.lr": 3e-4,
                "critic.optimizer.name": "adamw",
            },
        ),
        (["--critic.optim", "adam"], {"critic.optimizer.name": "adamw"}),
    ],
)
def test_translated_values_reach_our_fields(flags: list[str], expected: dict[str, Any]) -> None:
    config = parse_rl("ppo", flags)
    assert {k: field_of(config, k) for k in expected} == expected


def test_openrlhf_rollout_correction_is_ours_with_its_names() -> None:
    config = parse_rl(
        "grpo",
        ["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode",
         "clip", "--algo.advantage.is_correction_threshold", "0.8", "2", "--train.num_steps", "3"],
    )  # fmt: skip
    correction = config.algo.rollout_correction
    # OpenRLHF's seq level gates the sequence's mean log-ratio: our geometric level.
    assert (correction.level, correction.mode, correction.threshold) == (
        "geometric",
        "truncate",
        (0.8, 2.0),
    )
    assert config.train.num_steps == 3
    # A single value is OpenRLHF's upper bound alone; the default mode is mask.
    single = parse_rl("grpo", ["--algo.advantage.is_correction_level", "token",
                               "--algo.advantage.is_correction_threshold", "4"])  # fmt: skip
    correction = single.algo.rollout_correction
    assert (correction.level, correction.mode, correction.threshold) == (
        "token",
        "mask",
        (0.0, 4.0),
    )


def test_openrlhf_divergence_gates_are_ours_with_an_upper_bound() -> None:
    # FlashREINFORCE's trust region: seq level, binary_kl gating, a single threshold.
    config = parse_rl("grpo", ["--algo.advantage.is_correction_level", "seq",
                               "--algo.advantage.is_correction_gating", "binary_kl",
                               "--algo.advantage.is_correction_threshold", "0.01"])  # fmt: skip
    correction = config.algo.rollout_correction
    assert (correction.level, correction.mode, correction.threshold, correction.gating) == (
        "geometric",
        "mask",
        (0.0, 0.01),
        "binary_kl",
    )
    tv = parse_rl("grpo", ["--algo.advantage.is_correction_level", "token",
                           "--algo.advantage.is_correction_gating", "tv",
                           "--algo.advantage.is_correction_threshold", "0.2"])  # fmt: skip
    assert tv.algo.rollout_correction.gating == "tv"
    assert tv.algo.rollout_correction.level == "token"
    for extra in ([], ["--algo.advantage.is_correction_threshold", "0.1", "0.5"],
                  ["--algo.advantage.is_correction_mode", "clip",
                   "--algo.advantage.is_correction_threshold", "0.1"]):  # fmt: skip
        with pytest.raises(ConfigError, match=r"gating tv masks by an upper bound only: give "
                           r"--algo\.advantage\.is_correction_threshold HIGH"):  # fmt: skip
            parse_rl("grpo", ["--algo.advantage.is_correction_level", "token",
                              "--algo.advantage.is_correction_gating", "tv", *extra])  # fmt: skip


def test_sleep_under_async_is_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    """OpenRLHF's async pipeline with ``--train.colocate_all`` colocates the learner models
    only: the engines keep their GPUs, so ``--ds.enable_sleep`` has nothing to make room for."""
    flags = ["--ds.zero_stage", "3", "--ds.enable_sleep", "--train.colocate_all"]
    config = parse_rl("ppo", [*flags, "--train.async_enable"])
    assert config.train.deepspeed_enable_sleep is None and not config.train.colocate_all
    assert "--ds.enable_sleep with --train.async_enable is accepted and has no effect" in (
        capsys.readouterr().err
    )
    assert parse_rl("ppo", flags).train.deepspeed_enable_sleep is True


def test_zero0_sleep_is_refused_naming_the_flags() -> None:
    """ZeRO-1/2/3 learners move their states under ``--ds.enable_sleep``; ZeRO-0 keeps no
    partitions to move, and the refusal names our flags."""
    from rlhf.cli.config import ConfigError

    config = parse_rl("ppo", ["--ds.zero_stage", "0", "--ds.enable_sleep", "--train.colocate_all"])
    with pytest.raises(ConfigError, match="--train.deepspeed_enable_sleep True offloads") as err:
        config.validate()
    assert "--actor.deepspeed.zero_stage (and --critic.deepspeed.zero_stage) to 1, 2 or 3" in str(
        err.value
    )


def test_a_flag_without_effect_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    plain = parse_rl("ppo", [])
    noted = parse_rl("ppo", ["--local_rank", "3", "--logger.logging_steps", "10"])
    assert noted == plain
    err = capsys.readouterr().err
    assert "--local_rank is accepted and has no effect here" in err
    assert "--logger.logging_steps is accepted and has no effect here" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--actor.optim", "lion"], "adam, muon"),
        (["--actor.muon.ns_steps", "3"], "5 Newton-Schulz steps"),
        (["--actor.muon.no_nesterov"], "Nesterov"),
        (["--data.image_key", "images"], "issue 45"),
        (["--ds.param_dtype", "fp16"], "accepted here: bf16"),
        (["--algo.advantage.is_correction_gating", "kl"], "binary_kl"),
        (["--use_ms"], "--use_ms True"),
    ],
)
def test_a_refused_flag_names_itself_and_what_to_use(flags: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_rl("ppo", flags)
    message = str(caught.value)
    assert flags[0] in message and named in message, message


def test_reference_and_reward_model_gpu_counts_are_noted(capsys) -> None:
    # They score as one replica here whatever OpenRLHF's count: the run is the same.
    flags = [
        "--ref.num_nodes",
        "2",
        "--ref.num_gpus_per_node",
        "4",
        "--reward.num_gpus_per_node",
        "2",
    ]
    assert parse_rl("ppo", flags) == parse_rl("ppo", [])
    err = capsys.readouterr().err
    for flag in ("--ref.num_nodes", "--ref.num_gpus_per_node", "--reward.num_gpus_per_node"):
        assert (
            f"{flag} is accepted and has no effect here: the reference and the reward model run as one data-parallel replica"
            in err
        )


BOOLEAN_CONTEXT = {
    "actor.deepspeed.offload_params": ["--actor.deepspeed.zero_stage", "3"],
    "critic.deepspeed.offload_params": ["--critic.deepspeed.zero_stage", "3"],
    "actor.deepspeed.deepcompile": ["--actor.deepspeed.bf16", "True"],
    "critic.deepspeed.deepcompile": ["--critic.deepspeed.bf16", "True"],
    "actor.model.load_in_4bit": ["--actor.model.lora_rank", "4"],
    "critic.model.load_in_4bit": ["--critic.model.lora_rank", "4"],
    "teacher.deepspeed.offload_params": ["--teacher.deepspeed.zero_stage", "3"],
    "teacher.deepspeed.deepcompile": ["--teacher.deepspeed.bf16", "True"],
}
"""Flags a boolean needs beside it to pass validation when it is True."""


@pytest.mark.parametrize("name", sorted(boolean_flags(RLConfig)))
def test_every_boolean_field_takes_a_bare_switch_and_true_false(name: str) -> None:
    context = BOOLEAN_CONTEXT.get(name, [])
    bare = parse_rl("ppo", [*context, f"--{name}"])
    assert bare == parse_rl("ppo", [*context, f"--{name}", "True"])
    assert field_of(bare, name) is True
    assert field_of(parse_rl("ppo", [*context, f"--{name}", "false"]), name) is False


def test_a_bare_switch_before_another_flag_and_auto() -> None:
    assert {"train.colocate_all", "ckpt.load_enable"} <= boolean_flags(RLConfig)
    mixed = parse_rl(
        "ppo", ["--train.colocate_all", "--train.num_steps", "5", "--ckpt.load_enable", "auto"]
    )
    assert (mixed.train.colocate_all, mixed.train.num_steps, mixed.ckpt.load_enable) == (
        True, 5, "auto",
    )  # fmt: skip
    last = parse_rl("ppo", ["--train.num_steps", "5", "--train.async_enable"])
    assert last.train.async_enable is True


def test_openrlhf_documentation_switches_run_bare() -> None:
    config = parse_rl(
        "grpo",
        ["--train.colocate_all", "--algo.dynamic_filtering_enable", "--ckpt.load_enable",
         "--vllm.enable_sleep", "--ds.enable_sleep", "--ckpt.save_hf"],
    )  # fmt: skip
    assert config.train.colocate_all and config.algo.dynamic_filtering_enable
    assert config.ckpt.load_enable is True
    assert config.vllm.enable_sleep and config.train.deepspeed_enable_sleep and config.ckpt.save_hf
    assert parse_rl("grpo", ["--ckpt.disable_ds"]).ckpt.save_state is False
    assert parse_rl("grpo", ["--train.async_enable"]).train.async_enable is True


def test_async_with_colocate_all_colocates_the_learners_only(capsys) -> None:
    config = parse_rl("grpo", ["--train.colocate_all", "--train.async_enable"])
    assert (config.train.async_enable, config.train.colocate_all) == (True, False)
    assert config.train.colocate_actor_ref is True
    assert "colocates the learner models only, as in OpenRLHF" in capsys.readouterr().err


def test_the_readme_migration_section_is_the_table() -> None:
    text = README.read_text()
    start, end = "<!-- openrlhf:flags -->\n", "<!-- /openrlhf:flags -->"
    assert start in text and end in text
    section = text.split(start, 1)[1].split(end, 1)[0]
    assert section == openrlhf.migration_markdown()


def _openrlhf_default_tokens(entry_point: str, row: openrlhf.Row) -> list[str] | None:
    """OpenRLHF's default of ``row`` as command-line values (None: it has none to give)."""
    default = OPENRLHF[entry_point][row.name]["default"]
    if row.arity == "switch":
        return [str(bool(default))] if default in (True, False, "") else None
    if default is None or (isinstance(default, str) and "(" in default):
        return None
    values = default if isinstance(default, list) else [default]
    return [str(v) for v in values]


DEFAULTED = [
    (entry_point, row)
    for entry_point, table in openrlhf.TABLES.items()
    for row in table.values()
    if isinstance(row.entry, openrlhf.Same | openrlhf.Alias)
    and not (isinstance(row.entry, openrlhf.Alias) and not row.entry.fields)
    and _openrlhf_default_tokens(entry_point, row) is not None
]


@pytest.mark.parametrize(
    ("entry_point", "row"), DEFAULTED, ids=[f"{e}:{r.name}" for e, r in DEFAULTED]
)
def test_a_default_that_differs_from_openrlhfs_is_documented(
    entry_point: str, row: openrlhf.Row
) -> None:
    parse = PARSERS[entry_point][1]
    values = _openrlhf_default_tokens(entry_point, row)
    assert values is not None
    context = ["--ds.param_dtype", "bf16"] if row.name == "ds.deepcompile" else []
    theirs = parse([*context, f"--{row.name}", *values])
    if theirs != parse(context):
        assert row.entry.default, f"--{row.name}: OpenRLHF's default {values} is not ours"


def test_help_lists_each_openrlhf_flag_with_what_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    from rlhf.cli.main import main

    with pytest.raises(SystemExit) as leaving:
        main(["train", "grpo", "--help"])  # the common flags, with their OpenRLHF spellings
    assert leaving.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--actor.model.path TEXT (default: '') HF checkpoint directory" in out
    assert "OpenRLHF: --actor.model_name_or_path." in out
    with pytest.raises(SystemExit) as leaving:
        main(["train", "grpo", "--help-all"])  # every flag, then every OpenRLHF spelling
    assert leaving.value.code == 0
    out = capsys.readouterr().out
    assert "--train.num_steps" in out  # our own flags first
    assert "  --actor.model_name_or_path  --actor.model.path\n" in out
    assert (
        "  --ds.adam_offload  --actor.deepspeed.offload_optimizer, --critic.deepspeed.offload_optimizer\n"
        in out
    )
    assert "  --actor.muon.lr  --actor.optimizer.muon_lr\n" in out
    with pytest.raises(SystemExit):
        main(["train", "dpo", "--help-all"])
    assert "  --model.beta  --beta\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("kind", "flags", "expected"),
    [
        ("sft", ["--data.input_key", "q"], {"input_key": "q", "messages_key": None}),
        ("sft", ["--data.multiturn", "--data.input_key", "chat"], {"messages_key": "chat"}),
        ("sft", ["--model.pretrain_mode_enable"], {"pretrain": True}),
        ("sft", ["--train.max_epochs", "2"], {"num_epochs": 2}),
        ("rm", ["--model.margin_loss_enable"], {"margin_key": "margin"}),
        ("rm", ["--model.loss_type", "logexp"], {"loss_type": "log_exp"}),
        ("dpo", ["--model.ipo_enable", "--model.beta", "0.5"], {"loss_type": "ipo", "beta": 0.5}),
        (
            "dpo",
            ["--model.model_name_or_path", "/m", "--ref.model_name_or_path", "/m"],
            {"model.model.path": "/m"},
        ),
        ("dpo", ["--lr_warmup_ratio", "0.1"], {"model.optimizer.warmup_ratio": 0.1}),
        ("rm", ["--ckpt.save_steps", "-1"], {"ckpt.save_steps": 0}),
        (
            "sft",
            ["--ds.lora.target_modules", "q_proj", "v_proj"],
            {"model.model.lora_target_modules": ("q_proj", "v_proj")},
        ),
    ],
)
def test_trainer_flags_reach_our_fields(
    kind: str, flags: list[str], expected: dict[str, Any]
) -> None:
    config = parse_trainer(kind, flags)
    assert {k: field_of(config, k) for k in expected} == expected


def test_a_dpo_reference_other_than_the_initial_model_is_refused() -> None:
    flags = ["--model.model_name_or_path", "/a", "--ref.model_name_or_path", "/b"]
    with pytest.raises(ConfigError, match="--ref.model_name_or_path /b: the DPO reference"):
        parse_trainer("dpo", flags)


def test_serve_rm_flags_reach_our_fields() -> None:
    config = parse_serve_rm(
        ["--reward.model_name_or_path", "/rm", "--ds.param_dtype", "bf16", "--data.max_len", "77"]
    )
    assert (config.model_path, config.dtype, config.max_len) == ("/rm", "bfloat16", 77)
    assert not config.load_in_4bit and parse_serve_rm(["--ds.load_in_4bit"]).load_in_4bit


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("tis", ("token", "truncate")), ("icepop", ("token", "mask")),
     ("seq-mask-tis", ("geometric", "mask"))],
)  # fmt: skip
def test_openrlhf_0_11_0_correction_spellings_are_read(kind: str, expected: tuple) -> None:
    config = parse_rl(
        "grpo",
        ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", kind,
         "--algo.advantage.is_correction_threshold", "0.5", "2"],
    )  # fmt: skip
    correction = config.algo.rollout_correction
    assert (correction.level, correction.mode, correction.threshold) == (*expected, (0.5, 2.0))
    assert (
        parse_rl("grpo", ["--algo.advantage.is_correction_type", "icepop"]).algo.rollout_correction
        is None
    )
    with pytest.raises(ConfigError, match="use one spelling"):
        parse_rl("grpo", ["--algo.advantage.is_correction_enable",
                          "--algo.advantage.is_correction_level", "token"])  # fmt: skip


def test_epochs_count_the_dataset_rows(tmp_path: pathlib.Path) -> None:
    from rlhf.cli.trainer_state import steps_of_epochs

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input": str(i), "output": "x"}) + "\n" for i in range(10)))
    lines: list[str] = []
    config = parse_trainer(
        "sft", ["--train.max_epochs", "2", "--dataset", str(data), "--batch_size", "4"]
    )
    # 2 epochs × 10 rows / 4 rows per step = 5 steps; 3 rows per step would be ceil(20/3) = 7.
    assert steps_of_epochs(config, echo=lines.append) == 5
    assert lines == ["[plan] --num_epochs 2: 10 rows / --batch_size 4 -> 5 steps"]
    assert steps_of_epochs(dataclasses.replace(config, batch_size=3), echo=lines.append) == 7
    assert steps_of_epochs(dataclasses.replace(config, num_epochs=0), echo=lines.append) == 100
    # --data.max_samples 6: 2 × 6 / 4 = 3 steps.
    capped = parse_trainer("sft", ["--train.max_epochs", "2", "--dataset", str(data),
                                   "--batch_size", "4", "--data.max_samples", "6"])  # fmt: skip
    assert steps_of_epochs(capped, echo=lines.append) == 3


def test_episodes_count_the_prompts(tmp_path: pathlib.Path) -> None:
    from rlhf.cli.rl import steps_of_episodes

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"input": str(i), "label": "x"}) + "\n" for i in range(10)))
    b.write_text("".join(json.dumps({"input": str(i), "label": "x"}) + "\n" for i in range(7)))
    flags = ["--data.prompt_dataset", f"{a},{b}", "--rollout.batch_size", "4"]
    lines: list[str] = []
    # 2 episodes × (17 prompts // 4 per step) = 8 steps; with 5 per source: 2 × (10 // 4) = 4.
    config = steps_of_episodes(
        parse_rl("grpo", [*flags, "--train.num_episodes", "2"]), echo=lines.append
    )
    assert (config.train.num_steps, config.train.num_episodes) == (8, 0)
    assert lines == [
        "[plan] --train.num_episodes 2: 17 prompts / --rollout.batch_size 4 -> 8 steps"
    ]
    capped = parse_rl("grpo", [*flags, "--train.num_episodes", "2", "--data.max_samples", "5"])
    assert steps_of_episodes(capped, echo=lines.append).train.num_steps == 4
    assert steps_of_episodes(parse_rl("grpo", flags), echo=lines.append).train.num_steps == 100


def test_an_unknown_flag_near_an_openrlhf_one_suggests_both_spellings() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_rl("ppo", ["--actor.model_name_or_pth", "/m"])
    message = str(caught.value)
    assert message.startswith("unknown flag --actor.model_name_or_pth; did you mean")
    assert "--actor.model_name_or_path (OpenRLHF's: --actor.model.path)" in message
    with pytest.raises(
        ConfigError,
        match=r"unknown flag --rollout.n_sample_per_prompt; did you mean --rollout.n_samples_per_prompt",
    ):
        parse_rl("grpo", ["--rollout.n_sample_per_prompt", "4"])
    with pytest.raises(
        ConfigError,
        match=r"unknown flag --model.bta; did you mean --model.beta \(OpenRLHF's: --beta\)",
    ):
        parse_trainer("dpo", ["--model.bta", "0.1"])


def test_the_estimator_on_rlhf_train_ppo_decides_the_critic_as_in_openrlhf() -> None:
    assert parse_rl("ppo", []).uses_critic  # OpenRLHF's default estimator: gae
    for estimator in ("group_norm", "reinforce", "reinforce_baseline", "rloo", "dr_grpo"):
        config = parse_rl("ppo", ["--algo.advantage.estimator", estimator])
        assert not config.uses_critic, estimator


def test_critic_freezing_steps_count_from_zero_as_in_openrlhf() -> None:
    # OpenRLHF trains the actor at step s (from 0) when s > N: N freezes N + 1 steps.
    for given, frozen in (("-1", 0), ("0", 1), ("3", 4)):
        config = parse_rl("ppo", ["--critic.freezing_steps", given])
        assert config.train.actor_freezing_steps == frozen, given
    with pytest.raises(ConfigError, match=r"--critic.freezing_steps x: takes a whole number"):
        parse_rl("ppo", ["--critic.freezing_steps", "x"])
    # Without a critic there is nothing to warm up, and nothing would train.
    config = parse_rl("grpo", ["--critic.freezing_steps", "1"])
    with pytest.raises(ConfigError, match=r"--train.actor_freezing_steps .* needs one"):
        config.validate()


def test_the_advantage_and_kl_switches_reach_the_algorithm() -> None:
    config = parse_rl("ppo", ["--algo.advantage.no_std_norm", "--algo.kl.unbiased_gradient"])
    assert config.algo.advantage.std_norm is False and config.algo.kl.unbiased_gradient is True
    assert parse_rl("ppo", ["--algo.advantage.no_std_norm", "False"]).algo.advantage.std_norm


def test_zero_plus_plus_partitions_need_zero3_and_divide_the_ranks(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_rl("ppo", ["--ds.zpg", "8"])  # at OpenRLHF's default ZeRO stage 2
    assert "hpz_partition_size 8 partitions" in capsys.readouterr().err
    config = parse_rl("ppo", ["--ds.zpg", "2", "--ds.zero_stage", "3", "--actor.num_ranks", "3"])
    assert config.actor.deepspeed.hpz_partition_size == 2
    with pytest.raises(ConfigError, match=r"hpz_partition_size 2 must divide the role's 3 ranks"):
        config.validate()


def test_liger_kernels_are_the_policy_s_and_need_gpus() -> None:
    config = parse_rl("ppo", ["--ds.use_liger_kernel"])
    assert config.actor.model.use_liger_kernel and not config.critic.model.use_liger_kernel
    with pytest.raises(ConfigError, match=r"--actor.model.use_liger_kernel needs GPUs"):
        config.validate()
    assert parse_trainer("sft", ["--ds.use_liger_kernel"]).model.model.use_liger_kernel


def test_4bit_loading_is_qlora_and_its_limits_are_named() -> None:
    with pytest.raises(ConfigError, match=r"set --actor.model.lora_rank > 0 too"):
        parse_rl("grpo", ["--ds.load_in_4bit"]).validate()  # nothing to train on the base
    qlora = ["--ds.load_in_4bit", "--ds.lora.rank", "4"]
    config = parse_rl("grpo", qlora)
    assert config.actor.model.load_in_4bit and not config.critic.model.load_in_4bit
    with pytest.raises(ConfigError, match=r"load_in_4bit with --train.ref_reward_offload"):
        parse_rl("grpo", [*qlora, "--ref.offload"]).validate()
    with pytest.raises(ConfigError, match=r"load_in_4bit is built for the deepspeed backend"):
        parse_rl("grpo", [*qlora, "--actor.backend", "molt"]).validate()
    assert parse_trainer("dpo", qlora).model.model.load_in_4bit


def test_the_rollout_correction_takes_plain_flags_anywhere_on_the_line() -> None:
    # A config-or-None section is tyro's subcommand; its flags may stand anywhere, and the
    # flags after them still reach their own sections. The subcommand token keeps working.
    plain = parse_rl("grpo", ["--algo.rollout_correction.mode", "mask", "--train.num_steps", "3"])
    assert plain.algo.rollout_correction is not None
    assert (plain.algo.rollout_correction.mode, plain.train.num_steps) == ("mask", 3)
    token = parse_rl("grpo", ["--train.num_steps", "3", "algo.rollout_correction:rollout_correction_config",
                              "--algo.rollout_correction.mode", "mask"])  # fmt: skip
    assert token == plain
    assert parse_rl("grpo", []).algo.rollout_correction is None


def test_a_flag_the_run_sets_itself_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--actor.optimizer.total_steps is set by the run"):
        parse_rl("grpo", ["--actor.optimizer.total_steps", "50"]).validate()
    with pytest.raises(ConfigError, match=r"--model.optimizer.total_steps is set by the run"):
        parse_trainer("sft", ["--model.model.path", "m", "--dataset", "d",
                              "--model.optimizer.total_steps", "50"]).validate()  # fmt: skip
