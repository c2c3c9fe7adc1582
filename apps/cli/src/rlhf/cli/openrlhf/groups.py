"""What `Gathered` flags become together, once the whole line was read (`FINISHERS`), and
how the README describes each group (`GROUP_DOCS`)."""

from __future__ import annotations

from collections.abc import Callable

from rlhf.algos import CORRECTION_GATINGS
from rlhf.cli.config import ConfigError
from rlhf.cli.openrlhf.entries import NOTE, pair_from_one_or_two, switch


def _ranks(role: str) -> Callable[[dict[str, list[str]]], list[str]]:
    """``--<role>.num_nodes`` × ``--<role>.num_gpus_per_node`` (OpenRLHF's defaults 1 and 8
    for the one not given) → ``--<role>.num_ranks``."""

    def finish(given: dict[str, list[str]]) -> list[str]:
        nodes = int(given.get(f"{role}.num_nodes", ["1"])[0])
        per_node = int(given.get(f"{role}.num_gpus_per_node", ["8"])[0])
        return [f"--{role}.num_ranks", str(nodes * per_node)]

    return finish


CORRECTION_TYPES = {
    "tis": ("token", "clip"),
    "icepop": ("token", "mask"),
    "seq-mask-tis": ("seq", "mask"),
}
"""OpenRLHF 0.11.0's ``--algo.advantage.is_correction_type`` → 0.11.2's level and mode."""


def _correction(given: dict[str, list[str]]) -> list[str]:
    if (
        "algo.advantage.is_correction_enable" in given
        or "algo.advantage.is_correction_type" in given
    ):
        given = _correction_of_0_11_0(given)
    level = given.get("algo.advantage.is_correction_level", ["off"])[0]
    gating = given.get("algo.advantage.is_correction_gating", ["ratio"])[0]
    if gating not in CORRECTION_GATINGS:
        raise ConfigError(
            f"--algo.advantage.is_correction_gating {gating}: choose "
            f"{', '.join(CORRECTION_GATINGS)}"
        )
    if level == "off":
        return []
    # OpenRLHF's seq level reads the sequence's mean: of log-ratios (so the ratios' geometric
    # mean), or of the divergence.
    levels = {"token": "token", "seq": "geometric", "geometric": "geometric"}
    if level not in levels:
        raise ConfigError(f"--algo.advantage.is_correction_level {level}: choose off, token or seq")
    modes = {"mask": "mask", "clip": "truncate"}
    mode = given.get("algo.advantage.is_correction_mode", ["mask"])[0]
    if mode not in modes:
        raise ConfigError(f"--algo.advantage.is_correction_mode {mode}: choose mask or clip")
    threshold = pair_from_one_or_two(
        given.get("algo.advantage.is_correction_threshold", ["0.5", "5.0"])
    )
    if gating != "ratio" and (mode != "mask" or float(threshold[0]) != 0):
        raise ConfigError(
            f"--algo.advantage.is_correction_gating {gating} masks by an upper bound only: give "
            "--algo.advantage.is_correction_threshold HIGH (one value, e.g. 0.01) and "
            "--algo.advantage.is_correction_mode mask"
        )
    return [
        "--algo.rollout_correction.level", levels[level],
        "--algo.rollout_correction.mode", modes[mode],
        "--algo.rollout_correction.threshold", *threshold,
        "--algo.rollout_correction.gating", gating,
    ]  # fmt: skip


def _correction_of_0_11_0(given: dict[str, list[str]]) -> dict[str, list[str]]:
    """0.11.0's switch and type in 0.11.2's terms (seq-mask-tis: the geometric mean of the
    sequence's ratios, masked)."""
    renamed = {"algo.advantage.is_correction_level", "algo.advantage.is_correction_mode"}
    if renamed & set(given):
        raise ConfigError(
            "--algo.advantage.is_correction_enable/_type (OpenRLHF 0.11.0) and "
            "--algo.advantage.is_correction_level/_mode (0.11.2) both given: use one spelling"
        )
    if switch(given.get("algo.advantage.is_correction_enable", ["False"])) != "True":
        return {k: v for k, v in given.items() if k == "algo.advantage.is_correction_gating"}
    kind = given.get("algo.advantage.is_correction_type", ["tis"])[0]
    if kind not in CORRECTION_TYPES:
        raise ConfigError(
            f"--algo.advantage.is_correction_type {kind}: choose {', '.join(CORRECTION_TYPES)}"
        )
    level, mode = CORRECTION_TYPES[kind]
    level = "geometric" if kind == "seq-mask-tis" else level
    return {
        **given,
        "algo.advantage.is_correction_level": [level],
        "algo.advantage.is_correction_mode": [mode],
    }


def _zero_stage(given: dict[str, list[str]]) -> list[str]:
    """``--ds.zero_stage``: the actor's and the critic's stage."""
    stage = given["ds.zero_stage"][0]
    return [t for role in ("actor", "critic") for t in (f"--{role}.deepspeed.zero_stage", stage)]


