"""A process of the run killed under it (``kill -9``): a vLLM engine is restarted, re-synced and
the run finishes; a learner rank stops the run naming the role and the checkpoint to resume
from, without a Ray traceback. The driver stopped by SIGTERM shuts down every Ray process it
started."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rlhf.learner import latest_checkpoint

from .conftest import process_env, rlhf, small_run


def _wait_for(predicate, *, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.2)


def _kill_after_two_steps(assets, run_dir, role: str, *, timeout: float, extra=()):
    """Start an 8-step run, kill -9 the first process of ``role`` once step 2's checkpoint
    is saved, and wait for the run to end: (the run's flags, returncode, stdout, stderr)."""
    flags = ["--run_dir", str(run_dir), *small_run(assets, steps=8), "--ckpt.save_steps", "1",
             *extra]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.cli", "train", "grpo", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=process_env(cluster="shared"),
    )  # fmt: skip
    try:
        ckpt = run_dir / "checkpoints"

        def two_steps_saved() -> bool:
            latest = latest_checkpoint(ckpt) if ckpt.is_dir() else None
            if latest is None:
                return False
            return json.loads((latest / "trainer_state.json").read_text())["step"] >= 2

        _wait_for(two_steps_saved, timeout=600, proc=proc)
        placement = json.loads((run_dir / "placement.json").read_text())
        pid = int(placement[role]["pids"][0])
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return flags, proc.returncode, out, err


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_a_killed_engine_is_restarted_and_the_run_finishes(assets, tmp_path, transport):
    """shared_memory keeps the last sync for the new engine; over a broadcast group the new
    engine loads the actor's weights alone, or the sync that found it dead, and the group is
    formed anew with it."""
    run_dir = tmp_path / "run"
    extra = ("--train.weight_transport", transport)
    _, code, out, err = _kill_after_two_steps(assets, run_dir, "engines", timeout=600, extra=extra)
    assert code == 0, err[-3000:] + out[-3000:]
    faults = [x for x in out.splitlines() if x.startswith("[fault]")]
    assert len(faults) == 1, out[-3000:]
    found = re.fullmatch(
        r"\[fault\] vLLM engine 0 died under the run; restarted and re-synced to version "
        r"(\d+) in [\d.]+ s",
        faults[0],
    )
    assert found is not None, faults[0]
    version = int(found.group(1))
    assert 2 <= version <= 8  # killed after step 2 was saved: the engines held version >= 2
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))  # no step lost
    assert steps[-1]["rollout/engine_restarts"] == 1.0
    assert [r["rollout/engine_restarts"] for r in steps[:2]] == [0.0, 0.0]
    # The new engine loaded the version it was restarted at, then every later sync
    # (versions version+1 … 8) over the run's transport; every load was verified.
    sync = json.loads((run_dir / "sync.json").read_text())
    assert sync["transport"] == transport
    if transport == "shared_memory":  # the last sync again, then the later ones
        assert sync["engines_loaded"][0] == {"shared_memory": 9 - version}
    else:
        # Found dead by the pool: the actor's weights alone through the object store, then
        # the re-formed group; found by a sync: that sync and the later ones by the group.
        by_pool = {"object_store": 1, "broadcast": 8 - version}
        by_sync = {"broadcast": 9 - version}
        expected = [{k: n for k, n in e.items() if n} for e in (by_pool, by_sync)]
        assert sync["engines_loaded"][0] in expected


def test_a_killed_learner_rank_stops_the_run_with_the_command_that_resumes_it(assets, tmp_path):
    run_dir = tmp_path / "run"
    flags, code, _, err = _kill_after_two_steps(assets, run_dir, "actor", timeout=300)
    assert code == 1, err[-3000:]
    assert "rlhf: the actor rank 0" in err and "died during the run" in err
    assert "--ckpt.load_enable True to resume" in err
    assert "Traceback" not in err, err[-4000:]
    done = rlhf("train", "grpo", *flags, "--ckpt.load_enable", "True")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if "reward/mean" in r) == 8


def test_a_dead_engine_stops_the_run_where_it_cannot_rejoin(tmp_path):
    import types

    from ray.exceptions import ActorDiedError

    from rlhf.cli.faults import actor_died
    from rlhf.cli.revive import why_not_revivable
    from rlhf.rollout import RayEngine

    # What the pool raises there (RayEngine's EngineDiedError) stops the run as a dead actor.
    engine = RayEngine(types.SimpleNamespace(_actor_id=bytes.fromhex("ab12")))
    died = engine.died(ActorDiedError())
    assert died.actor_id == "ab12"
    error = str(actor_died(died, ckpt_root=tmp_path, names={"ab12": "vLLM engine 1"}))
    assert error.startswith("the vLLM engine 1 died during the run (the vLLM engine actor ab12")
    assert "the run stopped. There is no checkpoint under" in error
    unnamed = str(actor_died(died, ckpt_root=tmp_path))
    assert unnamed.startswith("a vLLM engine died during the run")

    assert why_not_revivable("shared_memory", gpu=False, colocated=False) is None
    assert why_not_revivable("object_store", gpu=True, colocated=False) is None
    assert why_not_revivable("broadcast", gpu=False, colocated=False) is None
    assert why_not_revivable("cuda_ipc", gpu=True, colocated=False) is None
    assert why_not_revivable("shared_memory", gpu=False, colocated=False, asynchronous=True) is None
    ahead = why_not_revivable("broadcast", gpu=False, colocated=False, asynchronous=True)
    assert "broadcast" in ahead and "--train.async_enable" in ahead
    assert "colocate_all" in why_not_revivable("cuda_ipc", gpu=True, colocated=True)
    assert "colocate_all" in why_not_revivable("object_store", gpu=True, colocated=True)


