"""GPU paths of the learner, run on a CUDA machine with ``-m gpu``: packed and chunked-head
log-probs in bf16 through the GPU kernels."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _tiny_bf16_model(path, *, vocab_size: int, **model_options):
    """A random 2-layer Qwen2 saved at ``path`` and loaded through `load_model` in bf16 on
    the GPU (``model_options``: further `ModelConfig` fields)."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU; run them on the device machine")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.learner import ModelConfig, load_model

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return load_model(ModelConfig(path=str(path), dtype="bfloat16", **model_options)).cuda()


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_packed_logprobs_on_cuda_equal_the_padded_ones(tmp_path, attn) -> None:
    """bf16 on CUDA: the packed row runs through the GPU attention kernels (a block-causal
    mask for sdpa, a block mask for flex attention) and gives the padded batch's log-probs;
    `check_packing` accepts the model."""
    from rlhf.learner import check_packing, collate, token_logprobs

    model = _tiny_bf16_model(tmp_path, vocab_size=512, attn_implementation=attn).eval()
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (37, 200, 5, 128, 64)]
    batch = collate(rows, pad_token_id=0).to("cuda")
    check_packing(model, device="cuda", flag="model.packing_samples")
    with torch.no_grad():
        padded, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        packed, _ = token_logprobs(
            model, batch.input_ids, batch.attention_mask, packing_samples=True
        )
    real = batch.attention_mask.bool()
    # bf16 activations: the two layouts round differently (log-probs ≈ −6.2 here).
    torch.testing.assert_close(packed[real], padded[real], rtol=0, atol=0.1)
    assert (packed[:, 0] == 0).all() and (packed[~real] == 0).all()


def test_chunked_lm_head_on_cuda_equals_the_logits_path(tmp_path) -> None:
    """bf16 on CUDA, compiled chunk kernels: the chunked head's log-probs and the gradient of
    a weighted sum of them match the logits path to bf16 rounding."""
    from rlhf.learner import check_chunked_lm_head, collate, token_logprobs

    model = _tiny_bf16_model(tmp_path, vocab_size=4096)
    check_chunked_lm_head(model.eval(), device="cuda", flag="model.chunked_lm_head")
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (300, 17, 128)]
    batch = collate(rows, pad_token_id=0).to("cuda")
    weights = torch.randn(batch.input_ids.shape, generator=gen).cuda() * batch.attention_mask

    def run(chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        lp, _ = token_logprobs(
            model, batch.input_ids, batch.attention_mask, chunked_lm_head=chunked
        )
        (lp * weights).sum().backward()
        return lp.detach(), model.lm_head.weight.grad.float().clone()

    plain_lp, plain_grad = run(False)
    chunked_lp, chunked_grad = run(True)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(chunked_lp[real], plain_lp[real], rtol=0, atol=0.05)
    # bf16 gradients summed in another order: compare them as a whole.
    cosine = torch.nn.functional.cosine_similarity(chunked_grad.flatten(), plain_grad.flatten(), 0)
    assert cosine > 0.999, cosine


def _steps(config, deepspeed, batch, objective, *, steps: int) -> tuple[list[dict], dict, list]:
    """``steps`` actor steps of ``batch`` as one micro-batch on one in-process rank, then the
    log-probs of the batch (an eval forward) and the full state."""
    from rlhf.learner import DeepSpeedBackend, token_logprobs

    backend = DeepSpeedBackend(config, deepspeed=deepspeed)
    try:
        outs = [backend.train_micro_batches([batch], objective) for _ in range(steps)]
        logprobs = backend.forward_micro_batches(
            [batch], lambda m, b: token_logprobs(m, b.input_ids, b.attention_mask)[0]
        )
        state = backend.state_dict_on_rank0()
        if deepspeed.deepcompile:  # several micro-batches a step: refused
            halves = [batch.select([0, 1, 2]), batch.select([3, 4, 5])]
            with pytest.raises(ValueError, match="runs 2 micro-batches on a rank"):
                backend.train_micro_batches(halves, objective)
    finally:
        backend.close()
    from deepspeed.compile import util

    # A released compiled engine leaves no backward hook for the next one in this process.
    assert (util.pre_backward_hooks, util.post_backward_hooks) == ([], [])
    assert state is not None
    return outs, state, logprobs


@pytest.mark.parametrize("stage", [1, 3])  # float32 ZeRO-2 is refused (DeepSpeedConfig)
def test_deepcompile_steps_equal_the_eager_ones(tmp_path, stage) -> None:
    """``deepspeed.deepcompile`` on one GPU, float32: three actor steps of one micro-batch
    (no clipping) give the uncompiled engine's losses and gradient norms, then the same eval
    log-probs and weights; a step of two micro-batches is refused. The compiled kernels fuse
    and reorder float32 sums (TF32 stays off), so values agree to ~1e-5 relative: 1e-4 on
    the metrics; AdamW with ``eps`` 1 moves a weight by at most ``lr`` times a gradient's
    error, so the weights agree to ``lr * 1e-4`` after three steps."""
    from transformers import Qwen2ForCausalLM

    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.learner import (
        DeepSpeedConfig,
        LearnerConfig,
        ModelConfig,
        OptimizerConfig,
        PPOActorObjective,
    )

    from .test_units import _rl_batch

    _tiny_bf16_model(tmp_path, vocab_size=512)  # a float32 checkpoint of it is loaded below
    model = Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    batch = _rl_batch(model, seed=2)
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=AlgoConfig(), normalizer=norm)
    lr = 1e-3

    config = LearnerConfig(
        model=ModelConfig(path=str(tmp_path)),
        optimizer=OptimizerConfig(lr=lr, grad_clip=0.0, eps=1.0),
    )

    def engine(deepcompile: bool) -> DeepSpeedConfig:
        return DeepSpeedConfig(zero_stage=stage, deepcompile=deepcompile)

    eager, eager_state, eager_lp = _steps(config, engine(False), batch, objective, steps=3)
    compiled, state, lp = _steps(config, engine(True), batch, objective, steps=3)
    # Losses first: the later steps' say whether the updates were right, the norms whether
    # DeepSpeed reports them right (no clipping, so a wrong norm cannot change an update).
    assert [o["loss"] for o in compiled] == pytest.approx([o["loss"] for o in eager], rel=1e-4)
    norms = [o["grad_norm"] for o in eager]
    assert [o["grad_norm"] for o in compiled] == pytest.approx(norms, rel=1e-4)
    for got, want in zip(lp, eager_lp, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    moved = [n for n in state if not torch.equal(state[n], model.state_dict()[n].cpu())]
    assert moved  # the steps trained (the comparison below can fail)
    for name, tensor in eager_state.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=lr * 1e-4, msg=name)