def _colocate(given: dict[str, list[str]]) -> list[str]:
    """``--train.colocate_all`` and ``--train.async_enable``: together they colocate the
    learner models only (OpenRLHF's meaning: the engines keep their own resources so that
    sampling runs ahead), here the reference beside the actor; alone, each is itself.
    ``--ds.enable_sleep``: the learners' states leave the GPU between phases
    (``--train.deepspeed_enable_sleep``, ZeRO-1/2/3; the run's validation refuses ZeRO-0 and
    a line without ``--train.colocate_all``, naming the flags); under the async pipeline the
    engines have GPUs of their own, so it is a note there."""
    colocate = switch(given.get("train.colocate_all", ["False"]))
    asynchronous = switch(given.get("train.async_enable", ["False"]))
    tokens = []
    if "train.async_enable" in given:
        tokens += ["--train.async_enable", asynchronous]
    if switch(given.get("ds.enable_sleep", ["False"])) == "True":
        if asynchronous == "True":
            tokens.append(
                f"{NOTE}--ds.enable_sleep with --train.async_enable is accepted and has no "
                "effect here: the engines keep their own resources, so the learners' states stay"
            )
        else:
            tokens += ["--train.deepspeed_enable_sleep", "True"]
    if colocate == "True" and asynchronous == "True":
        return [
            *tokens,
            "--train.colocate_actor_ref", "True",
            f"{NOTE}--train.colocate_all with --train.async_enable colocates the learner "
            "models only, as in OpenRLHF: here the reference beside the actor (add "
            "--train.colocate_critic_reward for the reward model beside the critic); the "
            "engines keep their own resources",
        ]  # fmt: skip
    if "train.colocate_all" in given:
        tokens += ["--train.colocate_all", colocate]
    return tokens


def _ema(given: dict[str, list[str]]) -> list[str]:
    if switch(given.get("train.enable_ema", ["False"])) != "True":
        return []
    beta = given.get("train.ema_beta", ["0.992"])[0]
    return ["--actor.optimizer.ema_decay", beta]


def _dynamic_batch(given: dict[str, list[str]]) -> list[str]:
    if switch(given.get("train.dynamic_batch_enable", ["False"])) != "True":
        return []
    return [
        "--train.max_tokens_per_micro_batch",
        given.get("train.max_tokens_per_gpu", ["16192"])[0],
    ]


def _clip(given: dict[str, list[str]]) -> list[str]:
    low, high = given["actor.eps_clip_low_high"]
    return ["--algo.policy_loss.clip_eps_low", low, "--algo.policy_loss.clip_eps_high", high]


def _wandb_key(given: dict[str, list[str]]) -> list[str]:
    # The key is a credential: it goes to the environment W&B reads, never into config.json.
    import os

    os.environ["WANDB_API_KEY"] = given["logger.wandb.key"][0]
    return ["--train.use_wandb", "True"]


def _wandb_key_top(given: dict[str, list[str]]) -> list[str]:
    _wandb_key(given)
    return ["--use_wandb", "True"]


def _multiturn(given: dict[str, list[str]]) -> list[str]:
    key = given.get("data.input_key", ["input"])[0]
    if switch(given.get("data.multiturn", ["False"])) == "True":
        return ["--messages_key", key]
    return ["--input_key", key]


def _margin(given: dict[str, list[str]]) -> list[str]:
    # OpenRLHF's reward dataset reads the margin from each row's "margin" field.
    on = switch(given["model.margin_loss_enable"]) == "True"
    return ["--margin_key", "margin"] if on else []


def _ipo(given: dict[str, list[str]]) -> list[str]:
    return ["--loss_type", "ipo"] if switch(given["model.ipo_enable"]) == "True" else []


def _ref_model(given: dict[str, list[str]]) -> list[str]:
    model = given.get("model.model_name_or_path", [""])[0]
    ref = given.get("ref.model_name_or_path", [model])[0]
    if ref != model:
        raise ConfigError(
            f"--ref.model_name_or_path {ref}: the DPO reference here is the initial model "
            f"(--model.model_name_or_path {model or '<not given>'}); give the same path or "
            "leave --ref.model_name_or_path out"
        )
    return ["--model.model.path", model] if model else []


FINISHERS: dict[str, Callable[[dict[str, list[str]]], list[str]]] = {
    **{f"ranks:{role}": _ranks(role) for role in ("actor", "critic")},
    "correction": _correction,
    "ema": _ema,
    "dynamic_batch": _dynamic_batch,
    "clip": _clip,
    "wandb_key": _wandb_key,
    "zero_stage": _zero_stage,
    "colocate": _colocate,
    "wandb_key_top": _wandb_key_top,
    "multiturn": _multiturn,
    "margin": _margin,
    "ipo": _ipo,
    "ref_model": _ref_model,
}
"""Each group of `Gathered` flags → the tokens it becomes once the line was read."""


GROUP_DOCS = {
    **{f"ranks:{r}": f"`{r}` ranks = nodes × GPUs per node" for r in ("actor", "critic")},
    "correction": (
        "`--algo.rollout_correction.*`: seq → geometric (the mean), clip → truncate, gating as is"
    ),
    "ema": "`--actor.optimizer.ema_decay` = `--train.ema_beta` when enabled",
    "dynamic_batch": "`--train.max_tokens_per_micro_batch` when enabled",
    "clip": "`--algo.policy_loss.clip_eps_low`, `…_high`",
    "wandb_key": "sets `WANDB_API_KEY` (never written to config.json) and `--train.use_wandb`",
    "wandb_key_top": "sets `WANDB_API_KEY` (never written to config.json) and `--use_wandb`",
    "multiturn": "`--input_key`, or `--messages_key` with `--data.multiturn`",
    "margin": "`--margin_key margin` (OpenRLHF's margin field)",
    "ipo": "`--loss_type ipo`",
    "colocate": "each itself; together, the learner models only are colocated (OpenRLHF's "
    "meaning): `--train.colocate_actor_ref`; `--ds.enable_sleep`: "
    "`--train.deepspeed_enable_sleep` (a note under `--train.async_enable`)",
    "zero_stage": "`--actor.deepspeed.zero_stage`, `--critic.deepspeed.zero_stage`",
    "ref_model": "`--model.model.path`; the reference is the initial model, so a "
    "`--ref.model_name_or_path` must be the same path",
}
