"""Subprocess smoke tests of every ``rlhf`` command and preset, and the documented errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rlhf.cli.presets import PRESETS

from .conftest import rlhf


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_help_config_show_and_env() -> None:
    out = rlhf("--help")
    assert out.returncode == 0 and "rlhf train" in out.stdout
    shown = rlhf("config", "show", "dr_grpo")
    assert shown.returncode == 0, shown.stderr
    resolved = json.loads(shown.stdout)
    assert resolved["algo"]["advantage"]["estimator"] == "dr_grpo"
    assert resolved["algo"]["loss_agg_mode"] == "seq-mean-token-sum-norm"
    bad = rlhf("config", "show", "nope")
    assert bad.returncode == 2 and "unknown preset 'nope'" in bad.stderr and "grpo" in bad.stderr
    env = rlhf("env")
    assert env.returncode == 0
    info = json.loads(env.stdout)
    assert {"torch", "deepspeed", "ray"} <= set(info["versions"]) and info["cpus"] >= 1
    helped = rlhf("train", "grpo", "--help")
    assert helped.returncode == 0 and "--rollout.n_samples_per_prompt" in helped.stdout


def test_dr_grpo_normaliser_follows_the_generation_budget_unless_given(tmp_path) -> None:
    from rlhf.cli.main import _parse, given_names
    from rlhf.cli.presets import follow_generation_budget, resolve

    def resolved(preset, *flags):
        config = _parse(type(resolve(preset)), flags, resolve(preset), "rlhf train")
        return follow_generation_budget(config, given=given_names(flags)).algo

    assert resolved("dr_grpo", "--rollout.max_new_tokens", "1024").loss_agg_max_len == 1024
    assert resolved("dr_grpo").loss_agg_max_len == 256  # the default budget
    given = ("--rollout.max_new_tokens", "1024", "--algo.loss_agg_max_len", "256")
    assert resolved("dr_grpo", *given).loss_agg_max_len == 256
    assert resolved("dr_grpo", "--algo.loss_agg_max_len=300").loss_agg_max_len == 300
    file = tmp_path / "run.yaml"
    file.write_text("rollout:\n  max_new_tokens: 512\nalgo:\n  loss_agg_max_len: 128\n")
    assert resolved("dr_grpo", "--config", str(file)).loss_agg_max_len == 128
    file.write_text('{"rollout": {"max_new_tokens": 512}}')
    json_file = file.with_suffix(".json")
    file.rename(json_file)
    assert resolved("dr_grpo", "--config", str(json_file)).loss_agg_max_len == 512
    # Other aggregations have no L_max: untouched.
    assert resolved("grpo", "--rollout.max_new_tokens", "64").loss_agg_max_len is None


def _train_args(assets, run_dir, steps: int = 2) -> list[str]:
    return [
        "--run_dir", str(run_dir),
        "--actor.model.path", str(assets["model"]),
        "--data.prompt_data", str(assets["train"]),
        "--data.eval_data", f"sort4={assets['eval']}",
        "--train.reward_func", str(assets["reward"]),
        "--train.num_steps", str(steps),
        "--rollout.batch_size", "4",
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.max_new_tokens", "6",
        "--rollout.max_len", "16",
        "--eval.steps", str(steps),
        "--eval.max_prompts", "8",
        "--eval.n_samples", "2",
        "--vllm.num_cpus", "0.5",
        "--actor.num_cpus_per_rank", "0.5",
        "--critic.num_cpus_per_rank", "0.5",
        "--actor.optimizer.lr", "1e-3",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def teacher(assets, tmp_path_factory):
    """The demo's initial model with its (tied) embeddings tripled: the student's tokenizer,
    another distribution (a teacher far from the student)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("teacher")
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(path)
    return path


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_trains_two_steps(assets, tmp_path, preset, teacher) -> None:
    extra = {
        # DAPO with its overlong filtering and a sequence-level rollout correction.
        # Its reward (`REFILL_REWARD`) makes every group of a step's first draw uniform, so
        # dynamic filtering drops all 4 and the refill draws 4 more (no evaluation: it would
        # call the reward too).
        "dapo": [
            "--algo.overlong_buffer_len", "2", "--algo.overlong_filtering", "True",
            "--train.reward_func", str(_refill_reward(tmp_path)), "--eval.steps", "0",
            "--algo.rollout_correction.level", "sequence",  # a plain flag turns it on
        ],
        # The other policy losses, on presets that would otherwise repeat the PPO loss;
        # REINFORCE++-baseline also oversamples: 6 prompts drawn for a batch of 4.
        "reinforce_baseline": [
            "--algo.policy_loss.name", "gspo", "--rollout.oversample_factor", "1.5",
        ],
        # RLOO also trains with Muon (DeepSpeed's, ZeRO-2): its half's lr leads the groups.
        "rloo": [
            "--algo.policy_loss.name", "cispo",
            "--actor.optimizer.name", "muon", "--actor.optimizer.grad_clip", "0",
        ],
        # PPO runs padding-free: actor, reference and critic forwards on packed rows.
        "ppo": ["--actor.model.packing_samples", "True", "--critic.model.packing_samples", "True"],
        # GRPO's actor and reference take their log-probs through the chunked lm_head; the
        # best evaluated policy is kept and the EMA exported.
        "grpo": [
            "--actor.model.chunked_lm_head", "True",
            "--eval.best_metric", "eval/sort4/pass@1", "--actor.optimizer.ema_decay", "0.9",
            "--rollout.dump_dir", str(tmp_path / "dump"),
        ],
        # On-policy distillation with a teacher per data source: the same prompts under two
        # names, source a distilled from `teacher`, source b from the student's own start.
        "distill": ["--teacher.model.path", f"a={teacher},b={assets['model']}"],
    }.get(preset, [])  # fmt: skip
    args = _train_args(assets, tmp_path)
    if preset == "distill":
        args[args.index("--data.prompt_data") + 1] = f"a={assets['train']},b={assets['train']}"
    out = rlhf("train", preset, *args, *extra)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "[plan] prompts/step 4, samples/step 16" in out.stdout
    assert ("padding-free (packed)" in out.stdout) == (preset == "ppo")
    rows = _rows(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["actor/grad_norm"] > 0
        assert all(r[k] >= 0 for k in ("time/generation_s", "time/training_s", "time/sync_s"))
        # The sampler and the learner agree on every sampled token's log-prob (fp32; seen up
        # to 3.5e-3 on rare tokens of the random model; a wrong temperature or stale weights
        # give > 0.1).
        assert r["actor/rollout_logprob_diff_max"] < 1e-2
    if preset == "ppo":
        assert all(r["critic/value_loss"] >= 0 and r["critic/grad_norm"] > 0 for r in steps)
    if preset == "distill":
        _check_distill(out.stdout, steps)
    if preset == "rloo":
        # Muon's half at its default peak lr 0.02, AdamW's at --actor.optimizer.lr 1e-3: one
        # schedule scales both, so their ratio stays 20.
        for r in steps:
            assert r["actor/lr"] / r["actor/lr_adamw"] == pytest.approx(0.02 / 1e-3, rel=1e-9)
    if preset == "reinforce_baseline":
        # The first 4 groups to finish are trained on; the other 2 prompts' calls were
        # cancelled or finished unneeded (no reward skips, no filter: nothing else).
        for r in steps:
            assert r["rollout/samples"] == 16.0
            assert r["rollout/oversample_cancelled"] + r["rollout/oversample_unused"] == 2.0
    else:
        assert all("rollout/oversample_cancelled" not in r for r in steps)
    # GSPO's sequence-level ratio is its own metric; no other loss reports it.
    assert all(("actor/seq_ratio_mean" in r) == (preset == "reinforce_baseline") for r in steps)
    if preset == "dapo":
        # Synchronous: the sequence ratio exp(Σδ) over <= 6 tokens with |δ| < 1e-2 (checked
        # above) is within exp(±0.06) of 1, on every micro-batch that has action tokens left
        # after the overlong filtering.
        for r in steps:
            assert abs(r["rollout_correction/weight_mean"] - 1.0) < 0.07
            # Draw 1: all 4 groups score 1.0 (mean at the range's top): dropped; draw 2: every
            # group holds 0 and 1 (mean 0.5): kept, the batch full again.
            assert r["rollout/dropped_groups"] == 4.0 and r["rollout/samples"] == 16.0
            assert r["reward/mean"] <= 0.5  # draw 2's rewards, less any overlong penalty
    evals = [r for r in rows if "eval/sort4/pass@1" in r]
    assert [r["step"] for r in evals] == ([] if preset == "dapo" else [0, 2])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rollout"]["n_samples_per_prompt"] == 4
    if preset == "dr_grpo":  # L_max followed --rollout.max_new_tokens 6
        assert config["algo"]["loss_agg_max_len"] == 6
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert (tmp_path / "curves.png").stat().st_size > 1000
    if preset == "grpo":
        _check_best_and_ema(assets["model"], tmp_path, evals)
        _check_eval_only(assets, tmp_path, evals[-1])
        _check_replay(args, extra, tmp_path, steps)


def _check_distill(stdout: str, steps: list[dict]) -> None:
    """Each source's samples were scored by its own teacher: at step 1 the student is
    source b's teacher, so b's reverse KL is a mean of sampler-vs-learner differences, each
    at most ``actor/rollout_logprob_diff_max``, while source a's teacher is far away (the
    mean of log π − log π_T over the student's samples estimates KL(π ‖ π_T) ≥ 0)."""
    assert "; teacher:a 1 rank(s)" in stdout and "; teacher:b 1 rank(s)" in stdout
    first = steps[0]  # the seeded sampler draws both sources at step 1
    assert abs(first["distill/reverse_kl/b"]) <= first["actor/rollout_logprob_diff_max"] + 1e-6
    assert first["distill/reverse_kl/a"] > 0.1
    for r in steps:
        # The advantage is −(log π − log π_T) on every action token; nothing else enters.
        assert r["distill/reverse_kl"] == pytest.approx(-r["advantages/mean"], abs=1e-6)
        assert r["rollout/samples"] == 16.0


def _check_replay(args, extra, run_dir, steps) -> None:
    """A run that trains on the dumped rollouts instead of sampling reproduces the dumping
    run's training bit for bit: the same samples, losses and gradient norms at every step,
    and the same final weights. Evaluating nothing, it starts no vLLM engine at all."""
    again = run_dir / "replay"
    args = [str(again) if a == str(run_dir) else a for a in args]
    args[args.index("--eval.steps") + 1] = "0"
    extra = [a for a in extra if a not in ("--eval.best_metric", "eval/sort4/pass@1")]
    extra[extra.index("--rollout.dump_dir")] = "--rollout.replay_dir"
    out = rlhf("train", "grpo", *args, *extra)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"[plan] replay: training on the rollouts of {run_dir / 'dump'}" in out.stdout
    assert "[startup] starting 0 vLLM engine(s)" in out.stdout
    placed = json.loads((again / "placement.json").read_text())
    assert placed["engines"]["pids"] == [] and placed["actor"]["pids"], placed
    assert not (again / "sync.json").exists()
    replayed = [r for r in _rows(again / "metrics.jsonl") if "reward/mean" in r]
    keys = ("rollout/samples_crc32", "reward/mean", "actor/loss", "actor/grad_norm")
    assert [[r[k] for k in keys] for r in replayed] == [[r[k] for k in keys] for r in steps]
    ours, theirs = again / "final" / "model.safetensors", run_dir / "final" / "model.safetensors"
    assert ours.read_bytes() == theirs.read_bytes()
    # Another starting policy is refused by flag before anything starts.
    other = list(args)
    other[other.index("--actor.model.path") + 1] = str(run_dir / "final")
    refused = rlhf("train", "grpo", *other, *extra)
    assert refused.returncode == 2
    assert "--rollout.replay_dir" in refused.stderr and "policy: dumped" in refused.stderr


def _check_eval_only(assets, run_dir, last_eval) -> None:
    """``--eval.eval_only`` on the exported final policy gives exactly the run's last
    evaluation (the same weights, the same seeded requests), with vLLM engines alone."""
    args = _train_args(assets, run_dir / "eval_only")
    args[args.index("--actor.model.path") + 1] = str(run_dir / "final")
    del args[args.index("--data.prompt_data") : args.index("--data.prompt_data") + 2]
    out = rlhf("train", "grpo", *args, "--eval.eval_only", "True")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "[startup] starting" not in out.stdout, out.stdout[-2000:]  # no learner started
    (row,) = _rows(run_dir / "eval_only" / "metrics.jsonl")
    evaluated = {k: v for k, v in row.items() if k.startswith("eval/")}
    assert evaluated == {k: v for k, v in last_eval.items() if k.startswith("eval/")}
    assert row["step"] == 0
    assert not (run_dir / "eval_only" / "final").exists()


REFILL_REWARD = """
CALLS = [0]

def reward_func(queries, prompts, labels, **kwargs):
    CALLS[0] += 1
    if CALLS[0] % 2:  # a step's first draw: one score for every sample
        return [1.0] * len(queries)
    return [float(i % 2) for i in range(len(queries))]  # a group's 4 samples: 0, 1, 0, 1
"""


def _refill_reward(tmp_path):
    path = tmp_path / "refill_reward.py"
    path.write_text(REFILL_REWARD)
    return path


def _weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _check_best_and_ema(initial, run_dir, evals) -> None:
    """``run_dir/best`` holds the policy of the first evaluation with the highest pass@1 (the
    initial model at step 0, the final one at step 2); ``final_ema`` is neither."""
    scores = [(r["eval/sort4/pass@1"], -r["step"]) for r in evals]
    value, neg_step = max(scores)
    record = json.loads((run_dir / "best" / "best.json").read_text())
    assert record == {"metric": "eval/sort4/pass@1", "mode": "max", "value": value,
                      "step": -neg_step}  # fmt: skip
    best = _weights(run_dir / "best")
    same_as = _weights(initial) if record["step"] == 0 else _weights(run_dir / "final")
    assert best.keys() == same_as.keys()
    assert all(best[k].equal(same_as[k]) for k in best)
    ema, final, start = (_weights(p) for p in (run_dir / "final_ema", run_dir / "final", initial))
    moved = [k for k in final if not final[k].equal(start[k])]
    assert moved and all(not ema[k].equal(final[k]) and not ema[k].equal(start[k]) for k in moved)


def test_sft_command_lowers_the_loss(assets, tmp_path) -> None:
    from transformers import AutoTokenizer

    # OpenRLHF's blend of two sources, its --data.tokenizer_chat_template (exported) and its
    # evaluation set (--eval.dataset, every --eval.steps).
    rows = assets["sft"].read_text().splitlines(keepends=True)
    halves = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
    halves[0].write_text("".join(rows[: len(rows) // 2]))
    halves[1].write_text("".join(rows[len(rows) // 2 :]))
    held = tmp_path / "held.jsonl"  # rows of the task (two of the training rows)
    held.write_text("".join(rows[:2]))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = rlhf(
        "train", "sft",
        "--run_dir", str(tmp_path / "run"),
        "--model.model.path", str(assets["model"]),
        "--model.optimizer.lr", "3e-3",
        "--data.dataset", f"{halves[0]},{halves[1]}",
        "--data.dataset_probs", "0.5,0.5",
        "--data.tokenizer_chat_template", template,
        "--eval.dataset", str(held),
        "--eval.steps", "10",
        "--ckpt.save_steps", "10", "--ckpt.save_hf", "--ckpt.max_num", "2",
        "--input_template", "{}",
        "--num_steps", "30",
        "--batch_size", "32",
        "--micro_batch_size", "32",
        "--model.model.packing_samples", "True",  # padding-free
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    # Each start-up phase says it began and when it was ready; steps show the pace and ETA.
    assert "[startup] starting the SFT learner (1 rank)…" in out.stdout
    assert "[startup] learner ready after" in out.stdout
    assert re.search(r"\[sft\] \[30/30\] \| [\d.]+ m?s/step \| ETA 0m00s \| loss", out.stdout)
    metrics = _rows(tmp_path / "run" / "metrics.jsonl")
    losses = [r["sft/loss"] for r in metrics if "sft/loss" in r]
    assert len(losses) == 30 and losses[-1] < losses[0] / 2
    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "final").chat_template == template
    # --ckpt.save_hf: an HF export beside each state checkpoint, the newest 2 of each kept.
    saved = sorted(p.name for p in (tmp_path / "run" / "hf_checkpoints").iterdir())
    assert saved == ["step_20", "step_30"]
    assert len(list((tmp_path / "run" / "checkpoints").glob("*/COMPLETE"))) == 2
    exported = AutoTokenizer.from_pretrained(tmp_path / "run" / "hf_checkpoints" / "step_20")
    assert exported.chat_template == template
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["dataset_probs"] == [0.5, 0.5]
    evals = {r["step"]: r["sft/eval_loss"] for r in metrics if "sft/eval_loss" in r}
    assert list(evals) == [0, 10, 20, 30] and evals[30] < evals[0]
    # Before training: the initial model's token-mean NLL of the held-out responses.
    from transformers import AutoModelForCausalLM

    from rlhf.learner import sft_row

    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    model = AutoModelForCausalLM.from_pretrained(assets["model"]).eval()
    nll, count = 0.0, 0
    for i, line in enumerate(held.read_text().splitlines()):
        row = sft_row(json.loads(line), i, tokenizer, input_template="{}")
        ids = torch.tensor([row.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        token = logp.gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(row.loss_mask[1:], dtype=torch.bool)
        nll, count = nll - float(token[mask].sum()), count + int(mask.sum())
    assert evals[0] == pytest.approx(nll / count, rel=1e-4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--actor.model.path is required"),
        (
            ["--actor.model.path", "/no/such/model", "--data.prompt_data", "x.jsonl"],
            "model path '/no/such/model' does not exist",
        ),
        (
            ["--MODEL", "--rollout.n_samples_per_prompt", "1"],
            "set --rollout.n_samples_per_prompt >= 2",
        ),
        (
            ["--MODEL", "--rollout.max_new_tokens", "64", "--rollout.max_len", "32"],
            "--rollout.max_new_tokens must be smaller",
        ),
        (["--MODEL", "--train.batch_size", "6"], "--train.batch_size must be a multiple"),
        (
            ["--MODEL", "--algo.overlong_buffer_len", "300"],
            "--algo.overlong_buffer_len must be smaller",
        ),
        (
            ["--MODEL", "--train.partial_rollout_enable", "True"],
            "--train.partial_rollout_enable needs --train.async_enable",
        ),
        (
            ["--MODEL", "--train.async_enable", "True", "--train.async_queue_size", "0"],
            "--train.async_queue_size must be >= 1",
        ),
        (["--MODEL", "--data.input_key", "question"], "row 0 has no 'question' (--data.input_key)"),
        (["--MODEL", "--eval.eval_only", "True"], "--eval.eval_only evaluates --data.eval_data"),
        (
            ["--MODEL", "--algo.advantage.estimator", "distill"],
            "--algo.advantage.estimator=distill reads a teacher's log-probs of the sampled tokens: "
            "give --teacher.model.path",
        ),
        (
            ["--MODEL", "--data.input_template", "Q: {question}"],
            "--data.input_template 'Q: {question}' cannot wrap a prompt (KeyError('question'))",
        ),
        (
            ["--MODEL", "--train.reward_func", "builtin:nope"],
            "--reward.reward_func=builtin:nope: no such builtin",  # the older spelling resolved
        ),
        (
            [
                "--MODEL",
                "--actor.model.chunked_lm_head",
                "True",
                "--actor.deepspeed.zero_stage",
                "3",
            ],
            "--actor.model.chunked_lm_head needs --actor.deepspeed.zero_stage <= 2",
        ),
        (
            [
                "--MODEL",
                "--train.colocate_all",
                "True",
                "--actor.deepspeed.zero_stage",
                "0",
                "--train.deepspeed_enable_sleep",
                "True",
            ],
            "set --actor.deepspeed.zero_stage (and --critic.deepspeed.zero_stage) to 1, 2 or 3",
        ),
        (
            ["--MODEL", "--train.deepspeed_enable_sleep", "True"],
            "--train.deepspeed_enable_sleep moves the learners' states aside for colocated "
            "engines: it needs --train.colocate_all",
        ),
        (
            ["--MODEL", "--data.prompt_data", "/no/such.jsonl"],
            "data source '/no/such.jsonl' does not exist",
        ),
        (
            ["--MODEL", "--reward.failure_policy", "ignore"],
            "--reward.failure_policy must be one of raise, skip, fallback, got 'ignore'",
        ),
        (
            [
                "--MODEL",
                "--reward.reward_func",
                "builtin:math_answer",
                "--train.reward_func",
                "builtin:boxed_format",
            ],
            "--reward.reward_func 'builtin:math_answer' and its older spelling "
            "--train.reward_func 'builtin:boxed_format' disagree",
        ),
    ],
)
def test_bad_configs_and_data_name_the_flag(assets, tmp_path, args, message) -> None:
    model = ["--actor.model.path", str(assets["model"]), "--data.prompt_data", str(assets["train"]),
             "--run_dir", str(tmp_path)]  # fmt: skip
    args = [a for x in args for a in (model if x == "--MODEL" else [x])]
    out = rlhf("train", "grpo", *args)
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    assert message in out.stderr


def test_teacher_mistakes_are_refused_before_start_up(assets, tmp_path, teacher, capsys) -> None:
    """A teacher where nothing reads one, teachers by source that do not match the prompt
    sources, a second replica, and a teacher with another tokenizer: each refused by flag,
    exit 2, before Ray starts."""
    from transformers import AutoTokenizer

    from rlhf.cli.main import main

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for f in teacher.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(teacher)
    n = len(tok.get_vocab())
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    base = ["--actor.model.path", str(assets["model"]), "--run_dir", str(tmp_path / "run")]
    one = ["--data.prompt_data", str(assets["train"])]
    two = ["--data.prompt_data", f"a={assets['train']},b={assets['train']}"]
    cases = [
        (["grpo", *one, "--teacher.model.path", str(teacher)],
         "--teacher.model.path is set, but --algo.advantage.estimator=group_norm reads no "
         "teacher: use `rlhf train distill`"),
        (["distill", *two, "--teacher.model.path", f"a={teacher}"],
         "--data.prompt_data source(s) ['b'] have none (the sources are ['a', 'b']"),
        (["distill", *two, "--teacher.model.path", f"a={teacher},b={teacher},c={teacher}"],
         "names teachers for ['c'], which are no --data.prompt_data source"),
        (["distill", *one, "--teacher.model.path", str(teacher), "--teacher.num_ranks", "2"],
         "--teacher.num_ranks: a teacher scores as one data-parallel replica"),
        (["distill", *one, "--teacher.model.path", str(other)],
         f"--teacher.model.path {other}: the tokenizers differ ({n} vs {n + 1} tokens; e.g. "
         f"'<extra>' is id {n} in the teacher's alone) against --actor.model.path; on-policy "
         "distillation compares both models' log-probs of the same token ids, and "
         "distillation across tokenizers is not supported yet"),
    ]  # fmt: skip
    for args, message in cases:
        assert main(["train", args[0], *base, *args[1:]]) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
        assert "Traceback" not in err
    assert not (tmp_path / "run" / "placement.json").exists()


def test_muon_where_it_cannot_run_is_refused_by_flag(assets, tmp_path, capsys) -> None:
    from rlhf.cli.main import main

    base = ["train", "grpo", "--actor.model.path", str(assets["model"]), "--data.prompt_data",
            str(assets["train"]), "--run_dir", str(tmp_path), "--actor.optimizer.name", "muon"]  # fmt: skip
    cases = [
        ([], "--actor.optimizer.name muon with --actor.optimizer.grad_clip 1.0 (OpenRLHF's "
             "--actor.max_norm): DeepSpeed's Muon clips after its Newton-Schulz step"),
        (["--actor.optimizer.grad_clip", "0", "--actor.deepspeed.zero_stage", "0"],
         "--actor.optimizer.name muon needs --actor.deepspeed.zero_stage 1, 2 or 3"),
        (["--actor.backend", "molt", "--actor.fsdp.offload", "optimizer"],
         "--actor.optimizer.name muon with --actor.fsdp.offload optimizer: the host-side "
         "optimizer is AdamW only"),
    ]  # fmt: skip
    for args, message in cases:
        assert main([*base, *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err)


def test_lossy_prompts_are_refused_before_start_up_under_the_flag(assets, tmp_path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"input": "12 日本:", "label": "21"}) + "\n")
    out = rlhf(
        "train", "grpo", "--actor.model.path", str(assets["model"]), "--data.prompt_data",
        str(data), "--run_dir", str(tmp_path / "run"), "--data.lossy_prompts", "refuse",
    )  # fmt: skip
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    assert f"{data} (p): 1 of 1 prompts lose 2 characters in the tokenizer" in out.stderr
    assert "refused by --data.lossy_prompts refuse" in out.stderr
    assert "[startup]" not in out.stdout and "Traceback" not in out.stderr


def test_every_problem_is_listed_at_once_before_anything_starts(assets, tmp_path) -> None:
    """Out-of-range sizes and sampling values (a ZeroDivisionError, a run that trains
    nothing, or a failure after start-up before) are all named in one message, exit 2,
    before Ray or any role starts."""
    out = rlhf(
        "train", "grpo", "--actor.model.path", str(assets["model"]),
        "--data.prompt_data", str(assets["train"]), "--run_dir", str(tmp_path),
        "--rollout.n_samples_per_prompt", "0", "--train.ppo_epochs", "0",
        "--rollout.temperature", "0", "--rollout.top_p", "1.5", "--eval.n_samples", "0",
        "--rollout.oversample_factor", "0.5",
    )  # fmt: skip
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    expected = [
        "6 problems in the configuration:",
        "  - --rollout.n_samples_per_prompt must be >= 1, got 0",
        "  - --train.ppo_epochs must be >= 1, got 0",
        "  - --eval.n_samples must be >= 1, got 0",
        "  - --rollout.temperature must be > 0, got 0.0",
        "  - --rollout.top_p must be in (0, 1], got 1.5",
        "  - --rollout.oversample_factor must be >= 1, got 0.5",
    ]
    for line in expected:
        assert line in out.stderr
    assert not (tmp_path / "placement.json").exists()
    assert "Traceback" not in out.stderr


def test_unknown_flag_is_refused() -> None:
    out = rlhf("train", "grpo", "--rollout.n_samples", "4")
    assert out.returncode == 2 and "n_samples" in out.stderr


def test_debug_shows_the_traceback_of_a_user_error(capsys) -> None:
    from rlhf.cli.main import main

    assert main(["train", "grpo"]) == 2
    plain = capsys.readouterr().err
    assert plain.startswith("rlhf: ") and "--actor.model.path is required" in plain
    assert "Traceback" not in plain
    assert main(["train", "grpo", "--debug"]) == 2
    shown = capsys.readouterr().err
    assert shown.startswith("Traceback (most recent call last):") and "ConfigError" in shown
    assert shown.endswith(plain)  # the same message, after the traceback
