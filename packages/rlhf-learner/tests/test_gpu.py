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
