"""A vLLM engine that dies under ``rlhf train`` (``kill -9``, the out-of-memory killer) is
started again and the run goes on.

The engine pool (`rlhf.rollout.EnginePool`) notices the death on a request
(`rlhf.rollout.EngineDiedError`), the weight sync on loading (`rlhf.weights.SenderTransport`);
either calls the reviver made here, which restarts each dead engine once: a new engine with the
dead one's settings, seed and placement-group bundle (`rlhf.cli.roles.EngineLaunch.restart`)
takes the dead one's place in the run's engine list (which the transport, the hybrid
turn-taking and the reports share) and in the pool's slot, loads the last weight sync (the
version the other engines hold, `rlhf.weights.SenderTransport.replace`), and a ``[fault]``
line says so; the pool re-issues the lost requests. Each step's metrics row carries
``rollout/engine_restarts`` (engines restarted since the run started).

Over a broadcast group or CUDA IPC, whose last sync cannot be loaded again, an engine
restarted between syncs loads the actor's weights alone through the object store
(`rlhf.weights.load_alone`; a broadcast group is formed anew, with it, before the next sync).
A broadcast sync finds dead engines itself, before it sends or when its send fails; it ends
the live engines' receive, restarts the dead ones, forms the group anew and sends again
(`rlhf.weights.GroupTransport`). The actor's weights are the other
engines' only while the learners do not train ahead of them, so there, under
``--train.async_enable``, the death still stops the run with the command that resumes it
(`rlhf.cli.faults`); so does it under ``--train.colocate_all`` on GPUs (the engines sleep and
wake in turn with the learners). Pausing engines for a sync
(``--train.partial_rollout_enable``) still stops the run on a dead engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from rlhf.cli.metrics import MetricsSink
from rlhf.weights import GroupTransport, SenderTransport
from rlhf.weights import transport as transport_spec

if TYPE_CHECKING:
    from rlhf.cli.roles import Roles
    from rlhf.cli.sections import TrainConfig
    from rlhf.rollout import RayEngine
    from rlhf.weights import Transport


class RevivableRun(Protocol):
    """What revival needs of a run's driver (`rlhf.cli.rl.RLDriver` is one): its schedule
    (``--train.*``: colocation, async), its roles (engines, pool, how engines start), its
    weight transport, its metrics sink (wrapped to count restarts) and its ``echo`` for the
    ``[fault]`` line."""

    @property
    def train(self) -> TrainConfig: ...

    roles: Roles
    transport: Transport | None
    log: MetricsSink
    echo: Callable[[str], None]


def why_not_revivable(
    kind: str, *, gpu: bool, colocated: bool, asynchronous: bool = False
) -> str | None:
    """Why a dead engine stops the run under weight transport ``kind``, or None: it is
    revived."""
    if not transport_spec(kind).rejoinable and asynchronous:
        return (
            f"the {kind} weight transport cannot load a new engine the other engines' weights "
            "while the learners train ahead of them (--train.async_enable)"
        )
    if gpu and colocated:
        return "engines take turns with the learners on their GPUs (--train.colocate_all)"
    return None


class EngineReviver:
    """Restarts the run's dead engines: the pool's ``revive`` hook (`rlhf.rollout.Revive`)
    and the transport's ``on_engine_died`` (an engine found dead during a weight sync).
    One restart per dead engine, whichever finds it first.

    Args:
        driver: The run's driver: its roles (engines, pool, how engines start), its
            transport, and its ``echo`` for the ``[fault]`` line.

    Attributes:
        restarts: Engines restarted so far (``rollout/engine_restarts``).
    """

    def __init__(self, driver: RevivableRun) -> None:
        self.driver = driver
        self.restarts = 0
        self._lock = threading.Lock()

    async def __call__(self, index: int) -> RayEngine:
        pool = self.driver.roles.pool
        assert pool is not None  # revival is enabled only over a pool
        dead = pool.engines[index]
        return await asyncio.to_thread(self.restart, index, dead)

    def restart(self, index: int, dead: Any) -> RayEngine:
        """Engine ``index``, ``dead``, started again and synced (blocking); the engine
        already in its place when another caller restarted it first."""
        roles, transport = self.driver.roles, self.driver.transport
        assert roles.launch is not None
        assert roles.pool is not None
        assert isinstance(transport, (SenderTransport, GroupTransport))
        with self._lock:
            if roles.engines[index] is not dead:
                return roles.engines[index]
            tick = time.perf_counter()
            engine = roles.launch.restart(index)
            try:
                version = transport.replace(index, engine)
            except BaseException:
                engine.shutdown()
                raise
            roles.replace_engine(index, engine)
            roles.pool.replace(index, engine)
            self.restarts += 1
        self.driver.echo(
            f"[fault] vLLM engine {index} died under the run; restarted and re-synced to "
            f"version {version} in {time.perf_counter() - tick:.1f} s"
        )
        return engine


class RestartsInSteps:
    """A metrics sink that adds ``rollout/engine_restarts`` (engines restarted so far) to
    each step's row (the rows that carry ``time/step_s``) before passing it on."""

    def __init__(self, sink: MetricsSink, reviver: EngineReviver) -> None:
        self.sink, self.reviver = sink, reviver

    def write(self, metrics: Mapping[str, Any]) -> None:
        if "time/step_s" in metrics:
            metrics = {**metrics, "rollout/engine_restarts": float(self.reviver.restarts)}
        self.sink.write(metrics)

    def close(self) -> None:
        self.sink.close()


def enable_revival(
    driver: RevivableRun, *, kind: str, gpu: bool, echo: Callable[[str], None] = print
) -> None:
    """Give the run's pool the hook that revives its engines and count the revivals in the
    step rows, where the weight transport ``kind`` allows it; else say once that a dead
    engine stops the run."""
    train = driver.train
    why = why_not_revivable(
        kind, gpu=gpu, colocated=train.colocate_all, asynchronous=train.async_enable
    )
    if why is not None or driver.roles.launch is None or driver.roles.pool is None:
        echo(f"[plan] faults: a dead vLLM engine stops the run ({why or 'no launch recorded'})")
        return
    reviver = EngineReviver(driver)
    driver.roles.pool.revive = reviver
    assert isinstance(driver.transport, (SenderTransport, GroupTransport))
    driver.transport.on_engine_died = reviver.restart
    driver.log = RestartsInSteps(driver.log, reviver)
    echo("[plan] faults: a dead vLLM engine is restarted and re-synced")
