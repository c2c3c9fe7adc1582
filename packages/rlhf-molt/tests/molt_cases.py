"""Configs, batches and reads shared by the molt backend's tests."""

from __future__ import annotations

import functools

import torch

from rlhf.learner import (
    DeepSpeedBackend,
    DeepSpeedConfig,
    LearnerConfig,
    ModelConfig,
    OptimizerConfig,
    collate,
    sft_row,
    token_logprobs,
)


def config(
    path,
    *,
    kind: str = "causal_lm",
    packing: bool = False,
    chunked: bool = False,
    lr: float = 1e-3,
    eps: float = 1e-8,
) -> LearnerConfig:
    """One training role on ``path`` (AdamW, no clipping)."""
    return LearnerConfig(
        model=ModelConfig(
            path=str(path), kind=kind, packing_samples=packing, chunked_lm_head=chunked
        ),
        optimizer=OptimizerConfig(lr=lr, grad_clip=0.0, betas=(0.9, 0.95), eps=eps),
    )


ZERO2 = functools.partial(DeepSpeedBackend, deepspeed=DeepSpeedConfig(zero_stage=2))
"""The DeepSpeed twin the molt steps are held to: ZeRO-2."""


def full_state(group) -> dict[str, torch.Tensor]:
    return group.run(lambda backend: backend.state_dict_on_rank0())[0]


def rl_batch(model, *, seed: int):
    """Six rows of prompt + response with old/reference log-probs near the model's own."""
    gen = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for n_prompt, n_resp in [(3, 4), (5, 2), (2, 6), (4, 3), (3, 1), (6, 5)]:
        rows.append(torch.randint(3, 200, (n_prompt + n_resp,), generator=gen).tolist())
        masks.append([0] * n_prompt + [1] * n_resp)
    batch = collate(rows, pad_token_id=0, per_token={"action_mask": masks})
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    m = batch["action_mask"]
    batch.fields["old_logprobs"] = lp + torch.randn(lp.shape, generator=gen) * 0.3 * m
    batch.fields["ref_logprobs"] = lp + torch.randn(lp.shape, generator=gen) * 0.2 * m
    batch.fields["advantages"] = torch.randn(lp.shape, generator=gen) * m
    return batch


def sft_batch(tokenizer, n: int = 6):
    rows = [
        sft_row({"input": f"what is {i} plus {i}?", "output": str(2 * i)}, i, tokenizer)
        for i in range(n)
    ]
    return collate(
        [r.input_ids for r in rows],
        pad_token_id=tokenizer.pad_token_id,
        per_token={"loss_mask": [r.loss_mask for r in rows]},
    )


def critic_case(path, tmp, *, batch_seed: int, value_seed: int):
    """A clipped-value critic on the model at ``path`` with a random score head (a critic
    loaded from a causal LM starts with a zero head, whose step would leave the decoder's
    gradient zero and the values independent of it), saved at ``tmp``; a batch, the
    objective and the one-process reference: ``(tmp, batch, objective, loss, grad_norm)``."""
    from transformers import Qwen2ForCausalLM

    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.learner import CriticObjective, load_model

    critic = load_model(ModelConfig(path=str(path), kind="scalar"))
    with torch.no_grad():
        critic.score.weight.normal_(
            0.0, 0.5, generator=torch.Generator().manual_seed(value_seed + 1)
        )
    critic.save_pretrained(tmp)
    path = tmp
    ref = load_model(ModelConfig(path=str(path), kind="scalar"))
    gen = torch.Generator().manual_seed(value_seed)
    batch = rl_batch(Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32), seed=batch_seed)
    m = batch["action_mask"]
    batch.fields["old_values"] = torch.randn(m.shape, generator=gen) * m * 0.5
    batch.fields["returns"] = torch.randn(m.shape, generator=gen) * m
    algo = AlgoConfig(value_clip=0.2, loss_agg_mode="seq-mean-token-mean")
    objective = CriticObjective(
        algo=algo, normalizer=float(loss_normalizer(m, mode="seq-mean-token-mean"))
    )
    loss, _ = objective(ref, batch)
    loss.backward()
    grads = [p.grad for p in ref.parameters() if p.grad is not None]
    assert all(float(g.abs().max()) > 0 for g in grads)  # the decoder learns too
    return path, batch, objective, loss.item(), torch.sqrt(sum((g**2).sum() for g in grads)).item()


def clipped_ppo_case(path, *, lr: float, eps: float, packing: bool = False):
    """A PPO actor batch (KL loss, entropy bonus) on the model at ``path`` and the reference
    step in this process with the gradient clipped to half its norm:
    ``(model after the step, batch, objective, config with that clip, loss, grad_norm)``."""
    import dataclasses

    from transformers import Qwen2ForCausalLM

    from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer
    from rlhf.learner import PPOActorObjective
    from rlhf.learner.optim import build_optimizer

    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = rl_batch(model, seed=5)
    algo = AlgoConfig(kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01)
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)
    loss, _ = objective(model, batch)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())).item()
    cfg = config(path, packing=packing, lr=lr, eps=eps)
    cfg = dataclasses.replace(
        cfg, optimizer=dataclasses.replace(cfg.optimizer, grad_clip=grad_norm / 2)
    )
    optimizer, scheduler = build_optimizer(model, cfg.optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_norm / 2)
    optimizer.step()
    scheduler.step()
    return model, batch, objective, cfg, loss.item(), grad_norm
