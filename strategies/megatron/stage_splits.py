"""Pipeline stage splits of a Megatron model: how many decoder layers each (virtual) stage holds, and the splits
Megatron cannot build. No Megatron import (the validator uses them before Ray starts)."""

from __future__ import annotations

from roll_backend.distributed.layout import ParallelLayout


def stage_split_problem(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> str | None:
    """Why Megatron cannot split `num_layers` over `pp` stages (x `vpp` model chunks) this way, or None.

    `first`/`last` are Megatron's num_layers_in_first/last_pipeline_stage (None: an even share). Every stage
    needs at least one layer per model chunk, the first/last counts a multiple of vpp, and the layers left
    for the middle stages an equal multiple of vpp each.
    """
    chunks = vpp or 1
    if vpp is not None and (vpp < 2 or pp < 2):
        return f"vpp={vpp} needs pp >= 2 and vpp >= 2 (interleaved stages); set vpp=None or raise pp"
    if pp == 1:
        return None if first is None and last is None else "first/last_stage_layers need pp >= 2; remove them"
    middle_layers, middle_stages = num_layers, pp
    for name, count in (("first_stage_layers", first), ("last_stage_layers", last)):
        if count is None:
            continue
        if count < chunks or count % chunks:
            return f"{name}={count} must be a positive multiple of vpp={chunks} (one or more layers per model chunk)"
        middle_layers -= count
        middle_stages -= 1
    if middle_stages == 0:
        if middle_layers:
            return (
                f"first_stage_layers={first} + last_stage_layers={last} = {num_layers - middle_layers} differs from "
                f"num_hidden_layers={num_layers} at pp=2"
            )
        return None
    if middle_layers < middle_stages * chunks or middle_layers % (middle_stages * chunks):
        return (
            f"{num_layers} layers: after first_stage_layers={first} and last_stage_layers={last}, {middle_layers} "
            f"layers cannot be split evenly over {middle_stages} stage(s) x {chunks} model chunk(s); "
            f"set first_stage_layers/last_stage_layers so that they can"
        )
    return None


def default_stage_split(num_layers: int, pp: int, vpp: int | None) -> tuple[int | None, int | None]:
    """(first_stage_layers, last_stage_layers) when the user set neither: None, None where the layers split evenly,
    else the feasible uneven split with the smallest largest stage, giving the last stage (which also holds
    the output layer and the loss) the fewer layers on ties. Raises ValueError when no split exists."""
    chunks = vpp or 1
    if pp == 1 or stage_split_problem(num_layers, pp, vpp, None, None) is None:
        return None, None
    best = None
    for first in range(chunks, num_layers + 1, chunks):
        for last in range(chunks, num_layers - first + 1, chunks):
            if stage_split_problem(num_layers, pp, vpp, first, last) is not None:
                continue
            middle = (num_layers - first - last) // (pp - 2) if pp > 2 else 0
            key = (max(first, last, middle), last, -first)
            if best is None or key < best[0]:
                best = (key, first, last)
    if best is None:
        raise ValueError(
            f"num_hidden_layers={num_layers} cannot be split over pp={pp} stages with vpp={vpp}: every "
            f"stage needs at least {chunks} layer(s); lower pp or vpp"
        )
    return best[1], best[2]


def stage_split(cfg, num_layers: int, layout: ParallelLayout) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts: the config's, or default_stage_split's when it sets neither."""
    if cfg.first_stage_layers is None and cfg.last_stage_layers is None:
        return default_stage_split(num_layers, layout.pp, layout.vpp)
    return cfg.first_stage_layers, cfg.last_stage_layers


# ---- what a model and a layout must satisfy (the ranks check the same) ------------------------------------
