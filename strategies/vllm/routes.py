"""The experts a vLLM rollout routed each token to (MoE routing replay R3, `return_routed_experts`).

vLLM's own capture (`enable_return_routed_experts`) needs Model Runner V2, which needs Triton: the CPU build
refuses it. This capture uses the same hook (`BaseRouter.set_capture_fn`, which vLLM's RoutedExpertsCapturer
binds) on the V1 runner: each MoE layer's top-k ids of an engine step arrive as [tokens, k] rows, laid out
request by request in the runner's batch order (`input_batch.req_ids`, `query_start_loc`), starting at each
request's `num_computed_tokens` position. Rows go to each request's own array by position, so a preempted and
recomputed request, or one recomputed after a weight update, holds the routes of its last forward.

Tokens the engine never forwards have no route: the last sampled token of every sample, and prompt tokens read
from the prefix cache. A call's samples share their prompts' routes (the sibling that computed a cached block
gives its rows); each call salts its prompts' cache keys so no block computed by an earlier call (older weights)
is reused unrouted.
"""

from __future__ import annotations

import numpy as np
import torch

ROUTE_DTYPE = np.int16


class RouteCapture:
    """In a vLLM worker: every MoE router's capture callback, and the routes per (internal) request id."""

    def __init__(self, model_runner, model):
        self.runner = model_runner
        self.num_layers = int(model_runner.model_config.hf_config.num_hidden_layers)
        self.topk = int(model_runner.model_config.hf_config.num_experts_per_tok)
        self.routes: dict[str, np.ndarray] = {}
        self.lengths: dict[str, int] = {}
        self._step = None
        self.bind(model)

    def bind(self, model) -> None:
        """Set the capture callback on every MoE router of `model` (again after a weight reload)."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("return_routed_experts: the rollout's model has no MoE layers")
        self.layers = sorted({runner.layer_id for runner in runners})
        for runner in runners:
            runner.router.set_capture_fn(lambda ids, layer=runner.layer_id: self.capture(layer, ids))

    def _step_layout(self, rows: int):
        """(req ids, row starts, row counts, first positions) of the step being forwarded; None for a dummy run."""
        batch = self.runner.input_batch
        count = batch.num_reqs
        starts = self.runner.query_start_loc.np[: count + 1].astype(np.int64)
        if count == 0 or starts[-1] > rows:
            return None
        computed = batch.num_computed_tokens_cpu[:count].astype(np.int64)
        return list(batch.req_ids[:count]), starts[:-1], np.diff(starts), computed

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if layer == self.layers[0]:
            self._step = self._step_layout(topk_ids.shape[0])
        if self._step is None:
            return
        ids = topk_ids.detach().to("cpu", torch.int16).numpy()
        for req_id, start, count, first in zip(*self._step):
            routes = self._routes_for(req_id, first + count)
            routes[first : first + count, layer] = ids[start : start + count]
            self.lengths[req_id] = max(self.lengths.get(req_id, 0), first + count)

    def _routes_for(self, req_id: str, length: int) -> np.ndarray:
        routes = self.routes.get(req_id)
        if routes is None or routes.shape[0] < length:
            grown = np.full(
                (max(length, 2 * (0 if routes is None else routes.shape[0]), 64), self.num_layers, self.topk),
                -1,
                ROUTE_DTYPE,
            )
            if routes is not None:
                grown[: routes.shape[0]] = routes
            self.routes[req_id] = routes = grown
        return routes

    def take(self) -> dict[str, np.ndarray]:
        """{external request id: [positions forwarded, L, k]} of every request seen since the last take (vLLM's
        internal ids are the external ones with '-' and 8 random characters appended)."""
        taken = {req_id.rsplit("-", 1)[0]: routes[: self.lengths[req_id]] for req_id, routes in self.routes.items()}
        self.routes, self.lengths = {}, {}
        return taken


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """The engine request id of each of a prompt's n samples (vLLM's parallel sampling names children index_parent)."""
    return [request_id] if n == 1 else [f"{index}_{request_id}" for index in range(n)]


def routes_column(
    prompt_ids: list[list[int]],
    sample_ids: list[list[int]],
    sample_routes: list[np.ndarray | None],
    n: int,
    prompt_width: int,
    response_width: int,
    num_layers: int,
    topk: int,
) -> torch.Tensor:
    """keys.ROUTED_EXPERTS [B*n, T, L, k] in the rollout batch's layout (left-padded prompt, right-padded response),
    -1 where a token has no route. Prompt rows a sample did not forward (read from the prefix cache) come from a
    sample of the same call with the same tokens that did."""
    total = prompt_width + response_width
    column = np.full((len(sample_ids), total, num_layers, topk), -1, ROUTE_DTYPE)
    sequences = [prompt_ids[row // n] + list(tokens) for row, tokens in enumerate(sample_ids)]
    filled = []
    for row, routes in enumerate(sample_routes):
        full = np.full((len(sequences[row]), num_layers, topk), -1, ROUTE_DTYPE)
        if routes is not None:
            length = min(len(routes), len(full))
            full[:length] = routes[:length]
        filled.append(full)
    for row, full in enumerate(filled):
        missing = np.flatnonzero((full < 0).all(axis=(1, 2))[:-1])  # (the last token is never forwarded)
        if len(missing):
            _fill_from_same_tokens(row, int(missing.max()) + 1, sequences, filled)
    for row, full in enumerate(filled):
        prompt = len(prompt_ids[row // n])
        column[row, prompt_width - prompt : prompt_width] = full[:prompt]
        response = min(len(full) - prompt, response_width)
        column[row, prompt_width : prompt_width + response] = full[prompt : prompt + response]
    return torch.from_numpy(column)


def _fill_from_same_tokens(row: int, length: int, sequences: list[list[int]], filled: list[np.ndarray]) -> None:
    """Rows [0, length) of sample `row` from another sample whose first `length` tokens are the same and routed."""
    prefix = sequences[row][:length]
    for other, full in enumerate(filled):
        if other != row and len(full) > length and sequences[other][:length] == prefix:
            if (full[:length] >= 0).all():
                missing = (filled[row][:length] < 0).all(axis=(1, 2))
                filled[row][:length][missing] = full[:length][missing]
                return
