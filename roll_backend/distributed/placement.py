"""Where a role's ranks run: Ray placement groups, one bundle per rank, and the rule that a model-parallel
block (the TP x CP ranks that talk at every layer) never spans two nodes."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from roll_backend.distributed.deadlines import call_deadline
from roll_backend.distributed.dispatch import DispatchError


class PlacementError(DispatchError):
    """The cluster cannot hold a role as asked (not enough free resources, or a TP group would span nodes)."""


def create_placement_group(
    num_bundles: int,
    cpus_per_bundle: float,
    gpus_per_bundle: float = 0.0,
    timeout_s: float = 120.0,
    strategy: str = "PACK",
) -> PlacementGroup:
    """Reserve `num_bundles` bundles (one per rank). Roles that share a group are colocated rank by rank.
    Waits `timeout_s` at most (less inside a shorter deadline scope)."""
    bundle = {"CPU": cpus_per_bundle} | ({"GPU": gpus_per_bundle} if gpus_per_bundle else {})
    group = placement_group([dict(bundle) for _ in range(num_bundles)], strategy=strategy)
    wait_s = call_deadline(timeout_s).remaining()
    ready, _ = ray.wait([group.ready()], timeout=wait_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(
            f"could not reserve {num_bundles} bundles of {bundle} ({strategy}) within {wait_s:.0f}s; "
            f"the cluster has {ray.available_resources()} free. Lower the role's world size or resources."
        )
    return group


@dataclass
class RankPlacement:
    """Bundle `bundles[r]` = (placement group, index) of rank r; `owned` groups are released with the role."""

    bundles: list[tuple[PlacementGroup, int]]
    owned: list[PlacementGroup]

    def release(self) -> None:
        for group in self.owned:
            remove_placement_group(group)
        self.owned = []


def reserve_rank_bundles(
    world_size: int, block: int, cpus: float, gpus: float, timeout_s: float = 120.0
) -> RankPlacement:
    """One STRICT_PACK placement group per model-parallel block of `block` consecutive ranks (Megatron orders
    ranks TP fastest, then CP), so a block always shares a node; blocks may land on different nodes."""
    if block <= 1 or block >= world_size:
        strategy = "STRICT_PACK" if block > 1 else "PACK"
        group = create_placement_group(world_size, cpus, gpus, timeout_s, strategy=strategy)
        return RankPlacement([(group, rank) for rank in range(world_size)], [group])
    groups: list[PlacementGroup] = []
    try:
        for _ in range(world_size // block):
            groups.append(create_placement_group(block, cpus, gpus, timeout_s, strategy="STRICT_PACK"))
    except BaseException:
        for group in groups:
            remove_placement_group(group)
        raise
    return RankPlacement([(groups[rank // block], rank % block) for rank in range(world_size)], groups)


def shared_rank_bundles(group: PlacementGroup, world_size: int, block: int, role: str) -> RankPlacement:
    """Rank r on bundle r of a placement group shared with colocated roles; refuses a layout whose TP x CP
    block would span two nodes there."""
    if group.bundle_count < world_size:
        raise PlacementError(
            f"{role}: placement group has {group.bundle_count} bundles, world_size={world_size} needs one per rank"
        )
    if block > 1:
        nodes = placement_group_table(group).get("bundles_to_node_id", {})
        for start in range(0, world_size, block):
            spanned = {nodes.get(b) for b in range(start, start + block)}
            if len(spanned) > 1:
                raise PlacementError(
                    f"{role}: ranks {start}..{start + block - 1} form one TP x CP group but their shared placement "
                    f"group put them on {len(spanned)} nodes; give the colocated roles nodes with room for "
                    f"{block} ranks each or use a smaller tp*cp"
                )
    return RankPlacement([(group, rank) for rank in range(world_size)], [])
