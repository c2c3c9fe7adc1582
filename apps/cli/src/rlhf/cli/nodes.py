"""Which Ray nodes a role's processes may run on: ``--actor.node``, ``--critic.node``,
``--vllm.node`` (the reference and the reward model go where the actor goes).

A node spec is one of:

- ``""`` (default): any node; Ray decides.
- ``spread``: the role's processes on as many different nodes as Ray can find.
- ``key=value[,key=value]``: nodes carrying every one of these Ray node labels
  (``ray start --labels pool=rollout``; Ray's own ``ray.io/node-id=<hex>`` works too).
- a node id (the 56 hex digits ``ray status`` / ``ray list nodes`` print): that node.

`NodeSpec.parse` is pure (checked before anything starts); `unmatched` checks the running
cluster's nodes, since a selector no node satisfies would leave Ray waiting forever.
`Processes` is what placement reads of a run: its roles' processes, their nodes and how they
share resources.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NODE_ID_LABEL = "ray.io/node-id"
SPREAD = "spread"
_NODE_ID = re.compile(r"[0-9a-f]{56}")
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?")


class NodeSpecError(ValueError):
    """A node spec that does not parse; the message names the flag."""


@dataclass(frozen=True)
class NodeSpec:
    """Where one role's processes may run.

    Attributes:
        labels: ``(key, value)`` pairs a node must all carry (empty: any node).
        spread: Place the role's processes on different nodes where Ray can.
    """

    labels: tuple[tuple[str, str], ...] = ()
    spread: bool = False

    @classmethod
    def parse(cls, text: str, *, flag: str) -> NodeSpec:
        """``text`` as written after ``flag``; raises `NodeSpecError` naming the flag."""
        text = text.strip()
        if not text:
            return cls()
        if text == SPREAD:
            return cls(spread=True)
        if _NODE_ID.fullmatch(text):
            return cls(labels=((NODE_ID_LABEL, text),))
        labels = []
        for part in text.split(","):
            key, eq, value = (s.strip() for s in part.partition("="))
            if not (eq and _LABEL.fullmatch(key) and _LABEL.fullmatch(value)):
                raise NodeSpecError(
                    f"{flag} {text!r}: expected 'spread', a node id (56 hex digits) or "
                    "node labels as key=value[,key=value] (labels a node was started with: "
                    "ray start --labels pool=rollout)"
                )
            labels.append((key, value))
        return cls(labels=tuple(labels))

    def __bool__(self) -> bool:
        return bool(self.labels) or self.spread

    def matches(self, node_labels: Mapping[str, str]) -> bool:
        """A node with these labels may host the role."""
        return all(node_labels.get(key) == value for key, value in self.labels)

    def strategy(self) -> Any:
        """The Ray scheduling strategy of one process of a role on resources of its own
        (None: Ray's default)."""
        if self.spread:
            return "SPREAD"
        if not self.labels:
            return None
        from ray.util.scheduling_strategies import In, NodeLabelSchedulingStrategy

        return NodeLabelSchedulingStrategy({key: In(value) for key, value in self.labels})

    def bundle_selector(self) -> dict[str, str]:
        """The label selector of one placement-group bundle."""
        return dict(self.labels)

    def describe(self) -> str:
        if self.spread:
            return SPREAD
        return ",".join(f"{k}={v}" for k, v in self.labels) or "any node"


@dataclass(frozen=True, kw_only=True)
class Processes:
    """The processes a run starts and where they may go (`rlhf.cli.config.RLConfig.processes`).

    Attributes:
        ranks: Per started role (``actor``, ``ref``, ``critic``, ``reward_model``,
            ``engines``): its processes and the CPUs each reserves.
        nodes: Per role, the flag whose node spec it follows and that spec.
        colocate_all: ``--train.colocate_all`` (hybrid placement).
        colocate_actor_ref: ``--train.colocate_actor_ref``.
        colocate_critic_reward: ``--train.colocate_critic_reward``.
    """

    ranks: dict[str, tuple[int, float]]
    nodes: dict[str, tuple[str, NodeSpec]]
    colocate_all: bool = False
    colocate_actor_ref: bool = False
    colocate_critic_reward: bool = False

    def flagged_nodes(self) -> dict[str, tuple[str, NodeSpec]]:
        """``nodes`` of the roles this run starts."""
        return {role: spec for role, spec in self.nodes.items() if role in self.ranks}


def unmatched(specs: Mapping[str, NodeSpec], nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """One message per role whose labels no alive node carries.

    Args:
        specs: Flag (``--vllm.node``) to its spec.
        nodes: ``ray.nodes()`` entries (``Alive``, ``NodeID``, ``Labels``).
    """
    alive = [n for n in nodes if n.get("Alive")]
    problems = []
    for flag, spec in specs.items():
        if spec.labels and not any(spec.matches(n.get("Labels") or {}) for n in alive):
            known = "; ".join(f"{n['NodeID'][:12]}… {_labels(n)}" for n in alive)
            problems.append(
                f"{flag} {spec.describe()}: no alive node of the Ray cluster carries these "
                f"labels (nodes: {known}); start a node with them (ray start --labels …) or "
                "change the flag"
            )
    return problems


def _labels(node: Mapping[str, Any]) -> str:
    """A node's own labels (Ray's node id label left out), as a spec would write them."""
    labels = sorted((node.get("Labels") or {}).items())
    return ",".join(f"{k}={v}" for k, v in labels if k != NODE_ID_LABEL) or "no labels"
