"""The rows of OpenRLHF's ``train_sft``, ``train_rm``, ``train_dpo`` (`trainer_rows`) and
``serve_rm`` (`serve_rm_rows`)."""

from __future__ import annotations

from typing import Literal

from rlhf.cli.openrlhf.entries import (
    MOE,
    NORMALIZE,
    Arity,
    Entry,
    Gathered,
    Notice,
    Row,
    Same,
    alias,
    comma_list,
    never_at_minus_one,
    off,
    only,
)
from rlhf.cli.openrlhf.rows_common import common_rows, optimizer_rows


def trainer_rows(kind: Literal["sft", "rm", "dpo"]) -> list[Row]:
    """``train_sft`` / ``train_rm`` / ``train_dpo`` → ``rlhf train sft|rm|dpo``."""
    rows: list[Row] = []

    def add(name: str, arity: Arity, entry: Entry) -> None:
        rows.append(Row(name, arity, entry))

    model = "model.model"
    add("ckpt.load_enable", "switch", Same())
    add(
        "eval.steps",
        "one",
        alias(
            "eval_steps",
            values=never_at_minus_one,
            default="-1 (OpenRLHF's never) is 0 here: "
            "the held-out set is scored before training and at the end",
        ),
    )
    add("eval.dataset", "one", alias("eval_dataset"))
    add("eval.split", "one", only("eval.split", "train", "a saved dataset's train split is read"))
    add(
        "train.micro_batch_size",
        "one",
        alias("micro_batch_size", default="8 here (OpenRLHF 1 for rm)" if kind == "rm" else ""),
    )
    add(
        "train.batch_size",
        "one",
        alias(
            "batch_size",
            default=("32 here (OpenRLHF 128)" if kind == "sft" else "16 here (OpenRLHF 128)"),
        ),
    )
    add("train.seed", "one", alias("seed"))
    add(
        "train.max_epochs",
        "one",
        alias(
            "num_epochs",
            default="0 here: --num_steps (100) counts the steps (OpenRLHF: 2 epochs sft, 1 rm/dpo)",
        ),
    )
    add(
        "train.full_determinism_enable",
        "switch",
        Notice("runs here are seeded (--seed); see the README on determinism"),
    )
    add(
        "model.model_name_or_path",
        "one",
        Gathered("ref_model") if kind == "dpo" else alias(f"{model}.path"),
    )
    add("model.gradient_checkpointing_enable", "switch", alias(f"{model}.gradient_checkpointing"))
    add(
        "model.gradient_checkpointing_reentrant",
        "switch",
        alias(f"{model}.gradient_checkpointing_reentrant"),
    )
    add("model.aux_loss_coef", "one", only("model.aux_loss_coef", "0", MOE.message))
    add("ds.zero_stage", "one", alias("model.deepspeed.zero_stage"))
    rows += common_rows(
        deepspeed=lambda name: (f"model.deepspeed.{name}",),
        model=lambda name: (f"{model}.{name}",),
        ring=("model.ring_attn_size",),
        top="",
        run_default=f"runs/{kind} here",
        liger=kind != "rm",
    )
    rows += optimizer_rows("", "model.optimizer", lr_default="1e-6 here (OpenRLHF 5e-6)")
    add("data.dataloader_num_workers", "one", Notice("rows are read in the driver process"))
    add("data.dataset", "one", alias("dataset"))
    add("data.dataset_probs", "one", alias("dataset_probs", values=comma_list))
    add(
        "data.dataset_split",
        "one",
        only("data.dataset_split", "train", "a saved dataset directory's train split is read"),
    )
    add(
        "data.max_samples",
        "one",
        alias("max_samples", default="every row here (OpenRLHF 1000000)"),
    )
    add(
        "data.input_template",
        "one",
        alias(
            "input_template",
            default="none here: the tokenizer's chat template when it has one (OpenRLHF "
            "'User: {}\\nAssistant: ')",
        ),
    )
    add(
        "data.apply_chat_template",
        "switch",
        Notice(
            "the tokenizer's chat template is applied whenever it has one and no "
            "--data.input_template is given"
        ),
    )
    add("data.tokenizer_chat_template", "one", alias("chat_template"))
    add("data.max_len", "one", alias("max_len", default="1024 here (OpenRLHF 2048)"))
    if kind == "sft":
        add("model.pretrain_mode_enable", "switch", alias("pretrain"))
        add("data.multiturn", "switch", Gathered("multiturn"))
        add("data.input_key", "one", Gathered("multiturn"))
        add("data.output_key", "one", alias("output_key", default="output here (OpenRLHF none)"))
    else:
        add(
            "data.prompt_key",
            "one",
            alias("prompt_key", default="prompt here (OpenRLHF none: no prompt field)"),
        )
        add("data.chosen_key", "one", alias("chosen_key"))
        add("data.rejected_key", "one", alias("rejected_key"))
    if kind == "rm":
        add(
            "ds.value_head_prefix",
            "one",
            only("ds.value_head_prefix", "score", "value and reward heads are named score here"),
        )
        add(
            "model.compute_fp32_loss_enable",
            "switch",
            Notice("the pairwise loss is computed in fp32 here"),
        )
        add("model.margin_loss_enable", "switch", Gathered("margin"))
        add(
            "model.loss_type",
            "one",
            alias(
                "loss_type",
                values={"sigmoid": "sigmoid", "logexp": "log_exp", "log_exp": "log_exp"},
            ),
        )
    if kind == "dpo":
        add(
            "ref.offload",
            "switch",
            Notice(
                "the reference log-probs are computed once before training; no reference model "
                "stays loaded"
            ),
        )
        add("ref.model_name_or_path", "one", Gathered("ref_model"))
        add("model.beta", "one", alias("beta"))
        add("model.ipo_enable", "switch", Gathered("ipo"))
        add("model.label_smoothing", "one", alias("label_smoothing"))
        add("model.nll_loss_coef", "one", alias("nll_loss_coef"))
    return rows


def serve_rm_rows() -> list[Row]:
    """``serve_rm`` → ``rlhf serve-rm``."""
    return [
        Row("reward.model_name_or_path", "one", alias("model_path")),
        Row("reward.normalize_enable", "switch", Notice(NORMALIZE)),
        Row(
            "ds.value_head_prefix",
            "one",
            only("ds.value_head_prefix", "score", "value and reward heads are named score here"),
        ),
        Row("data.max_len", "one", alias("max_len")),
        Row("port", "one", Same()),
        Row(
            "host",
            "one",
            Same(
                default="127.0.0.1 here (OpenRLHF 0.0.0.0): reachable only "
                "from this machine unless you say so"
            ),
        ),
        Row("ds.load_in_4bit", "switch", alias("load_in_4bit")),
        Row(
            "ds.param_dtype",
            "one",
            alias("dtype", values={"bf16": "bfloat16"}, default="float32 here (OpenRLHF bf16)"),
        ),
        Row("ds.attn_implementation", "one", Notice("the model's default attention is used")),
        Row("ds.experts_implementation", "one", MOE),
        Row(
            "data.disable_fast_tokenizer", "switch", Notice("the tokenizer's fast version is used")
        ),
        Row(
            "ds.packing_samples",
            "switch",
            Notice("each request's texts are scored as a padded batch"),
        ),
        Row("batch_size", "one", Same()),
        Row("use_ms", "switch", off("use_ms", "models load from local folders or the HF hub")),
    ]
