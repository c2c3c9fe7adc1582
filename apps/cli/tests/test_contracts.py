"""The Ray wrappers restate the methods of what they wrap (`RayEngine` → `EngineActor` →
`VLLMEngine`, `LearnerGroup` → `RankWorker` → the `Backend` protocol): a method of one name
must take what the wrapped method takes, so that a signature changed on one side and not on
the other fails here instead of as a TypeError inside a Ray actor."""

from __future__ import annotations

import inspect

import pytest

from rlhf.learner import Backend, LearnerGroup
from rlhf.learner.ray_group import RankWorker
from rlhf.rollout import RayEngine
from rlhf.rollout.engine import VLLMEngine
from rlhf.rollout.ray_engine import EngineActor

EXTRAS = {"wait", "threads", "_ray_trace_ctx"}
"""Parameters a wrapper adds for its own work (not waiting for the ranks, compute threads), and
the tracing context Ray writes into an actor class's signatures once an actor of it was created
(earlier tests in the same process do)."""


def _methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def drift(wrapper: type, wrapped: type) -> list[str]:
    """How the methods ``wrapper`` shares with ``wrapped`` disagree: a parameter the wrapped
    method does not take, a default that differs, or a wrapped parameter without a default
    that the wrapper never passes."""
    out = []
    mine, theirs = _methods(wrapper), _methods(wrapped)
    for name in sorted(set(mine) & set(theirs)):
        ours = {p.name: p for p in list(mine[name].parameters.values())[1:]}
        wrapped_params = {p.name: p for p in list(theirs[name].parameters.values())[1:]}
        for pname, p in ours.items():
            if pname in EXTRAS:
                continue
            other = wrapped_params.get(pname)
            if other is None:
                out.append(f"{name}: {wrapped.__name__} takes no {pname!r}")
            elif p.default is not p.empty and other.default not in (p.empty, p.default):
                out.append(f"{name}: {pname}={p.default!r} against {other.default!r}")
        for pname, other in wrapped_params.items():
            if pname not in ours and other.default is other.empty:
                out.append(f"{name}: {wrapper.__name__} never passes {pname!r}")
    return out


@pytest.mark.parametrize(
    ("wrapper", "wrapped"),
    [
        (RayEngine, EngineActor),
        (EngineActor, VLLMEngine),
        (LearnerGroup, RankWorker),
        (RankWorker, Backend),
    ],
    ids=lambda c: c.__name__,
)
def test_mirrored_methods_take_what_they_wrap(wrapper, wrapped) -> None:
    shared = set(_methods(wrapper)) & set(_methods(wrapped))
    assert shared, "nothing mirrored: the pair is wrong"
    assert drift(wrapper, wrapped) == []


def test_the_check_sees_a_drifted_signature() -> None:
    class Wrapped:
        def load(self, directory: str, strict: bool = True) -> None: ...

        def save(self, directory: str, tag: str) -> None: ...

    class Wrapper:
        def load(self, directory: str, strict: bool = False) -> None: ...

        def save(self, path: str) -> None: ...

    assert drift(Wrapper, Wrapped) == [
        "load: strict=False against True",
        "save: Wrapped takes no 'path'",
        "save: Wrapper never passes 'directory'",
        "save: Wrapper never passes 'tag'",
    ]


def test_a_registered_backend_answers_for_its_roles(monkeypatch) -> None:
    """A third backend entry registered in `rlhf.cli.backends.BACKENDS` is what the role, the
    plan, the planner and validation ask: no branch on backend names stands in its way."""
    from rlhf.cli import backends
    from rlhf.cli.dry_run import compute_bytes, trains_on
    from rlhf.cli.sections import RoleConfig
    from rlhf.molt.entry import MoltEntry

    class Toy(MoltEntry):
        name = "toy"
        context_parallel_flag = "fsdp.toy_cp"

        def tensor_parallel(self, options) -> int:
            return 4

        def own_context_parallel(self, options) -> int:
            return 2

        def compute_bytes(self, options, model) -> int:
            return 1

        def describe(self, options, *, num_ranks: int, context_parallel: int) -> str:
            return f"toy (tp 4, cp {context_parallel}, {num_ranks} ranks)"

        def problems(self, options, role, *, flag: str) -> list[str]:
            return [f"--{flag}.backend toy needs nothing but this test ({role.num_ranks})"]

    monkeypatch.setitem(backends.BACKENDS, "toy", Toy())
    role = RoleConfig(backend="toy", num_ranks=8)
    assert (role.tensor_parallel, role.context_parallel) == (4, 2)
    assert trains_on(role) == "toy (tp 4, cp 2, 8 ranks)" and compute_bytes(role) == 1
    assert backends.role_problems(role, flag="actor")[-1] == (
        "--actor.backend toy needs nothing but this test (8)"
    )
    assert backends.role_problems(RoleConfig(backend="nope"), flag="actor") == [
        "--actor.backend must be one of deepspeed, molt, toy, got 'nope'"
    ]


def test_options_of_another_backend_are_refused_by_name() -> None:
    """``--actor.fsdp.*`` on the deepspeed backend, ``--actor.deepspeed.*`` on molt: the
    role's backend never reads them, so the run refuses them instead of ignoring them."""
    from rlhf.cli.backends import role_problems
    from rlhf.cli.sections import RoleConfig
    from rlhf.learner import DeepSpeedConfig
    from rlhf.molt import FSDPConfig

    on_deepspeed = RoleConfig(fsdp=FSDPConfig(offload="optimizer", compile=True))
    assert role_problems(on_deepspeed, flag="actor") == [
        "--actor.fsdp.offload, --actor.fsdp.compile configure the molt backend, and "
        "--actor.backend is deepspeed, which does not read them: add --actor.backend molt, or "
        "drop them (deepspeed's own options are --actor.deepspeed.*)"
    ]
    on_molt = RoleConfig(backend="molt", deepspeed=DeepSpeedConfig(zero_stage=3))
    assert role_problems(on_molt, flag="critic") == [
        "--critic.deepspeed.zero_stage configure the deepspeed backend, and --critic.backend is "
        "molt, which does not read them: add --critic.backend deepspeed, or drop them (molt's "
        "own options are --critic.fsdp.*)"
    ]
    assert role_problems(RoleConfig(backend="molt", fsdp=FSDPConfig(compile=True)), flag="a") == []
