"""A role's parallel layout and a rank's coordinates in it: plain data, importable without torch (the config
schema, the driver before Ray starts)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel sizes of a role; the data-parallel size follows from the role's world size."""

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel stages (must split the model's layers)
    cp: int = 1  # context-parallel size
    vpp: int | None = None  # virtual (interleaved) pipeline stages per rank
    ep: int = 1  # expert parallel: MoE experts split over this many ranks, carved out of data parallelism
    # expert tensor parallel: each expert split over this many ranks; None = tp (Megatron's default)
    etp: int | None = None

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} cp={self.cp} vpp={self.vpp} ep={self.ep} etp={self.etp}"

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def expert_problems(self, world_size: int) -> list[str]:
        """megatron-core's expert grid (etp x ep x expert-dp x pp) must tile the same ranks as tp x cp x dp x pp."""
        if self.ep < 1 or self.expert_tp < 1:
            return [f"ep={self.ep} and etp={self.etp} must be >= 1"]
        if self.ep == 1 and self.etp is None:
            return []
        ranks_per_stage = world_size // self.pp if world_size % self.pp == 0 else None
        if ranks_per_stage is None or ranks_per_stage % (self.ep * self.expert_tp):
            return [
                f"etp*ep = {self.expert_tp}*{self.ep} does not divide the {ranks_per_stage or world_size} ranks of a "
                "pipeline "
                f"stage (world_size={world_size}, pp={self.pp}); megatron-core carves expert parallelism out of "
                "tp x cp x dp, so choose ep and etp whose product divides world_size / pp"
            ]
        return []

    def dp_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {self.model_parallel_size} does not divide "
                f"world_size={world_size}; choose a world size that is a multiple of {self.model_parallel_size}."
            )
        return world_size // self.model_parallel_size


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the (dp, tp, pp, cp) grid of its role."""

    rank: int
    world_size: int
    dp: int
    tp: int
    pp: int
    cp: int
    dp_size: int
    tp_size: int
    pp_size: int
    cp_size: int

    @property
    def is_first_of_model_parallel(self) -> bool:
        """tp0/cp0/pp0: the rank that receives tensors under DP_MP_DISPATCH_FIRST."""
        return self.tp == 0 and self.cp == 0 and self.pp == 0

    @property
    def is_collect_rank(self) -> bool:
        """tp0/cp0 on the last pipeline stage: the rank whose output is collected."""
        return self.tp == 0 and self.cp == 0 and self.pp == self.pp_size - 1

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size}, dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp}"
