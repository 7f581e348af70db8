"""MoE routing replay (`router_replay: R2 | R3`) and the router consistency metrics, on megatron-core's own
replay support: every TopKRouter of a MoE model gets a `RouterReplay` (megatron-core's per-router object, which
its top-k routing consults), of a subclass that also keeps the live top-k of every forward.

- Replay (REPLAY_FORWARD) hands the router the recorded experts of each token: only the selection is replayed;
  megatron-core gathers the gate weights from the live logits at those experts, so router gradients flow.
- Keyed by micro-batch and model chunk, never by call order: before each chunk's forward of a micro-batch the
  schedule sets that (micro-batch, chunk)'s routes on the chunk's own routers, and a pre-hook on the chunk
  output's autograd node sets them again before that chunk's backward of that micro-batch, so an activation
  recompute under any pipeline schedule replays the same routes. (megatron-core's process-global instance list
  and its first-in-first-out backward list are not used: they key by creation and call order.)
- Routes are a per-token batch column [B, T, L, k] (keys.ROUTED_EXPERTS from the rollout, keys.RECORDED_ROUTES
  from the old-log-prob forward), cut into micro-batches through `MicroBatch.source` like the tokens, then for
  context parallelism by Megatron's own splitter and for sequence parallelism like the router's input.
- Recording (R2) reads each router's live top-k after the chunk's forward, gathers it over the sequence-parallel
  and context-parallel groups, puts it back at its tokens' places in the batch and joins the pipeline stages'
  layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from roll_backend import keys

REPLAY_MODES = ("R2", "R3")
ROUTE_DTYPE = torch.int16


def routes_problem(routes: torch.Tensor, attention_mask: torch.Tensor, num_layers: int, topk: int, num_experts: int):
    """What is wrong with a [B, T, L, k] routes column for a batch (None when nothing): the shape, and at every real
    token but each row's last (the rollout engine never forwards the last sampled token; its output feeds no
    loss), k distinct experts in [0, num_experts) at every layer. Names the first layer and position at fault."""
    expected = (*attention_mask.shape, num_layers, topk)
    if routes.dim() != 4 or tuple(routes.shape) != expected:
        return (
            f"routes have shape {list(routes.shape)}; this batch and model need [rows, tokens, layers, top_k] = "
            f"{list(expected)}"
        )
    needed = attention_mask.bool() & ~last_real_token(attention_mask)
    ids = routes.long()
    bad = ((ids < 0) | (ids >= num_experts)).any(-1)
    ordered = ids.sort(dim=-1).values
    bad |= (ordered[..., 1:] == ordered[..., :-1]).any(-1)
    bad &= needed[..., None]
    if not bad.any():
        return None
    row, position, layer = (int(i) for i in bad.nonzero()[0])
    what = ids[row, position, layer].tolist()
    reason = "missing" if any(e < 0 for e in what) else f"not {topk} distinct experts in [0, {num_experts})"
    return f"routes at layer {layer + 1}, row {row}, position {position}: {what} ({reason})"


def last_real_token(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] True at each row's last real token."""
    mask = attention_mask.bool()
    last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)
    out = torch.zeros_like(mask)
    out[torch.arange(len(mask)), last] = mask.any(1)
    return out


