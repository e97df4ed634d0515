"""Data parallelism across nodes: which nodes run an extractor group, and where each writes.

A group is one extractor (``model.tp_size`` GPUs of one node, or its CPUs) and
its writers, all on that node, so that states never cross the network; the
group writes to that node's local directory under that node's own disk budget.
The driver places both with a hard node affinity: one actor's GPUs are always
on one node, and naming the node is what keeps its writers beside it.

A node's name is its ``eagle3-node`` label when it has one (``ray start
--labels='{"eagle3-node": "gpu-3"}'``), else its IP address; ``{node}`` in
``output.node_dir`` is replaced by it, and the manifest records it for every
shard file, so that a resume knows where each file lives.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from jobs.actors.extractor import EXTRACTOR_CPUS
from jobs.cluster.node_disk import LocalDisk, disk_on

NODE_LABEL = "eagle3-node"
NODE_PLACEHOLDER = "{node}"
AUTO_WRITERS_FLOOR = 8
"""Writers a node of 16+ CPUs gets with output.num_writers=0: the 16-core H200 host measured 3.7 GB/s
of states with 8 writers (their main threads 44% busy)."""
AUTO_WRITERS_CEILING = 32


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    """One data-parallel group: an extractor and its writers on one node."""

    node_id: str
    name: str
    """The node's name (label or IP): what the manifest records and ``{node}`` becomes."""
    directory: Path
    """Where this node's shard files go (its local disk)."""
    writers: int

    def placement(self) -> dict[str, Any]:
        """Actor options that pin an actor to this node."""
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(self.node_id, soft=False)}

    def disk(self) -> LocalDisk:
        """This group's directory, looked at on its node."""
        return disk_on(self.directory, self.node_id, self.placement())


def node_name(node: dict[str, Any]) -> str:
    return node.get("Labels", {}).get(NODE_LABEL) or node["NodeManagerAddress"]


def node_directory(output_dir: Path, node_dir: str, name: str) -> Path:
    return Path(node_dir.replace(NODE_PLACEHOLDER, name)) if node_dir else output_dir


def plan_groups(
    nodes: list[dict[str, Any]], dp_size: int, tp_size: int, device: str, num_writers: int, output_dir: Path,
    node_dir: str,
) -> list[NodeGroup]:
    """``dp_size`` groups (0: as many as the cluster holds), spread over the alive ``nodes`` (``ray.nodes()``).

    On CUDA a node holds ``GPUs // tp_size`` groups; on CPU one (the extractor's ranks share
    its cores), if it has a CPU for the extractor and one for a writer.
    """
    nodes = sorted((n for n in nodes if n.get("Alive")), key=lambda n: (not _is_head(n), node_name(n)))
    slots: list[tuple[dict[str, Any], int]] = []  # (node, groups it holds)
    for node in nodes:
        resources = node.get("Resources", {})
        cpus = int(resources.get("CPU", 0))
        held = int(resources.get("GPU", 0)) // tp_size if device == "cuda" else int(cpus >= EXTRACTOR_CPUS + 1)
        if held:
            slots.append((node, held))
    capacity = sum(held for _, held in slots)
    if capacity == 0 or dp_size > capacity:
        unit = f"{tp_size} GPUs" if device == "cuda" else f"{EXTRACTOR_CPUS + 1} CPUs"
        raise ValueError(
            f"model.dp_size={dp_size}: the Ray cluster's {len(nodes)} nodes hold {capacity} extractor groups of "
            f"{unit} each; lower model.dp_size (0 takes what the cluster holds) or add nodes"
        )
    wanted = dp_size or capacity
    names = [node_name(node) for node, _ in slots]
    if len(set(names)) < len(names) and len(slots) > 1:
        raise ValueError(
            f"nodes share the name {max(set(names), key=names.count)!r}: give each node its own "
            f"{NODE_LABEL} label (ray start --labels='{{\"{NODE_LABEL}\": \"NAME\"}}') so that each shard file's node is known"
        )
    groups: list[NodeGroup] = []
    while len(groups) < wanted:  # round-robin over nodes: one group per node before a second on any
        for node, held in slots:
            on_node = sum(g.node_id == node["NodeID"] for g in groups)
            if on_node < held and len(groups) < wanted:
                groups.append(NodeGroup(
                    node["NodeID"], node_name(node), node_directory(output_dir, node_dir, node_name(node)),
                    _writers(node, held, num_writers),
                ))
    return groups


def writers_for(groups: list[NodeGroup], shards: int) -> list[NodeGroup]:
    """``groups`` with no more writers each than the run has ``shards`` to write (at least one): a writer holds
    one shard at a time, so a rerun of one shard starts one writer, not a node's eight (each a process of its own)."""
    return [dataclasses.replace(group, writers=max(1, min(group.writers, shards))) for group in groups]


def this_host(cpus: int) -> dict[str, Any]:
    """The one CPU node of the private cluster the job would start here, as ``ray.nodes()`` would list it
    (the dry run plans against it without starting Ray)."""
    return {"NodeID": "this-host", "Alive": True, "NodeManagerAddress": "127.0.0.1", "Labels": {},
            "Resources": {"CPU": float(cpus), "node:__internal_head__": 1.0}}


def _writers(node: dict[str, Any], groups_on_node: int, requested: int) -> int:
    """Writers per group: ``output.num_writers``, or with 0 half the node's CPUs (at least 8, at most 32,
    never more than its CPUs left after its extractors) shared among its groups. More than the node
    has would wait for a slot forever."""
    cpus = int(node.get("Resources", {}).get("CPU", 0))
    spare = (cpus - groups_on_node * EXTRACTOR_CPUS) // groups_on_node
    if requested == 0:
        wanted = min(AUTO_WRITERS_CEILING, max(AUTO_WRITERS_FLOOR, cpus // 2)) // groups_on_node
        return max(1, min(wanted, spare))
    if requested > spare:
        raise ValueError(
            f"output.num_writers={requested}, but node {node_name(node)} has {max(0, spare)} CPUs per extractor "
            f"group besides the extractor's (each writer takes 1 CPU, and would wait for one forever): set "
            f"output.num_writers to at most {max(1, spare)}, or 0 to follow the CPUs Ray has"
        )
    return requested


def _is_head(node: dict[str, Any]) -> bool:
    return "node:__internal_head__" in node.get("Resources", {})