def _kill_and_wait(engine) -> None:
    """Kill ``engine``'s actor and wait until Ray reports it dead (Ray kills asynchronously)."""
    import ray
    from ray.exceptions import RayActorError

    ray.kill(engine.handle, no_restart=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            engine.weight_version  # noqa: B018
        except RayActorError:
            return
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _greedy_tokens(engines) -> list[tuple[int, ...]]:
    """Each engine's greedy completion of one prompt (equal when they serve equal weights)."""
    from rlhf.agents import SamplingParams

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def each():
        return await asyncio.gather(*(e.generate([5, 6, 7], greedy) for e in engines))

    return [g.token_ids for g in asyncio.run(each())]


def test_an_engine_found_dead_during_a_sync_is_restarted_with_that_sync(assets, ray_connected):
    """The other way an engine's death shows: the weight sync after a step finds it dead
    (it died while the learners trained). The live engine loads the sync, then a new engine
    takes the dead one's place, in the run's engines and the pool, and loads the same sync."""
    import types

    import torch
    from safetensors.torch import load_file

    from rlhf.agents import SamplingParams
    from rlhf.cli.revive import EngineReviver
    from rlhf.cli.roles import EngineLaunch, Roles
    from rlhf.learner import SentWeights
    from rlhf.rollout import EngineConfig, EnginePool
    from rlhf.weights import ObjectStoreSender, SenderTransport, pack_buckets

    config = EngineConfig(model=str(assets["model"]), dtype="float32", max_model_len=64)
    launch = EngineLaunch(config, num_engines=2, num_cpus=0.5, num_gpus=0.0, scheduling=None)
    engines = launch.start()
    try:
        pool = EnginePool(engines)
        roles = Roles(engines, pool, None, None, None, None, None, None, launch=launch)  # type: ignore[arg-type]
        state = load_file(str(assets["model"] / "model.safetensors"))
        gen = torch.Generator().manual_seed(5)
        trained = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        synced = ObjectStoreSender().send(
            pack_buckets(trained.items(), version=3, bucket_bytes=1 << 20)
        )
        # rank 0's sender made `synced` (and `send_weights` returns it with its seconds)
        actor = types.SimpleNamespace(send_weights=lambda **_: SentWeights(synced, 0.0))
        transport = SenderTransport("object_store", actor, roles.engines, True, 1 << 20)  # type: ignore[arg-type]
        lines: list[str] = []
        driver = types.SimpleNamespace(roles=roles, transport=transport, echo=lines.append)
        reviver = EngineReviver(driver)  # type: ignore[arg-type]
        transport.on_engine_died = reviver.restart
        dead = engines[0]
        _kill_and_wait(dead)  # dead before the sync starts

        transport.sync(3)
        new = roles.engines[0]
        assert new is not dead and pool.engines[0] is new and transport.engines[0] is new
        assert reviver.restarts == 1 and pool.restarts == 0  # restarted outside the pool
        assert [e.weight_version for e in roles.engines] == [3, 3]
        assert len(lines) == 1
        assert lines[0].startswith(
            "[fault] vLLM engine 0 died under the run; restarted and re-synced to version 3"
        )
        first, second = _greedy_tokens(roles.engines)
        assert first == second  # the same weights in both
        # The pool serves from the new engine without reviving again.
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        asyncio.run(pool.generate_group([5, 6, 7], greedy, n=4))
        assert pool.restarts == 0 and reviver.restarts == 1
    finally:
        for e in roles.engines:
            e.shutdown()


def test_a_broadcast_sync_replaces_engines_dead_before_it_and_dying_during_it(
    assets, ray_connected
):
    """Over a gloo broadcast group (the actor's rank 0 in this process): an engine dead
    before a sync is found by the sync, restarted and sent that sync in a group formed anew;
    an engine killed while the sync streams (after its first bucket) ends the sender's
    broadcast, the live engine's receive is ended at once (not after the group's 300 s
    timeout), the dead one is restarted and the sync is sent again. Both engines then hold
    each sync's weights (verified loads), and sample alike."""
    import types

    import ray
    import torch
    from safetensors.torch import load_file

    from rlhf.cli.revive import EngineReviver
    from rlhf.cli.roles import EngineLaunch, Roles
    from rlhf.learner import RankSenders
    from rlhf.rollout import EngineConfig, EnginePool
    from rlhf.weights import GroupTransport

    config = EngineConfig(model=str(assets["model"]), dtype="float32", max_model_len=64)
    launch = EngineLaunch(config, num_engines=2, num_cpus=0.5, num_gpus=0.0, scheduling=None)
    engines = launch.start()
    pool = EnginePool(engines)
    roles = Roles(engines, pool, None, None, None, None, None, None, launch=launch)  # type: ignore[arg-type]
    transport = None
    try:
        state = load_file(str(assets["model"] / "model.safetensors"))
        gen = torch.Generator().manual_seed(5)
        weights = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        kill_after_first: list = []  # an engine to kill once the next stream's first bucket left

        def named_full_parameters():
            for n, (name, tensor) in enumerate(weights.items()):
                if n == 1 and kill_after_first:
                    ray.kill(kill_after_first.pop().handle, no_restart=True)
                yield name, tensor

        rank0 = types.SimpleNamespace(
            rank=0, device=torch.device("cpu"), named_full_parameters=named_full_parameters
        )
        # The actor's rank 0 in this process, its sender kept as a rank keeps it.
        senders = RankSenders()
        actor = types.SimpleNamespace(
            close_weight_sender=lambda kind, wait=True: senders.close(kind) or [],
            new_weight_group=lambda **kw: senders.new_group(rank0, host="127.0.0.1", **kw),
            join_weight_group=lambda **kw: senders.join(rank0, **kw),
            send_weights=lambda **kw: senders.send(rank0, **kw),
        )
        transport = GroupTransport(actor, roles.engines, True, 1 << 14)  # type: ignore[arg-type]
        # A live engine's receive must end once the actor leaves the group; one that waited
        # out the group's 300 s timeout would fail the sync here.
        transport.answer_timeout_s = 30.0
        lines: list[str] = []
        driver = types.SimpleNamespace(roles=roles, transport=transport, echo=lines.append)
        reviver = EngineReviver(driver)  # type: ignore[arg-type]
        transport.on_engine_died = reviver.restart

        first = engines[0]
        _kill_and_wait(first)  # dead before the sync starts
        transport.sync(3)
        assert roles.engines[0] is not first and pool.engines[0] is roles.engines[0]
        assert [e.weight_version for e in roles.engines] == [3, 3]
        assert roles.engines[0].weight_loads() == {"broadcast": 1}  # this sync, by the group
        assert len(lines) == 1 and lines[0].startswith(
            "[fault] vLLM engine 0 died under the run; restarted and re-synced to version 3"
        )

        second = roles.engines[1]
        weights = {k: v + 0.1 for k, v in weights.items()}
        kill_after_first.append(second)
        transport.sync(4)
        assert roles.engines[1] is not second and reviver.restarts == 2
        assert [e.weight_version for e in roles.engines] == [4, 4]
        assert roles.engines[1].weight_loads() == {"broadcast": 1}
        assert roles.engines[0].weight_loads() == {"broadcast": 2}  # 3, then 4 (sent twice)
        assert lines[1].startswith(
            "[fault] vLLM engine 1 died under the run; restarted and re-synced to version 4"
        )
        a, b = _greedy_tokens(roles.engines)
        assert a == b  # the same weights in both
    finally:
        if transport is not None:
            transport.close()
        for e in roles.engines:
            e.shutdown()


def test_sigterm_stops_the_run_and_every_ray_process_it_started(assets, tmp_path):
    import psutil

    run_dir = tmp_path / "run"
    flags = ["--run_dir", str(run_dir), *small_run(assets, steps=50), "--ckpt.save_steps", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.cli", "train", "grpo", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=process_env(cluster="own"),  # its own cluster: every process of it must stop
    )  # fmt: skip
    try:
        ckpt = run_dir / "checkpoints"
        _wait_for(lambda: latest_checkpoint(ckpt) is not None, timeout=600, proc=proc)
        started = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in started}
        assert {"raylet", "gcs_server"} <= names, names  # Ray's own processes are among them
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlhf: stopped by SIGTERM. The Ray processes it started were shut"), last
    assert "--ckpt.load_enable True to resume" in last and "step-0000000" in last, last
    assert "Traceback" not in err, err[-3000:]
    # Ray's own SIGTERM handler (installed by ray.init) dumps this and aborts 3 s later.
    assert "SIGTERM received" not in err, err[-3000:]

    def alive() -> list[str]:
        out = []
        for p in started:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {p.name()}")
            except psutil.NoSuchProcess:
                pass
        return out

    deadline = time.monotonic() + 60  # generous: Ray stops its processes asynchronously
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(), f"left running after the driver stopped: {alive()}"