def test_liger_kernels_give_the_same_logprobs_and_gradients(tmp_path) -> None:
    """OpenRLHF's ``--ds.use_liger_kernel``: the decoder's RMSNorm, SwiGLU and rotary
    embedding run as Liger's Triton kernels; log-probs and the gradient of a weighted sum of
    them match the plain model to bf16 rounding."""
    from rlhf.learner import collate, token_logprobs

    plain = _tiny_bf16_model(tmp_path / "plain", vocab_size=512)
    liger = _tiny_bf16_model(tmp_path / "liger", vocab_size=512, use_liger_kernel=True)
    layer = liger.model.layers[0]
    assert layer.mlp._get_name() == "LigerSwiGLUMLP"
    assert layer.input_layernorm.forward.__func__.__module__.startswith("liger_kernel")
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (37, 200, 64)]
    batch = collate(rows, pad_token_id=0).to("cuda")
    real = batch.attention_mask.bool()
    out = {}
    for name, model in (("plain", plain), ("liger", liger)):
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        (logprobs * real).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        out[name] = (logprobs.detach()[real].float(), grads)
    torch.testing.assert_close(out["liger"][0], out["plain"][0], rtol=0, atol=0.1)
    cosine = torch.nn.functional.cosine_similarity(out["liger"][1], out["plain"][1], dim=0)
    assert cosine > 0.99, cosine


