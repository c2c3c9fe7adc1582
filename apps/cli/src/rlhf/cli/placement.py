"""Where each role runs: on Ray resources of its own (disaggregated), or in bundles of a Ray
placement group shared with other roles (colocated).

- ``--train.colocate_actor_ref``: the reference shares the actor's first bundle.
- ``--train.colocate_critic_reward``: the reward model shares the critic's first bundle.
- ``--train.colocate_all``: one bundle per actor rank holds actor rank ``i``, critic rank ``i``
  and engine ``i``; the reference and the reward model share bundle 0 (hybrid placement).

A bundle reserves the sum of its members' CPUs (and, on GPUs, one GPU that its members split
evenly), so colocated roles run side by side on the same resources instead of each reserving
its own. `plan_bundles` is the pure layout; `place` creates the groups on the running cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhf.cli.config import RLConfig


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


def _ranks(config: RLConfig) -> dict[str, tuple[int, float]]:
    """Processes and CPUs per process of every role this run starts."""
    out = {"actor": (config.actor.num_ranks, config.actor.num_cpus_per_rank)}
    if config.uses_reference:
        out["ref"] = (1, config.actor.num_cpus_per_rank)
    if config.uses_critic:
        out["critic"] = (config.critic.num_ranks, config.critic.num_cpus_per_rank)
    if config.train.reward_model_path:
        out["reward_model"] = (1, config.actor.num_cpus_per_rank)
    out["engines"] = (config.vllm.num_engines, config.vllm.num_cpus)
    return out


def plan_bundles(config: RLConfig) -> list[GroupLayout]:
    """The placement groups the colocation flags call for (empty: every role on its own)."""
    t = config.train
    roles = _ranks(config)

    def layout(name: str, size: int, members: list[tuple[str, int, int]]) -> GroupLayout:
        bundles: list[list[Member]] = [[] for _ in range(size)]
        for role, rank, bundle in members:
            bundles[bundle].append(Member(role, rank, roles[role][1]))
        return GroupLayout(name, tuple(tuple(b) for b in bundles))

    if t.colocate_all:
        n = config.actor.num_ranks
        members = [(role, r, r) for role in ("actor", "critic", "engines") if role in roles
                   for r in range(roles[role][0])]  # fmt: skip
        members += [(role, 0, 0) for role in ("ref", "reward_model") if role in roles]
        return [layout("all", n, members)]
    groups = []
    if t.colocate_actor_ref and "ref" in roles:
        n = config.actor.num_ranks
        groups.append(layout("actor_ref", n, [("actor", r, r) for r in range(n)] + [("ref", 0, 0)]))
    if t.colocate_critic_reward and "critic" in roles and "reward_model" in roles:
        n = config.critic.num_ranks
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
    (None: the role reserves resources of its own); ``gpus[role]`` overrides its GPUs per
    process where it shares a GPU."""

    layouts: list[GroupLayout]
    scheduling: dict[str, list[Any]]
    gpus: dict[str, float]
    groups: list[Any]

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


def place(config: RLConfig, *, gpu: bool, timeout_s: float = 300.0) -> Placement:
    """Create the placement groups of `plan_bundles` on the running Ray cluster."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    layouts = plan_bundles(config)
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
        group = placement_group(resources, strategy="PACK", name=f"rlhf-{layout.name}")
        if not group.wait(timeout_seconds=timeout_s):
            raise RuntimeError(
                f"Ray could not reserve the colocated bundles {resources} within {timeout_s} s: "
                "the cluster lacks the CPUs/GPUs; lower --*.num_cpus* or drop the colocation flag"
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
    return Placement(layouts=layouts, scheduling=scheduling, gpus=gpus, groups=groups)


def placement_group_of_this_process(*_: Any) -> str | None:
    """The Ray placement group id the calling actor runs in (for run_dir/placement.json)."""
    import ray

    group = ray.get_runtime_context().get_placement_group_id()
    return str(group) if group else None
