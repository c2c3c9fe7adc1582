"""Where each role runs: on Ray resources of its own (disaggregated), or in bundles of a Ray
placement group shared with other roles (colocated).

- ``--train.colocate_actor_ref``: the reference shares the actor's first bundle.
- ``--train.colocate_critic_reward``: the reward model shares the critic's first bundle.
- ``--train.colocate_all``: one bundle per actor rank holds actor rank ``i``, critic rank ``i``
  and engine ``i``; the frozen scorers (reference, reward model, teachers) share bundle 0
  (hybrid placement).

A bundle reserves the sum of its members' CPUs (and, on GPUs, one GPU that its members split
evenly), so colocated roles run side by side on the same resources instead of each reserving
its own. `plan_bundles` is the pure layout; `place` creates the groups on the running cluster.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from rlhf.cli.config import ConfigError
from rlhf.cli.nodes import NodeSpec, Processes, unmatched
from rlhf.cli.sections import RoleConfig


@dataclasses.dataclass(frozen=True)
class Member:
    """One process of a role inside a bundle."""

    role: str
    rank: int
    cpus: float


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One placement group: ``bundles[b]`` lists the processes bundle ``b`` hosts."""

    name: str
    bundles: tuple[tuple[Member, ...], ...]


def plan_bundles(processes: Processes) -> list[GroupLayout]:
    """The placement groups the colocation flags call for (empty: every role on its own)."""
    roles = processes.ranks

    def layout(name: str, size: int, members: list[tuple[str, int, int]]) -> GroupLayout:
        bundles: list[list[Member]] = [[] for _ in range(size)]
        for role, rank, bundle in members:
            bundles[bundle].append(Member(role, rank, roles[role][1]))
        return GroupLayout(name, tuple(tuple(b) for b in bundles))

    if processes.colocate_all:
        n = roles["actor"][0]
        members = [(role, r, r) for role in ("actor", "critic", "engines") if role in roles
                   for r in range(roles[role][0])]  # fmt: skip
        frozen = [r for r in roles if r in ("ref", "reward_model") or r.startswith("teacher")]
        members += [(role, k, 0) for role in frozen for k in range(roles[role][0])]
        return [layout("all", n, members)]
    groups = []
    if processes.colocate_actor_ref and "ref" in roles:
        n = roles["actor"][0]
        groups.append(layout("actor_ref", n, [("actor", r, r) for r in range(n)] + [("ref", 0, 0)]))
    if processes.colocate_critic_reward and "critic" in roles and "reward_model" in roles:
        n = roles["critic"][0]
        members = [("critic", r, r) for r in range(n)] + [("reward_model", 0, 0)]
        groups.append(layout("critic_reward", n, members))
    return groups


def describe(layouts: list[GroupLayout]) -> str:
    """One line for the plan: the shared bundles, or that every role is on its own."""
    if not layouts:
        return "colocation: none, every role on resources of its own (disaggregated)"
    parts = []
    for layout in layouts:
        shared = ["+".join(f"{m.role}{m.rank}" for m in members) for members in layout.bundles]
        parts.append(f"{layout.name}: " + " | ".join(shared))
    return "colocation: bundles " + "; ".join(parts)


@dataclasses.dataclass
class Placement:
    """Ray scheduling of every role: ``scheduling[role]`` holds one strategy per process
    (None: the role reserves resources of its own, on the nodes ``nodes[role]`` allows);
    ``gpus[role]`` overrides its GPUs per process where it shares a GPU."""

    layouts: list[GroupLayout]
    scheduling: dict[str, list[Any]]
    gpus: dict[str, float]
    groups: list[Any]
    nodes: dict[str, NodeSpec] = dataclasses.field(default_factory=dict)

    def strategies(self, role: str, processes: int) -> list[Any] | None:
        """One Ray scheduling strategy per process of ``role`` (None: Ray's default)."""
        if role in self.scheduling:
            return self.scheduling[role]
        spec = self.nodes.get(role)
        return [spec.strategy()] * processes if spec else None

    def where(self, role: str) -> list[str] | None:
        """``group/bundle`` of each process of ``role``, or None when it is on its own."""
        found: dict[int, str] = {}
        for layout in self.layouts:
            for b, members in enumerate(layout.bundles):
                for m in members:
                    if m.role == role:
                        found[m.rank] = f"{layout.name}/{b}"
        return [found[r] for r in sorted(found)] or None

    def describe(self) -> str:
        return describe(self.layouts)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)
        self.groups = []


def describe_nodes(processes: Processes) -> str | None:
    """The plan's line on nodes, when any role names them."""
    specs = {role: spec for role, (_, spec) in processes.flagged_nodes().items()}
    if not any(specs.values()):
        return None
    return "nodes: " + ", ".join(f"{role} {spec.describe()}" for role, spec in specs.items())


