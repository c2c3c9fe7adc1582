"""``--actor.fsdp.offload optimizer|full`` on 2 ranks (Ray actors, gloo): the same steps as
everything on the device, and checkpoints that resume with the optimizer offloaded or not;
hybrid turn-taking's `offload_states` / `reload_states` round trip between steps.

On a CPU machine host and device are one, so the numbers cannot differ by placement; these
tests pin down the bookkeeping: gradient shards reach the host masters, updated masters reach
the shards the forwards gather, weight decay and clipping apply once, and the checkpoint keeps
the resident layout."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from rlhf.learner import LearnerGroup, SFTObjective
from rlhf.molt import FSDPBackend, FSDPConfig

from .molt_cases import config, full_state, sft_batch


def molt(offload: str = "none"):
    return functools.partial(FSDPBackend, fsdp=FSDPConfig(offload=offload))


@pytest.fixture(scope="module")
def group(ray_cluster):
    g = LearnerGroup(num_ranks=2)
    yield g
    g.shutdown()


def _config(tiny):
    cfg = config(tiny, lr=1e-2)
    optimizer = dataclasses.replace(cfg.optimizer, grad_clip=1.0, weight_decay=0.1)
    return dataclasses.replace(cfg, optimizer=optimizer)


def _steps(group, batch, n: int) -> list[tuple[float, float, float]]:
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    out = [group.train_step(batch, objective, max_rows=3) for _ in range(n)]
    return [(r["loss"], r["grad_norm"], r["lr"]) for r in out]


@pytest.mark.parametrize("offload", ["optimizer", "full"])
def test_offloaded_steps_equal_resident_ones(group, tiny, tokenizer, offload) -> None:
    """Three AdamW steps (weight decay 0.1, the gradient clipped at norm 1) give the same
    losses, gradient norms, learning rates and weights as with everything on the device."""
    batch = sft_batch(tokenizer)
    runs = {}
    for mode in ("none", offload):
        group.build(_config(tiny), backend=molt(mode))
        initial = full_state(group)
        runs[mode] = (_steps(group, batch, 3), full_state(group))
        assert all(not torch.equal(initial[k], v) for k, v in runs[mode][1].items())
    assert runs[offload][0] == runs["none"][0]
    assert runs["none"][0][0][1] > 1.0  # the first step was clipped
    for name, tensor in runs["none"][1].items():
        assert torch.equal(runs[offload][1][name], tensor), name


def test_an_offloaded_optimizer_checkpoint_resumes_with_or_without_offload(
    group, tiny, tokenizer, tmp_path
) -> None:
    """A checkpoint taken with AdamW on the host holds get_state_dict's layout: resumed on
    the host or on the device, the next two steps equal the uninterrupted run's; a resident
    checkpoint resumes on the host the same way."""
    batch = sft_batch(tokenizer)
    for writer, readers in (("optimizer", ("optimizer", "none")), ("none", ("optimizer",))):
        group.build(_config(tiny), backend=molt(writer))
        _steps(group, batch, 1)
        path = group.save(str(tmp_path / writer), 1, client_state={"step": 1})
        expected = (_steps(group, batch, 2), full_state(group))
        for reader in readers:
            group.build(_config(tiny), backend=molt(reader))
            assert group.load(path) == {"step": 1}
            got = (_steps(group, batch, 2), full_state(group))
            assert got[0] == expected[0], (writer, reader)
            for name, tensor in expected[1].items():
                assert torch.equal(got[1][name], tensor), (writer, reader, name)


@pytest.mark.parametrize(
    ("offload", "moved"),
    [("none", ["optimizer", "weights"]), ("optimizer", ["weights"]), ("full", [])],
)
def test_states_moved_aside_between_steps_come_back_unchanged(
    group, tiny, tokenizer, offload, moved
) -> None:
    """Hybrid turn-taking: between two steps the states leave the device (twice: idempotent)
    and come back; the second step equals the one taken without the round trip. What already
    lives on the host (the optimizer under ``optimizer``, everything under ``full``) stays."""
    batch = sft_batch(tokenizer)
    group.build(_config(tiny), backend=molt(offload))
    expected = (_steps(group, batch, 2), full_state(group))
    group.build(_config(tiny), backend=molt(offload))
    first = _steps(group, batch, 1)
    group.offload_states(weights=False)
    assert group.run(lambda b: b.offloaded_states()) == [[m for m in moved if m != "weights"]] * 2
    group.offload_states(weights=True)
    group.offload_states(weights=True)
    assert group.run(lambda b: b.offloaded_states()) == [moved] * 2
    group.reload_states()
    assert group.run(lambda b: b.offloaded_states()) == [[], []]
    got = (first + _steps(group, batch, 1), full_state(group))
    assert got[0] == expected[0]
    for name, tensor in expected[1].items():
        assert torch.equal(got[1][name], tensor), name


def test_the_host_step_holds_one_gradient_at_a_time_and_equals_adamw():
    """`HostAdamW.step` brings one parameter's gradient to the host, steps it and drops it (the
    host never holds every gradient at once), and the result is torch AdamW's step over the
    same parameters, weight decay and schedule included, to the bit (the same single-tensor
    arithmetic on the host)."""
    from rlhf.learner import OptimizerConfig
    from rlhf.learner.optim import build_optimizer
    from rlhf.molt.offload import HostAdamW

    torch.manual_seed(0)
    settings = OptimizerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2, total_steps=10)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    host = HostAdamW(list(model.named_parameters()), settings)
    reference, schedule = build_optimizer(twin, settings)
    held: list[int] = []
    host.optimizer.register_step_pre_hook(
        lambda *_: held.append(sum(m.grad is not None for m in host.masters))
    )
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for net in (model, twin):
            net.zero_grad()
            net(x).square().mean().backward()
        host.step()
        host.scheduler.step()
        reference.step()
        schedule.step()
        for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        assert all(m.grad is None for m in host.masters)
    assert held == [1] * (3 * len(host.masters))