def replay_ready(routes: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The routes with -1 at every padding position (what a column holds there is not a route); the schedule lets
    experts 0..k-1 stand in wherever a route is -1 (padding, a row's last token: no loss sees their output) and
    leaves those positions out of the agreement."""
    return routes.masked_fill(~attention_mask.bool()[..., None, None], -1)


def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class KeyedRouterReplay(RouterReplay):
        """megatron-core's RouterReplay for one router, outside its process-global list (several models live in
        one process), keeping the live top-k of each forward (`live_topk`) whether it replays or not."""

        def __init__(self):  # noqa: D107  (RouterReplay.__init__ would join the global list)
            self.target_topk_idx = None
            self.recorded_topk_idx = None
            self.router_replay_action = None
            self.replay_backward_list = []
            self.live_topk = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.live_topk = live.detach()
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                replayed = self.target_topk_idx.to(scores.device)
                return scores.gather(1, replayed), replayed
            return probs, live

    return KeyedRouterReplay, RouterReplayAction


class RouteReplayer:
    """The routers of a model's chunks, by global layer number; replays, records and measures per (micro-batch,
    chunk). `begin` before Megatron's schedule, `before_chunk` / `after_chunk` around each chunk forward, all of it
    inside `active()`."""

    def __init__(self, chunks: list, num_layers: int, topk: int, device: str):
        from megatron.core.transformer.moe.router import TopKRouter

        from roll_backend.strategies.megatron.builder import unwrap

        replay_class, self.actions = _replay_class()
        self.num_layers, self.topk, self.device = num_layers, topk, device
        self.sequence_parallel = bool(unwrap(chunks[0]).config.sequence_parallel)
        self.routers: list[list[tuple[int, object]]] = []
        for chunk in chunks:
            found = []
            for module in unwrap(chunk).modules():
                if isinstance(module, TopKRouter):
                    if module.config.moe_router_fusion or module.routing_type == "sinkhorn":
                        raise ValueError("router_replay needs top-k routing without moe_router_fusion or sinkhorn")
                    module.router_replay = replay_class()
                    module.register_forward_hook(self._check_replayed)
                    found.append((module.layer_number, module.router_replay))
            self.routers.append(found)
        self.agreement = torch.zeros(2, num_layers, dtype=torch.float64, device=device)  # [agreeing, real] tokens
        self.replay_mismatches = torch.zeros(2, dtype=torch.float64, device=device)  # [mismatched, replayed] tokens
        self.begin(replay=False, record=False)

    def _check_replayed(self, router, args, output):
        """Replay on: the experts the router dispatched to are the replayed ones (a fused or sinkhorn path, or token
        dropping, would route otherwise without a word)."""
        replay = router.router_replay
        if replay.router_replay_action != self.actions.REPLAY_FORWARD:
            return
        routing_map = output[1]
        expected = torch.zeros_like(routing_map).scatter(1, replay.target_topk_idx.to(routing_map.device), True)
        self.replay_mismatches[0] += (routing_map != expected).any(-1).sum()
        self.replay_mismatches[1] += routing_map.shape[0]

    def begin(self, replay: bool, record: bool) -> None:
        """A new call: what it does, and none of the last call's routes."""
        self.replay, self.record = replay, record
        self.targets: dict[tuple[int, int], torch.Tensor] = {}
        self.compare: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.recorded: dict[int, dict[int, torch.Tensor]] = {}

    # ---- per call ------------------------------------------------------------------------------------------
    def before_chunk(self, chunk_index: int, micro_index: int, routes) -> None:
        """routes: this micro-batch's [b, T_cp, L, k] after the CP cut, -1 where none is known (None: nothing to
        replay or compare)."""
        if routes is None:
            self.set_targets(chunk_index, None)
            return
        routes = _sequence_parallel_cut(routes, self.sequence_parallel)
        filler = torch.arange(self.topk, device=routes.device)
        per_layer, known = {}, {}
        for layer, _ in self.routers[chunk_index]:
            layer_routes = routes[:, :, layer - 1].reshape(-1, self.topk).long()  # (s, b) token order
            known[layer] = (layer_routes >= 0).all(-1)
            per_layer[layer] = torch.where(known[layer][:, None], layer_routes, filler)
        self.compare[(chunk_index, micro_index)] = per_layer, known
        if self.replay:
            self.targets[(chunk_index, micro_index)] = per_layer
            self.set_targets(chunk_index, per_layer)
        else:
            self.set_targets(chunk_index, None)

    def set_targets(self, chunk_index: int, per_layer: dict | None) -> None:
        for layer, replay in self.routers[chunk_index]:
            replay.clear_indices()
            if per_layer is None:
                replay.clear_router_replay_action()
                continue
            replay.set_target_indices(per_layer[layer])
            replay.set_router_replay_action(self.actions.REPLAY_FORWARD)

    def after_chunk(self, chunk_index: int, micro_index: int, output: torch.Tensor):
        """Measure (and record) what the chunk's routers chose; returns the output, wired to set the routes again
        before its backward when replaying."""
        compared = self.compare.pop((chunk_index, micro_index), None)
        for layer, replay in self.routers[chunk_index]:
            live, replay.live_topk = replay.live_topk, None
            if live is None:
                raise RuntimeError(f"the router of layer {layer} did not run in this micro-batch's forward")
            if compared is not None:
                targets, known = compared
                real = known[layer]
                if live.shape != targets[layer].shape:
                    raise RuntimeError(
                        f"layer {layer}: routes for {targets[layer].shape[0]} tokens, the router routed {live.shape[0]}"
                    )
                same = _same_sets(live, targets[layer]) & real.to(live.device)
                self.agreement[0, layer - 1] += same.sum()
                self.agreement[1, layer - 1] += real.sum()
            if self.record:
                self.recorded.setdefault(micro_index, {})[layer] = live.to(ROUTE_DTYPE)
        if self.replay and compared is not None and output.grad_fn is not None:
            # Runs before the chunk's backward of this micro-batch, so before any recompute of its layers.
            targets = self.targets[(chunk_index, micro_index)]
            output.grad_fn.register_prehook(lambda grads: self.set_targets(chunk_index, targets))
        return output

    @contextlib.contextmanager
    def active(self):
        """Routers route live again after the call (a later forward of another kind must not replay)."""
        try:
            yield
        finally:
            for chunk_index in range(len(self.routers)):
                self.set_targets(chunk_index, None)

    # ---- recording (R2) ------------------------------------------------------------------------------------
    def recorded_micro_routes(self, micro_index: int, shape: tuple[int, int]):
        """[b, T, L, k] the live routes this rank's stage recorded for a micro-batch of `shape` (b, T), gathered over
        the sequence-parallel and context-parallel groups; -1 at layers of other stages."""
        from roll_backend.strategies.megatron import cp

        b, total = shape
        out = torch.full((b, total, self.num_layers, self.topk), -1, dtype=ROUTE_DTYPE)
        for layer, routes in sorted(self.recorded.get(micro_index, {}).items()):
            local = routes.view(-1, b, self.topk)  # [s_local, b, k]
            if self.sequence_parallel:
                local = _gather_sequence_parallel(local)
            full = cp.gather_sequence(local.int(), dim=0)  # [T, b, k] token order
            out[:, :, layer - 1] = full.transpose(0, 1).to(ROUTE_DTYPE).cpu()
        return out

    # ---- metrics --------------------------------------------------------------------------------------------
    def pop_metrics(self, prefix: str = "moe/") -> dict[str, float]:
        """Agreement of the live top-k with the routes compared against (replayed or the rollout's), per layer and
        over layers, summed over every rank (each token is routed by one rank per layer); resets. Every rank calls."""
        dist.all_reduce(self.agreement)
        dist.all_reduce(self.replay_mismatches)
        agreeing, real = self.agreement
        metrics = {}
        if float(self.replay_mismatches[1]) > 0:
            metrics[f"{prefix}replay_mismatched_tokens"] = float(self.replay_mismatches[0])
        if float(real.sum()) > 0:
            per_layer = agreeing / real.clamp(min=1)
            metrics[f"{prefix}route_agreement"] = float(agreeing.sum() / real.sum())
            metrics[f"{prefix}route_agreement_min"] = float(per_layer[real > 0].min())
            for layer in torch.nonzero(real > 0).flatten().tolist():
                metrics[f"{prefix}route_agreement_layer{layer + 1}"] = float(per_layer[layer])
        self.agreement.zero_()
        self.replay_mismatches.zero_()
        return metrics


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n] True where rows of two [n, k] index tensors hold the same experts in any order."""
    return (a.sort(dim=-1).values == b.to(a.device).sort(dim=-1).values).all(-1)


def _sequence_parallel_cut(tensor: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[b, s, ...] -> this TP rank's [s/TP, b, ...] (the router's input rows); [s, b, ...] without SP."""
    tensor = tensor.transpose(0, 1).contiguous()
    if not sequence_parallel:
        return tensor
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(tensor)