def _group_node(layout: GroupLayout, nodes: dict[str, NodeSpec]) -> NodeSpec:
    """The node spec of a colocated group: its members' (validation keeps them from
    contradicting each other), the first role that sets one."""
    roles = [m.role for members in layout.bundles for m in members]
    return next((nodes[r] for r in roles if nodes[r]), NodeSpec())


def place(processes: Processes, *, gpu: bool, timeout_s: float = 300.0) -> Placement:
    """Create the placement groups of `plan_bundles` on the running Ray cluster, on the nodes
    the ``--*.node`` flags allow.

    Raises:
        ConfigError: a node spec that no alive node of the cluster satisfies (Ray would wait
            for such a node forever).
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    flagged = processes.flagged_nodes()
    problems = unmatched(dict(flagged.values()), ray.nodes())
    if problems:
        raise ConfigError("\n".join(problems))
    nodes = {role: spec for role, (_, spec) in flagged.items()}
    layouts = plan_bundles(processes)
    scheduling: dict[str, list[Any]] = {}
    gpus: dict[str, float] = {}
    groups = []
    for layout in layouts:
        resources = []
        for members in layout.bundles:
            bundle = {"CPU": max(sum(m.cpus for m in members), 0.01)}
            if gpu:
                bundle["GPU"] = 1.0
            resources.append(bundle)
        where = _group_node(layout, nodes)
        group = placement_group(
            resources,
            strategy="SPREAD" if where.spread else "PACK",
            name=f"rlhf-{layout.name}",
            bundle_label_selector=[where.bundle_selector()] * len(resources)
            if where.labels
            else None,  # pyright: ignore[reportArgumentType] (Ray's default is None too)
        )
        if not group.wait(timeout_seconds=timeout_s):
            raise RuntimeError(
                f"Ray could not reserve the colocated bundles {resources} within {timeout_s} s"
                + (f" on nodes {where.describe()}" if where else "")
                + ": the cluster lacks the CPUs/GPUs; lower --*.num_cpus* or drop the "
                "colocation flag"
            )
        groups.append(group)
        per_rank: dict[str, dict[int, Any]] = {}
        for b, members in enumerate(layout.bundles):
            for m in members:
                per_rank.setdefault(m.role, {})[m.rank] = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=b
                )
                if gpu:
                    gpus[m.role] = min(gpus.get(m.role, 1.0), 1.0 / len(members))
        for role, strategies in per_rank.items():
            scheduling[role] = [strategies[r] for r in sorted(strategies)]
    ray.get([g.ready() for g in groups])
    return Placement(layouts=layouts, scheduling=scheduling, gpus=gpus, groups=groups, nodes=nodes)


def role_strategies(role: RoleConfig, *, flag: str) -> list[Any] | None:
    """One Ray scheduling strategy per rank of a command's single role (``rlhf train sft``,
    ``rm``, ``dpo``) on the nodes its ``flag`` allows (None: Ray's default).

    Raises:
        ConfigError: a spec that does not parse, or that no alive node satisfies.
    """
    import ray

    try:
        spec = NodeSpec.parse(role.node, flag=flag)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    problems = unmatched({flag: spec}, ray.nodes())
    if problems:
        raise ConfigError(problems[0])
    return [spec.strategy()] * role.num_ranks if spec else None


def record_placement(group: Any, role: RoleConfig, path: pathlib.Path) -> None:
    """Write where a single-role command's ranks run (``run_dir/placement.json``): the node
    spec, and the Ray node and placement group each rank reports."""
    spec = NodeSpec.parse(role.node, flag="--model.node")
    report = {"node_spec": spec.describe(), **processes(group.run(where_this_process_runs))}
    path.write_text(json.dumps({"model": report}, indent=1))


def processes(where: list[dict[str, str | None]]) -> dict[str, list[str | None]]:
    """`where_this_process_runs` of a role's processes, as ``placement.json`` lists them."""
    return {
        "placement_group": [w["placement_group"] for w in where],
        "nodes": [w["node"] for w in where],
        "pids": [w.get("pid") for w in where],
    }


def where_this_process_runs(*_: Any) -> dict[str, str | None]:
    """The Ray node, placement group (None: none), process id and actor id of the calling
    actor, for ``run_dir/placement.json`` (and to name a process that dies)."""
    import os

    import ray

    context = ray.get_runtime_context()
    group = context.get_placement_group_id()
    return {
        "node": context.get_node_id(),
        "placement_group": str(group) if group else None,
        "pid": str(os.getpid()),
        "actor_id": context.get_actor_id(),
    }