def _mid_model(path) -> int:
    """A random Qwen2 of ~30M parameters saved at ``path`` (float32); its parameter count."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU; run them on the device machine")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _sft_work(vocab: int):
    """Two CUDA micro-batches of random rows and their token-mean SFT objective."""
    from rlhf.learner import SFTObjective, collate

    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (200, 150, 256, 90)]
    batch = collate(rows, pad_token_id=0, per_token={"loss_mask": [[1] * len(r) for r in rows]})
    micro = [batch.select([0, 1]).to("cuda"), batch.select([2, 3]).to("cuda")]
    return micro, SFTObjective(normalizer=float(batch["loss_mask"].sum()))


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_state_moves_free_the_gpu_and_the_steps_are_unchanged(tmp_path, stage) -> None:
    """Hybrid placement's round trip on a bf16 learner (``--train.deepspeed_enable_sleep``):
    the sync phase frees the fp32 master weights (4 bytes a parameter) and Adam's moments
    (8), the generation phase the bf16 weights (2) too; after the reload the next two steps
    are bit-identical to an engine's that never moved. ZeRO-3's master weights and moments
    move through `rlhf.learner.zero3_offload` (DeepSpeed's own move wants FusedAdam)."""
    import gc

    from rlhf.learner import (
        DeepSpeedBackend,
        DeepSpeedConfig,
        LearnerConfig,
        ModelConfig,
        OptimizerConfig,
    )

    params = _mid_model(tmp_path)
    micro, objective = _sft_work(8192)
    config = LearnerConfig(
        model=ModelConfig(path=str(tmp_path)), optimizer=OptimizerConfig(lr=1e-3, grad_clip=1.0)
    )
    deepspeed = DeepSpeedConfig(zero_stage=stage, bf16=True)

    def run(moves: bool) -> tuple[list[float], dict, dict]:
        backend = DeepSpeedBackend(config, deepspeed=deepspeed)
        freed = {}
        try:
            losses = [backend.train_micro_batches(micro, objective)["loss"]]
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            if moves:
                sync = backend.offload_states(weights=False)
                freed["sync"] = (before - sync["allocated_gib_after"] * 2**30) / params
                generation = backend.offload_states(weights=True)
                freed["generation"] = (before - generation["allocated_gib_after"] * 2**30) / params
                freed["states"] = backend.offloaded_states()
                back = backend.reload_states()
                freed["after_reload"] = (before - back["allocated_gib_after"] * 2**30) / params
                freed["states_after_reload"] = backend.offloaded_states()
            losses += [backend.train_micro_batches(micro, objective)["loss"] for _ in range(2)]
            state = backend.state_dict_on_rank0()
        finally:
            backend.close()
            gc.collect()
            torch.cuda.empty_cache()
        return losses, state, freed

    want, want_state, _ = run(moves=False)
    got, state, freed = run(moves=True)
    print(f"ZeRO-{stage} bytes per parameter freed:", freed)
    assert freed["sync"] >= 11.5  # fp32 master weights and both moments
    assert freed["generation"] >= 13.5  # and the bf16 weights
    assert {"hp_params", "optim_states", "lp_params", "lp_grads"} <= set(freed["states"])
    assert freed["after_reload"] <= 0.5 and freed["states_after_reload"] == []
    assert got == want
    assert state.keys() == want_state.keys()
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)


def test_qlora_on_cuda_trains_adapters_over_a_frozen_4bit_base(tmp_path) -> None:
    """``--ds.load_in_4bit`` on the GPU: the base moves to CUDA as bitsandbytes NF4 (uint8,
    its CUDA kernels), only the LoRA adapters train, the base stays bit-equal, and the merged
    export's projection is bitsandbytes' dequantised base plus PEFT's scaling · B A."""
    import gc

    from bitsandbytes.functional import dequantize_4bit

    from rlhf.learner import (
        DeepSpeedBackend,
        DeepSpeedConfig,
        LearnerConfig,
        ModelConfig,
        OptimizerConfig,
    )

    _mid_model(tmp_path)
    micro, objective = _sft_work(8192)
    config = LearnerConfig(
        model=ModelConfig(path=str(tmp_path), lora_rank=8, lora_alpha=16, load_in_4bit=True),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
    )
    backend = DeepSpeedBackend(config, deepspeed=DeepSpeedConfig(zero_stage=2, bf16=True))
    try:
        layer = backend.module.get_base_model().model.layers[0].self_attn.q_proj
        weight = layer.base_layer.weight
        assert (type(layer.base_layer).__name__, weight.dtype) == ("Linear4bit", torch.uint8)
        assert weight.device.type == "cuda"
        before = weight.detach().clone()
        losses = [backend.train_micro_batches(micro, objective)["loss"] for _ in range(6)]
        assert losses[-1] < losses[0] - 0.1, losses
        assert torch.equal(weight.detach(), before)
        base = dequantize_4bit(weight.data, weight.quant_state).float()
        a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
        want = (base + layer.scaling["default"] * (b @ a)).cpu()
        merged = backend.state_dict_on_rank0()
        assert merged is not None
        got = merged["model.layers.0.self_attn.q_proj.weight"].float()
        assert b.abs().max() > 0  # PEFT starts B at zero: the adapters trained
        # bf16 rounding of weights of about 0.02: 1e-3 is 25 of its steps there.
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    finally:
        backend.close()
        gc.collect()
        torch.cuda.empty_cache()