def _gather_sequence_parallel(local: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local.int()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.int().contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _any_rank(flag: bool, device: str) -> bool:
    """True on every rank when it is True on any rank of the strategy's world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def join_stages(routes: torch.Tensor, device: str) -> torch.Tensor:
    """Every pipeline stage holds its own layers' routes (-1 elsewhere): the max over the PP group joins them."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return routes
    joined = routes.to(device=device, dtype=torch.int32)
    dist.all_reduce(joined, op=dist.ReduceOp.MAX, group=mpu.get_pipeline_model_parallel_group())
    return joined.to(ROUTE_DTYPE).cpu()


@dataclass
class RouteCall:
    """What one forward call of a MoE strategy does with routes: the batch's routes ([B, T, L, k], ready for a
    router) compared with the live top-k and, with `replay`, replayed; with `record`, the live ones returned."""

    replayer: RouteReplayer
    routes: torch.Tensor | None
    replay: bool
    record: bool


def route_call(strategy, batch, training: bool) -> RouteCall | None:
    """The strategy's routes plan for a forward (log-probs) or training call on `batch`; None for a dense model.

    R3 replays the rollout's routes (keys.ROUTED_EXPERTS) in every forward; R2 records in the log-prob forward
    (returned as keys.RECORDED_ROUTES) and replays them in training, when the batch carries them (a step without an
    old-log-prob pass has one forward: nothing to replay). Without replay, the rollout's routes, when the batch
    has them, are compared with the live ones (the moe/route_agreement metrics). meta_info[META_LIVE_ROUTES]
    routes live whatever the mode (the weight-sync probe compares the engine's live routing with the trainer's)."""
    replayer = getattr(strategy, "route_replayer", None)
    if replayer is None:
        return None
    mode = None if batch.meta_info.get(keys.META_LIVE_ROUTES) else strategy.config.router_replay
    present = set(batch.batch.keys())
    if mode == "R3" and keys.ROUTED_EXPERTS not in present:
        raise ValueError(
            f"router_replay=R3 replays the rollout's routes, and this batch has no {keys.ROUTED_EXPERTS!r} column "
            "(the rollout records them for MoE models); set router_replay=R2 or null, or pass the column"
        )
    replayed = {"R3": keys.ROUTED_EXPERTS, "R2": keys.RECORDED_ROUTES if training else None}.get(mode)
    moe, attention = strategy.arch.moe, batch.batch[keys.ATTENTION_MASK]
    replay, routes = replayed in present, None
    if replay:
        column = replayed
        problem = routes_problem(batch.batch[column], attention, strategy.arch.num_layers, moe.topk, moe.num_experts)
        if _any_rank(problem is not None, strategy.device):  # every rank raises: none waits in the schedule
            where = problem or "another data-parallel rank's rows have bad routes"
            raise ValueError(f"router_replay={mode}: batch column {column!r}: {where}")
        routes = replay_ready(batch.batch[column], attention)
    elif keys.ROUTED_EXPERTS in present:  # compared only: another model's routes (another shape) are left out
        rollout = batch.batch[keys.ROUTED_EXPERTS]
        if tuple(rollout.shape) == (*attention.shape, strategy.arch.num_layers, moe.topk):
            routes = replay_ready(rollout, attention)
    return RouteCall(replayer, routes, replay=replay, record=mode == "R2" and not training)
