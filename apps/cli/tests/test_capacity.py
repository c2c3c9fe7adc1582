"""The capacity planner (``rlhf train … --dry_run``; the memory models of
`rlhf.learner.capacity`, `rlhf.molt.capacity` and `rlhf.rollout.capacity`): its counts against
DeepSpeed engines, its estimates against peaks measured on an H200, and the command end to end.
The model shape it reads is tested with the learner (``test_model_shape.py``)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf.cli.dry_run import learner_memory
from rlhf.cli.sections import RoleConfig
from rlhf.learner.model_shape import ModelShape

from .conftest import rlhf

ROOT = pathlib.Path(__file__).resolve().parents[3]
MEASURED = pathlib.Path(__file__).parent / "data" / "measured_peaks.json"

TINY = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
}


def _resident_bytes(backend) -> int:
    """Bytes of every distinct storage the rank keeps between steps: its parameters (their
    ZeRO-3 partitions), everything its optimizer holds, and ZeRO's flat buffers."""
    seen: dict[int, int] = {}

    def add(tensor) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for param in backend.module.parameters():
        add(getattr(param, "ds_tensor", param.data))
    optimizer = backend.engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        for value in state.values():
            add(value)
    for group in inner.param_groups:
        for param in group["params"]:
            add(param.data)
    for flat in ("bit16_groups_flat", "single_partition_of_fp32_groups",
                 "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat"):  # fmt: skip
        for tensor in getattr(optimizer, flat, None) or []:
            add(tensor)
    return sum(seen.values())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_deepspeed_states_after_a_step_are_what_the_planner_counts(stage, tmp_path):
    """float32 on CPU, one rank: ZeRO-0 steps AdamW on the weights (12 bytes per parameter),
    ZeRO-2/3 keep flat float32 partitions beside them (16); the only difference allowed is
    ZeRO's alignment padding and the optimizer's step counters (< 0.1 %)."""
    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.learner import (
        DeepSpeedBackend,
        DeepSpeedConfig,
        LearnerConfig,
        ModelConfig,
        PPOActorObjective,
    )
    from rlhf.molt import init_distributed

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_learner import rl_batch

    config = Qwen2Config(**TINY, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    init_distributed()
    role = RoleConfig(
        model=ModelConfig(path=str(tmp_path)), deepspeed=DeepSpeedConfig(zero_stage=stage)
    )
    backend = DeepSpeedBackend(LearnerConfig(model=role.model), deepspeed=role.deepspeed)
    try:
        batch = rl_batch(rows=2, length=16, vocab=TINY["vocab_size"])
        norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
        objective = PPOActorObjective(algo=AlgoConfig(), normalizer=norm, entropy_metric=False)
        backend.train_micro_batches([batch], objective)
        measured = _resident_bytes(backend)
    finally:
        backend.close()
    shape = ModelShape.read(tmp_path, flag="--actor.model.path")
    memory = learner_memory(role, shape, tokens=32, trains=True, outputs=shape.vocab)
    counted = memory.parts["weights"] + memory.parts["optimizer states"]
    assert counted == pytest.approx(measured, rel=1e-3)
    assert counted == (12 if stage == 0 else 16) * shape.params


def test_estimates_are_within_15_percent_of_the_peaks_measured_on_gpus(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_capacity import CASES, estimate
    from bench_learner import SCALES

    measured = json.loads(MEASURED.read_text())["peaks"]
    ratios = {}
    for point in measured:
        model_dir = tmp_path / point["size"]
        Qwen2Config(**SCALES[point["size"]], tie_word_embeddings=True).save_pretrained(model_dir)
        ratio = estimate(CASES[point["case"]], model_dir) / point["gib"]
        ratios[f"{point['size']}/{point['case']}"] = ratio
    outside = {key: round(r, 3) for key, r in ratios.items() if not 0.85 <= r <= 1.15}
    assert not outside, f"estimate/measured outside 0.85–1.15: {outside}"
    assert len(ratios) >= 10


def _config_dir(tmp_path: pathlib.Path, name: str, **fields: object) -> pathlib.Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    return path


LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def test_dry_run_prints_each_gpu_and_exits_0_when_it_fits_1_when_not(tmp_path):
    model = _config_dir(tmp_path, "llama8b", **LLAMA_8B)  # config.json only: no weights
    flags = [
        "train", "grpo", "--dry_run", "True", "--actor.model.path", str(model),
        "--actor.deepspeed.bf16", "True", "--actor.deepspeed.zero_stage", "3",
        "--actor.num_ranks", "4", "--actor.model.gradient_checkpointing", "True",
        "--train.micro_batch_size", "1", "--rollout.max_len", "4096",
        "--rollout.max_new_tokens", "3072", "--vllm.num_engines", "2",
        "--vllm.tensor_parallel_size", "2", "--algo.kl.init_coef", "0",
        "--plan.gpu_memory_gib", "80", "--run_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    done = rlhf(*flags)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "[capacity] 8 GPU(s) of 80 GiB" in out
    assert "GPU 0-3: actor" in out and "GPU 4-7: vLLM engine" in out
    assert "sequences of --rollout.max_len 4096 at once" in out
    assert out.strip().endswith("fits (estimates; see rlhf.learner.capacity)")
    assert not (tmp_path / "run").exists()  # nothing started, nothing written

    small = rlhf(*flags[:-4], "--plan.gpu_memory_gib", "24")
    assert small.returncode == 1
    assert "DOES NOT FIT" in small.stdout


def test_dry_run_of_ppo_places_critic_reference_and_reward_model_as_the_run_does(tmp_path):
    """PPO with a reward model: actor, reference, critic and engine on a GPU each (the critic
    from the actor's path, as the run starts it), the reward model beside critic rank 0
    under ``--train.colocate_critic_reward``; the critic has no vocabulary head, so its
    activations are smaller than the actor's."""
    model = _config_dir(tmp_path, "llama8b", **LLAMA_8B)
    rm = _config_dir(tmp_path, "rm", **{**LLAMA_8B, "num_hidden_layers": 8})
    done = rlhf(
        "train", "ppo", "--dry_run", "True", "--actor.model.path", str(model),
        "--train.reward_model_path", str(rm), "--train.colocate_critic_reward", "True",
        "--actor.deepspeed.bf16", "True", "--critic.deepspeed.bf16", "True",
        # Optimizers on the host: each rank's peak is its backward's, with activations.
        "--actor.deepspeed.offload_optimizer", "True",
        "--critic.deepspeed.offload_optimizer", "True",
        "--plan.gpu_memory_gib", "200",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = {
        line.split(":")[0].removeprefix("[capacity] "): line for line in done.stdout.splitlines()
    }
    assert "4 GPU(s) of 200 GiB" in done.stdout
    gpus = [lines[f"GPU {k}"] for k in range(4)]
    roles = ["actor", "critic", "reference", "vLLM engine"]
    holding = {
        role: [k for k, line in enumerate(gpus) if f": {role} " in line or f"; {role} " in line]
        for role in roles
    }
    assert sorted(k for ks in holding.values() for k in ks) == [0, 1, 2, 3]  # one GPU each
    critic_gpu = gpus[holding["critic"][0]]
    assert "; reward model " in critic_gpu  # beside critic rank 0

    def activations(line: str, role: str) -> float:
        part = line.split(f"{role} ")[1]
        return float(part.split("activations ")[1].split(",")[0])

    actor_gpu = gpus[holding["actor"][0]]
    assert activations(critic_gpu, "critic") < activations(actor_gpu, "actor")


def test_dry_run_reads_the_shape_and_names_a_missing_config(tmp_path):
    done = rlhf(
        "train", "grpo", "--dry_run", "True", "--actor.model.path", str(tmp_path / "nowhere"),
    )  # fmt: skip
    assert done.returncode == 2
    assert "--actor.model.path" in done.stderr and "no config.json" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo"])
def test_dry_run_of_the_single_model_commands(kind, tmp_path):
    model = _config_dir(tmp_path, "llama8b", **LLAMA_8B)
    done = rlhf(
        "train", kind, "--dry_run", "True", "--model.model.path", str(model),
        "--model.num_ranks", "8", "--model.deepspeed.zero_stage", "3",
        "--model.deepspeed.bf16", "True", "--micro_batch_size", "1", "--max_len", "2048",
        "--plan.gpu_memory_gib", "80",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "GPU 0-7: model" in done.stdout
    memory_line = next(line for line in done.stdout.splitlines() if "GPU 0-7" in line)
    assert "optimizer states 11.2" in memory_line  # 12 bytes x 8.03e9 parameters / 8 ranks


def test_the_70b_layout_in_the_readme_fits_as_written(tmp_path):
    """apps/cli/README.md's 70B GRPO layout: its command, run as written on a config.json of
    that shape, fits on 8 nodes x 8 H200."""
    readme = (ROOT / "apps" / "cli" / "README.md").read_text()
    block = readme.split("<!-- capacity-70b -->")[1].split("```bash")[1].split("```")[0]
    args = block.replace("\\\n", " ").split()
    assert args[:3] == ["rlhf", "train", "grpo"]
    model = _config_dir(
        tmp_path, "llama70b", hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=128256, torch_dtype="bfloat16",
    )  # fmt: skip
    args = [str(model) if a == "/models/llama-3-70b" else a for a in args[1:]]
    done = rlhf(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "64 GPU(s) of 140 GiB" in done.stdout and "8 node(s)" in done.stdout


def test_a_bf16_rank_with_few_activations_peaks_in_its_optimizer_step(tmp_path):
    """One bf16 ZeRO-2 rank: the step holds weights 2, masters and Adam 12, the bf16 gradient
    partition 2 and its float32 copy plus AdamW's temporary 8 bytes per parameter (24 in
    all), more than a short checkpointed backward; a long micro-batch peaks in the backward;
    with the optimizer on the host there is no step on the device."""
    from rlhf.learner import DeepSpeedConfig

    model = _config_dir(tmp_path, "m", **LLAMA_8B)
    shape = ModelShape.read(model, flag="--actor.model.path")
    ds = DeepSpeedConfig(bf16=True)
    role = RoleConfig(deepspeed=ds)
    short = learner_memory(role, shape, tokens=256, trains=True, outputs=shape.vocab)
    assert short.parts["optimizer step"] == 8 * shape.params
    assert "activations" not in short.parts
    assert sum(short.parts.values()) == 24 * shape.params
    long = learner_memory(role, shape, tokens=32768, trains=True, outputs=shape.vocab)
    assert "optimizer step" not in long.parts and long.parts["activations"] > 8 * shape.params
    host = RoleConfig(deepspeed=DeepSpeedConfig(bf16=True, offload_optimizer=True))
    offloaded = learner_memory(host, shape, tokens=256, trains=True, outputs=shape.vocab)
    assert "optimizer step" not in offloaded.parts


def test_a_molt_rank_peaks_in_adamw_step_at_20_bytes_per_parameter(tmp_path):
    """molt without offload: float32 shards 4, moments 8, gradients 4 and AdamW's square root
    of every second moment 4 bytes per parameter in its step (more than a short checkpointed
    backward); with the optimizer on the host the device holds no step and the host 12 bytes
    per parameter (masters and moments) and one float32 gradient (the largest, the
    embedding's)."""
    from rlhf.molt import FSDPConfig

    model = _config_dir(tmp_path, "m", **LLAMA_8B)
    shape = ModelShape.read(model, flag="--actor.model.path")
    role = RoleConfig(backend="molt", fsdp=FSDPConfig(param_dtype="bfloat16"))
    short = learner_memory(role, shape, tokens=256, trains=True, outputs=shape.vocab)
    assert short.parts["optimizer step"] == 4 * shape.params
    assert sum(short.parts.values()) == 20 * shape.params
    long = learner_memory(role, shape, tokens=65536, trains=True, outputs=shape.vocab)
    assert "optimizer step" not in long.parts
    host = RoleConfig(backend="molt", fsdp=FSDPConfig(param_dtype="bfloat16", offload="optimizer"))
    offloaded = learner_memory(host, shape, tokens=256, trains=True, outputs=shape.vocab)
    assert "optimizer step" not in offloaded.parts
    assert offloaded.host == 12 * shape.params + 4 * 128256 * 4096  # and one gradient


def test_one_layer_scale_is_linear_in_the_micro_batch(tmp_path):
    """Activations grow with the micro-batch's tokens; the model states do not."""
    model = _config_dir(tmp_path, "m", **LLAMA_8B)
    shape = ModelShape.read(model, flag="--actor.model.path")
    role = RoleConfig()
    small = learner_memory(role, shape, tokens=1024, trains=True, outputs=shape.vocab)
    large = learner_memory(role, shape, tokens=4096, trains=True, outputs=shape.vocab)
    assert large.parts["activations"] == pytest.approx(4 * small.parts["activations"])
    assert large.parts["optimizer states"] == small.parts["optimizer states"]
    assert large.allocated > small.allocated > 16 * shape.params  # float32 ZeRO-2 states


def test_kv_cache_estimate_is_within_15_percent_of_what_vllm_allocated_on_gpus(tmp_path):
    """The KV-cache tokens of `rlhf.cli.dry_run.engine_load` against ``num_gpu_blocks x
    block_size`` of a real engine (bench_capacity.py --engines) with the same options."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_learner import SCALES
    from rlhf.cli.config import RLConfig
    from rlhf.cli.dry_run import engine_load
    from rlhf.cli.sections import VllmConfig

    engines = json.loads(MEASURED.read_text())["engines"]
    assert engines
    for point in engines:
        model_dir = tmp_path / point["size"]
        Qwen2Config(**SCALES[point["size"]], tie_word_embeddings=True).save_pretrained(model_dir)
        vllm = VllmConfig(
            dtype=point["dtype"], gpu_memory_utilization=point["gpu_memory_utilization"]
        )
        config = RLConfig(vllm=vllm)
        shape = ModelShape.read(model_dir, flag="--actor.model.path")
        tokens = engine_load(config, shape).kv_tokens(point["gpu_bytes"])
        assert 0.85 <= tokens / point["kv_tokens"] <= 1.15, (point, tokens)


def test_a_tensor_parallel_reference_takes_a_gpu_per_rank_of_its_replica(tmp_path):
    """The reference runs as one replica of the actor's shape: with ``deepspeed.tp_size`` 2
    it holds two GPUs, each with half the decoder weights."""
    from rlhf.cli.config import replace
    from rlhf.cli.dry_run import rl_layout
    from rlhf.cli.presets import resolve

    model = _config_dir(tmp_path, "m", **LLAMA_8B)
    config = replace(
        resolve("grpo"),
        **{"actor.model.path": str(model), "actor.num_ranks": 2, "actor.deepspeed.tp_size": 2},
    )
    gpus, _ = rl_layout(config)
    refs = [p for gpu in gpus for p in gpu.learners if p.label.startswith("reference")]
    assert [p.label for p in refs] == ["reference rank 0", "reference rank 1"]
    shape = ModelShape.read(model, flag="--actor.model.path")
    split = shape.params - shape.layers * shape.layer_params // 2  # float32: 4 bytes each
    assert refs[0].memory.parts["weights"] == 4 * split


# Llama-3-8B's tensors pinned one buffer each, rounded up to a power of two: q and o
# (4096 x 4096) and k and v (4096 x 1024) are powers of two already, the MLP's 4096 x 14336
# rounds up to 4096 x 16384, the embedding and head (128256 x 4096) to 131072 x 4096.
LLAMA_8B_LAYER_ROUNDED = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 16384 + 2 * 4096
LLAMA_8B_ROUNDED = 32 * LLAMA_8B_LAYER_ROUNDED + 2 * 131072 * 4096 + 4096
"""Elements, each tensor rounded; times the bytes per element for one pinned buffer each."""


def test_zero2_offload_pins_masters_staging_and_gradients_on_the_host(tmp_path):
    """ZeRO-2 with the optimizer on the host (bf16, one rank) keeps there the float32 masters
    (4 bytes per parameter), their bf16 staging copy (2) and the float32 gradients (4), each
    pinned and so rounded up to a power of two; a pinned bf16 buffer of the largest
    parameter's gradient; one pinned bf16 buffer per parameter accumulating micro-batches;
    AdamW's moments (8) and its step's two float32 temporaries (8), pageable. For 8.03B
    parameters: 32.1 GB pins 2**35 bytes, 16.1 GB pins 2**34; two ranks halve the flat
    buffers and hold the per-parameter buffers of half the tensors."""
    from rlhf.learner import DeepSpeedConfig

    model = _config_dir(tmp_path, "m", **LLAMA_8B)
    shape = ModelShape.read(model, flag="--actor.model.path")
    assert 2**33 < 2 * shape.params <= 2**34 < 4 * shape.params <= 2**35
    head = 2 * 131072 * 4096  # the bf16 embedding, rounded
    ds = DeepSpeedConfig(bf16=True, offload_optimizer=True)
    one = learner_memory(RoleConfig(deepspeed=ds), shape, tokens=256, trains=True, outputs=1)
    flat = 2**35 + 2**34 + 2**35 + head
    assert one.host == flat + 2 * LLAMA_8B_ROUNDED + 16 * shape.params
    two = learner_memory(
        RoleConfig(deepspeed=ds, num_ranks=2), shape, tokens=256, trains=True, outputs=1
    )
    flat = 2**34 + 2**33 + 2**34 + head
    assert two.host == flat + LLAMA_8B_ROUNDED + 8 * shape.params


def test_zero2_offload_of_lora_adapters_counts_only_the_adapters(tmp_path):
    """With LoRA only the adapters ``t`` are trained: the flat buffers, the largest-gradient
    buffer (at most all adapters) and the accumulation buffers hold ``t`` elements, with the
    moments and AdamW's temporaries ``16t`` pageable."""
    import math

    from rlhf.cli.dry_run import lora_params
    from rlhf.learner import DeepSpeedConfig, ModelConfig

    model = _config_dir(tmp_path, "m", **LLAMA_8B)
    shape = ModelShape.read(model, flag="--actor.model.path")
    role = RoleConfig(
        model=ModelConfig(path=str(model), lora_rank=8),
        deepspeed=DeepSpeedConfig(bf16=True, offload_optimizer=True),
    )
    t = lora_params(shape, rank=8, targets=role.model.lora_target_modules)
    assert 0 < t < 128256 * 4096  # fewer than the embedding's elements

    def pinned(n: int) -> int:
        return 2 ** math.ceil(math.log2(n))

    memory = learner_memory(role, shape, tokens=256, trains=True, outputs=1)
    assert memory.host == pinned(4 * t) + 2 * pinned(2 * t) + pinned(4 * t) + 2 * t + 16 * t


def test_zero3_offload_pins_gradients_flat_and_per_sub_group_and_parameters_per_tensor(
    tmp_path,
):
    """ZeRO-3 with optimizer and parameters on the host (bf16, one rank): float32 gradients
    pinned flat (32.1 GB: 2**35) and per optimizer sub-group of 1e9 elements (8 of 4 GB: 2**32
    each, and the last 0.03e9: 2**27), pageable float32 masters and moments (12 bytes per
    parameter); the bf16 parameters pinned flat (16.1 GB: 2**34) and, first, per tensor."""
    from rlhf.learner import DeepSpeedConfig

    model = _config_dir(tmp_path, "m", **LLAMA_8B)
    shape = ModelShape.read(model, flag="--actor.model.path")
    rest = shape.params - 8 * 10**9
    assert 2**26 < 4 * rest <= 2**27
    ds = DeepSpeedConfig(bf16=True, zero_stage=3, offload_optimizer=True, offload_params=True)
    memory = learner_memory(RoleConfig(deepspeed=ds), shape, tokens=256, trains=True, outputs=1)
    gradients = 2**35 + 8 * 2**32 + 2**27
    parameters = 2**34 + 2 * LLAMA_8B_ROUNDED
    assert memory.host == gradients + 12 * shape.params + parameters


def test_molt_full_offload_pins_every_shard_and_gradient_on_its_own(tmp_path):
    """molt ``offload full`` (one rank): FSDP2 pins each float32 shard and each float32
    gradient by itself (each rounded up to a power of two), AdamW's moments are pageable
    (8 bytes per parameter) and its host step holds two float32 temporaries of the largest
    tensor (the embedding); two ranks pin half of each tensor and keep half the moments."""
    from rlhf.molt import FSDPConfig

    model = _config_dir(tmp_path, "m", **LLAMA_8B)
    shape = ModelShape.read(model, flag="--actor.model.path")
    largest = 128256 * 4096
    for ranks in (1, 2):
        role = RoleConfig(
            backend="molt", num_ranks=ranks, fsdp=FSDPConfig(param_dtype="bfloat16", offload="full")
        )
        memory = learner_memory(role, shape, tokens=256, trains=True, outputs=shape.vocab)
        pinned = 2 * 4 * LLAMA_8B_ROUNDED // ranks  # shards and gradients
        assert memory.host == pinned + (8 * shape.params + 8 * largest) / ranks


def test_host_and_device_plans_against_the_largest_steps_measured_on_an_h100(tmp_path):
    """bench_capacity ``--largest``'s steps (tests/data/measured_peaks.json): where the GPU
    bounds the level, the planned device allocation is within 15 % of the measured peak;
    wherever states are offloaded, the measured host peak (which includes the process's own
    few GiB) is 0.95-1.10 times the planned host memory."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_capacity import LARGEST, plan, wide_config

    points = json.loads(MEASURED.read_text())["largest"]
    device, host = {}, {}
    for point in points:
        key = f"{point['level']}/{point['layers']}"
        model_dir = tmp_path / key.replace("/", "-")
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(wide_config(point["layers"])))
        memory = plan(LARGEST[point["level"]], model_dir)
        if point["bound"] == "gpu":
            device[key] = memory.allocated / 2**30 / point["device_gib"]
        if memory.host:
            host[key] = point["host_gib"] / (memory.host / 2**30)
    assert len(device) == 3 and len(host) == 11, (device, host)
    outside = {k: round(r, 3) for k, r in device.items() if not 0.85 <= r <= 1.15}
    assert not outside, f"planned/measured device peak outside 0.85-1.15: {outside}"
    outside = {k: round(r, 3) for k, r in host.items() if not 0.95 <= r <= 1.10}
    assert not outside, f"measured/planned host memory outside 0.95-1.10: {outside}"
