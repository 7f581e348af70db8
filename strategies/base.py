"""The interfaces roles program against: `InferStrategy` (forward only), `TrainStrategy` (updates weights) and
`RolloutStrategy` (generates), plus what every strategy config answers (`StrategyConfig`, `RunFacts`).

Infer and train are separate on purpose: a train strategy also computes log-probs, but it is not an infer
strategy; implementations share code through helper functions (see `megatron/schedule.py`), not inheritance.
Every method runs on every rank of the role; results are meaningful on the ranks the dispatch collects
(tp0/cp0/last pipeline stage) and `None` elsewhere.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from roll_backend.distributed.layout import ParallelLayout

if TYPE_CHECKING:  # (annotations only: the config layer reads RunFacts and StrategyConfig before torch is imported)
    import torch

    from roll_backend.protocol import DataProto

# loss_fn(per_token, micro_batch) -> (loss, metrics). `per_token` holds [B_mb, T_resp] tensors (keys.LOG_PROBS,
# keys.ENTROPY or keys.VALUES) that carry gradients; micro_batch.meta_info[keys.META_GLOBAL_TOKEN_COUNT] is the
# number of loss tokens in the whole DP mini-batch, and the loss must be normalised by it (its sum over
# micro-batches and DP ranks is the step's loss). So must every metric: each is the micro-batch's share of the
# step's value (algorithms.token_mean_share turns a masked mean into one), and the strategy reports their sums,
# which do not depend on the micro-batch split or the layout.
LossFn = Callable[[dict[str, "torch.Tensor"], "DataProto"], tuple["torch.Tensor", dict[str, "float | torch.Tensor"]]]


@dataclass(frozen=True)
class RunFacts:
    """What the run decides for one role's strategy, in backend-neutral terms.

    Built by the config layer (`roll_backend.config.validate.run_facts`); a strategy config checks itself
    against it (`problems`) before Ray starts and takes the run's settings from it (`for_run`).
    """

    role: str  # the role's name (roll_backend.roles); problems name their keys under it
    layout: ParallelLayout = ParallelLayout()  # the role's tp, pp, cp, vpp, ep, etp
    world_size: int = 1  # ranks of the role
    device: str = "cpu"  # "cuda" where the role's ranks take GPUs
    samples_per_prompt: int = 1  # responses generated per prompt (num_return_sequences_in_group)
    max_prompt_length: int | None = None  # the longest prompt in tokens (data.max_prompt_length); None: unknown
    response_length: int = 1  # the most tokens a response may have
    train_batch_size: int | None = None  # responses per optimizer step where the run trains the role, else None
    optimizer_steps: int | None = None  # optimizer steps over the whole run where it trains the role, else None
    saves_checkpoints: bool = False  # the run checkpoints this role's training state
    value_head: bool = False  # the role scores values (the critic): its model ends in a value head
    score_head: bool = False  # the model folder is a trained reward model: the value head loads its score head
    model_config: Mapping[str, Any] | None = None  # the model's Hugging Face config fields; None: unknown
    multi_turn: bool = False  # the rollout runs multi-turn trajectories (agentic): requests arrive one turn at a time
    routed_experts: bool = False  # the rollout returns each token's routed experts (the actor replays them: R3)
    adapter_rank: int | None = None  # the rollout receives LoRA adapters of this rank (lora.sync: adapter), not weights
    exports_adapters: bool = False  # the run writes the role's LoRA adapters as a PEFT folder at its end
    hybrid: bool = False  # the role runs in actor_train's processes (the hybrid engine), handing the device over
    device_memory: int | None = None  # bytes of each device the run declares (device_memory_gib), None: not declared
    # Bytes of the buckets in which the role's ranks send their weights to a rollout engine (weight_sync_bucket_bytes;
    # None: the role sends none), and whether the minimal sync compares them with the engine's copy (weight_sync_delta)
    weight_sync_bucket: int | None = None
    weight_sync_delta: bool = False
    # Which of the role's ranks keep a host copy of the whole model for the weight sync ("rank 0", "every rank"; a
    # minimal or hybrid all-or-nothing sync), None: none (host memory, outside the device plan: said in a note).
    host_weight_copy: str | None = None
    # A MoE model's experts under EP are planned at this many times the tokens a rank's own tokens route (1.0: balanced
    # routing; memory_plan_expert_load)
    expert_load: float = 1.0


def size(nbytes: int) -> str:
    """Bytes in GiB, or MiB / KiB below one GiB (tiny CPU models)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def host_weight_copy_note(run: RunFacts, nbytes: int) -> str | None:
    """A memory plan's note on the weight sync's host copy (`run.host_weight_copy`) of `nbytes`; None without one."""
    if not run.host_weight_copy:
        return None
    return (
        f"host memory: {run.host_weight_copy} keeps a copy of the model's weights for the weight sync, "
        f"{size(nbytes)} (weight_sync_delta: false keeps none)"
    )


@dataclass(frozen=True)
class RankMemory:
    """The memory plan of some ranks of a role (`ranks` says which: "every rank", "pp stage 1 of 2"), in bytes per
    device: the model state it holds between calls by part, and each phase's peak on top of it by term."""

    ranks: str
    state: Mapping[str, int]  # "params", "grads", "optimizer" (a rollout engine: "weights")
    phases: Mapping[str, Mapping[str, int]]  # "train", "forward", "generate" -> term -> bytes
    offloaded: frozenset[str] = frozenset()  # state parts that wait in host memory while another role has the device
    # A rollout engine that takes a fixed share of the device whatever its terms (vLLM's gpu_memory_utilization)
    reserved: int | None = None
    hints: Mapping[str, str] = field(default_factory=dict)  # term or part -> the settings that shrink it
    notes: tuple[str, ...] = ()  # what the plan assumed or could not know

    def phase_peak(self, phase: str) -> int:
        """The device bytes of this rank during `phase`: the engine's reservation, or its state plus the phase's
        terms."""
        if self.reserved is not None:
            return self.reserved
        return sum(self.state.values()) + sum(self.phases.get(phase, {}).values())

    def resident(self, offloading: bool) -> int:
        """What stays on the device while another role runs: the state less the parts it offloads (`offloading`:
        the role hands the device over, as a hybrid role does)."""
        if self.reserved is not None and not offloading:
            return self.reserved
        kept = {part: size for part, size in self.state.items() if not (offloading and part in self.offloaded)}
        return sum(kept.values())


class MemoryPlanner(Protocol):
    """A strategy's memory planner (strategies.registry.STRATEGY_MEMORY: a module with these functions), before
    anything starts and beside what its ranks measure."""

    def plan(self, cfg: StrategyConfig, run: RunFacts) -> list[RankMemory]:
        """What each kind of rank of the role will hold on its device in this run ([] when the model's config is not
        known)."""

    def planned_at(self, cfg: StrategyConfig, run: RunFacts, measured: Mapping[str, Any]) -> dict[str, int]:
        """The plan of the rank that reported `measured` (InferStrategy.measured_memory) at the micro-batches that
        ran: {"model_state": bytes, <phase>: bytes on top}; {} for a strategy that does not measure."""

    def problems(self, cfg: StrategyConfig, run: RunFacts, planned: list[RankMemory]) -> list[str]:
        """What in the plan keeps the role from starting on its device (e.g. a KV cache that holds no sequence)."""


class StrategyConfig(Protocol):
    """What every strategy's typed config answers, whatever its backend."""

    model_path: str

    def problems(self, run: RunFacts) -> list[str]:
        """Every problem this config has in this run (empty when it can run), each naming the key and the fix."""

    def for_run(self, run: RunFacts) -> StrategyConfig:
        """This config with what the run decides (e.g. samples per prompt, response length, the training horizon)."""


class Strategy:
    """What every interface below shares: the context a rank enters around each call into the strategy."""

    @classmethod
    def call_context(cls, device: str) -> contextlib.AbstractContextManager:
        """What a rank enters around each call into this strategy on `device` (nothing by default)."""
        return contextlib.nullcontext()

    def measured_memory(self) -> dict[str, Any]:
        """This rank's measured memory (see InferStrategy.measured_memory); nothing for a strategy that does not
        measure."""
        return {"model_state": {}, "phases": {}, "micro_batches": {}}


class InferStrategy(Strategy):
    """A forward-only backend for one rank of a role."""

    @abc.abstractmethod
    def initialize(self) -> None:
        """Build the model and load its weights (a training backend also its optimizer and scheduler); called once
        after the rank joined its process groups."""

    @abc.abstractmethod
    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        """Per-token log-probs (and entropy if configured) of `batch`'s responses under the current weights:
        keys.LOG_PROBS [B, T_resp] (a trainer's old_log_probs before an update)."""

    @abc.abstractmethod
    def compute_values(self, batch: DataProto) -> DataProto | None:
        """Critic values of `batch`'s responses under the current weights: keys.VALUES [B, T_resp]."""

    # ---- device hand-over (the hybrid engine: workers/hybrid.py) --------------------------------------------
    @property
    def offloaded_parts(self) -> frozenset[str]:
        """The model-state parts its config moves to host memory while another model holds the device (none by
        default)."""
        return frozenset()

    def move_model_state(self, parts: frozenset[str], to_host: bool) -> int:
        """Move the named parts of this rank's model state ("params", "grads", "optimizer") to host memory
        (`to_host`) or back to the device, in place (the model keeps its tensors' identity); returns the bytes moved:
        0 where the device is the host. A part already where it is asked to be, or that the strategy does not hold
        (a forward-only model has no gradients), is left alone."""
        raise NotImplementedError(f"{type(self).__name__} cannot hand its device over")

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's model state on the device now, by part ("params", "grads", "optimizer")."""
        raise NotImplementedError(f"{type(self).__name__} does not account its memory")

    def measured_memory(self) -> dict[str, Any]:
        """This rank's measured memory: "model_state" (model_state_bytes), "phases" (the most bytes each phase,
        "train" or "forward", allocated on top of it over the calls that measured: every call on a GPU, on a CPU
        those whose batch set keys.META_MEASURE_MEMORY) and "micro_batches" (per phase, the call that set the peak:
        {"micro_batches": each distinct micro-batch's [rows, width, response width, sequences whose responses it
        holds (more than its rows when packed), response positions gathered], "count": its micro-batch count})."""
        return {"model_state": self.model_state_bytes(), "phases": {}, "micro_batches": {}}


class TrainStrategy(InferStrategy):
    """A training backend for one rank of a role: everything a forward-only one does, and backward, optimizer
    step, checkpoints, weight export."""

    @abc.abstractmethod
    def train_step(self, batch: DataProto, loss_fn: LossFn) -> dict[str, float] | None:
        """One optimizer step over `batch` (split into micro-batches); returns reduced metrics."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler and RNG state, loadable at another parallel layout."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote."""

    @abc.abstractmethod
    def export_hf(self, out_dir: str, max_shard_bytes: int = 5 << 30) -> Any:
        """Write a Hugging Face checkpoint (safetensors in shards of at most `max_shard_bytes`, written as gathered;
        config; tokenizer) that transformers and vLLM load; a value-head model as *ForSequenceClassification."""

    @abc.abstractmethod
    def iter_hf_weights(
        self, bucket_bytes: int, measure_memory: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of at most `bucket_bytes` (a bigger tensor gets its own bucket). A bucket
        is the consumer's until it asks for the next one (its list may then be emptied): use or copy its tensors
        before. What making the buckets allocates on the device counts as the weight_sync phase in measured_memory
        (on a CPU rank only with `measure_memory`; the consumer's own work between buckets is not counted there)."""

    @abc.abstractmethod
    def parameter_counts(self) -> dict[str, int]:
        """{"parameters": the model's, "trainable_parameters": those the optimizer updates}, each counted once over
        every parallel split (the same on every rank)."""

    @abc.abstractmethod
    def param_grad_norms(self, prefix: str = "") -> dict[str, float]:
        """This rank's per-parameter gradient norms after the last train step, for names starting with `prefix`."""

    # ---- LoRA adapters (backends without adapters keep these defaults) --------------------------------------
    def adapter_tensors(self, what: str = "adapter_tensors") -> dict[str, torch.Tensor] | None:
        """The adapters' full tensors by PEFT name (every rank joins the gathers; rank 0 gets them, others None).
        `what` names the caller in the error a backend without adapters raises."""
        raise NotImplementedError(f"{type(self).__name__} trains no adapters: {what} needs lora")

    def peft_config(self) -> Any:
        """The adapters' peft.LoraConfig (target modules, rank, alpha) for an engine that serves them."""
        raise NotImplementedError(f"{type(self).__name__} trains no adapters")

    def export_peft(self, out_dir: str) -> list[str] | None:
        """The adapters as a PEFT folder in `out_dir`; the tensor names written (None on ranks that did not write)."""
        raise NotImplementedError(f"{type(self).__name__} trains no adapters")


class RolloutStrategy(Strategy):
    """A generation backend for one rank of the rollout role: sample responses, take new weights, probe log-probs."""

    tokenizer: Any  # the model's Hugging Face tokenizer (chat template included), set by `initialize`

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """The longest prompt + response the engine holds."""

    @property
    @abc.abstractmethod
    def max_prompt_length(self) -> int | None:
        """The prompt width rollout rows share (None: each call's longest prompt)."""

    @abc.abstractmethod
    def sampling_for(self, meta_info: Mapping[str, Any]) -> Any:
        """The sampling settings of a call (the config's, with a batch's meta_info overrides): an object with at
        least `n`, `max_tokens` and `temperature`."""

    @abc.abstractmethod
    def initialize(self) -> None:
        """Start the engine; called once the rank has joined its process group."""

    def shutdown(self) -> bool:
        """Stop the engine and leave what it built in this process (its process groups, its memory), so that the
        process can start another (distributed/rank_pool.py); False where an engine cannot be stopped in place."""
        return False

    @abc.abstractmethod
    def generate(self, batch: DataProto) -> DataProto:
        """Prompts [B] -> rollout batch [B*n] (responses, masks, sampling log-probs)."""

    @abc.abstractmethod
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        in_flight: str | None = None,
    ) -> int:
        """Load HF-named tensors into the engine in place; returns how many it loaded. `version`: the trainer version
        they are; `in_flight`: what happens to streaming requests in flight (keep | recompute | resubmit)."""

    def load_weight_deltas(
        self,
        buckets: Iterable[Any],
        version: int | None = None,
        in_flight: str | None = None,
        after_bucket: Callable[[], None] | None = None,
        all_loaded: Callable[[bool], bool] | None = None,
    ) -> dict[str, int]:
        """A minimal weight sync, all or nothing: roll_backend.protocol.weight_delta.WeightDeltaBucket's relative to
        `weights_version`; the engine serves its version until every bucket landed and was checked, and a load that
        fails part-way leaves it on that version. `after_bucket()` runs after each bucket loaded (fault injection);
        `all_loaded(loaded_here)` (a collective) says whether every rank loaded: if one did not, all undo theirs.
        Returns counts: "bytes" received, "full_bytes" (a full sync's), "tensors" sent, "unchanged", "loaded"."""
        raise NotImplementedError(f"{type(self).__name__} takes whole weights only (update_weights)")

    def load_changed_weights(
        self,
        buckets: Iterable[list[tuple[str, torch.Tensor]]],
        version: int | None = None,
        whole: bool = False,
        on_bucket: Callable[[Any], None] | None = None,
        after_bucket: Callable[[], None] | None = None,
        all_loaded: Callable[[bool], bool] | None = None,
    ) -> dict[str, int]:
        """A sync from a trainer in the engine's own process (the hybrid engine): buckets of HF-named tensors, each
        compared with the engine's host copy of what it serves (every tensor counts as changed when `whole`), then
        the changed ones loaded all or nothing as `load_weight_deltas` loads, so that `revert_weights` can undo it.
        `on_bucket(bucket)` sees each compared WeightDeltaBucket before anything loads (fault injection);
        `all_loaded(loaded_here)` (a collective) says whether every rank loaded its part: if one did not, every rank
        undoes its load. Returns load_weight_deltas's counts."""
        raise NotImplementedError(f"{type(self).__name__} takes whole weights only (update_weights)")

    def revert_weights(self) -> int | None:
        """Undo the last minimal sync (load_weight_deltas) whose probe failed: the engine serves the version it served
        before, bit for bit; returns that version. Raises when there is nothing to undo."""
        raise NotImplementedError(f"{type(self).__name__} cannot undo a weight sync")

    @property
    def weights_version(self) -> int | None:
        """The version a minimal sync may be relative to (None: the next sync must send whole tensors)."""
        return None

    def weights_digest(self) -> str:
        """A digest of the engine's weights (equal digests: bit-for-bit equal weights)."""
        raise NotImplementedError(f"{type(self).__name__} has no weights digest")

    @abc.abstractmethod
    def probe_log_probs(self, batch: DataProto) -> torch.Tensor:
        """The engine's log-probs of fixed responses given their prompts: [B, T_resp] float32."""

    def sleep(self) -> bool:
        """Give the device up until `wake_up` (the hybrid engine, while the trainer runs), as the config says (vLLM:
        level 1 keeps the weights in host memory and frees the KV cache, level 2 discards the weights too). Returns
        whether the weights survive (False: the next weight sync must refill them before anything generates)."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Take the device back after `sleep`: `tags` ("weights", "kv_cache") wakes those parts only (a weight sync
        wakes the weights, loads, then the KV cache); None wakes everything."""
        raise NotImplementedError(f"{type(self).__name__} cannot sleep")

    def load_adapter(
        self,
        tensors: dict[str, torch.Tensor],
        peft_config: Any,
        version: int | None = None,
        in_flight: str | None = None,
    ) -> int:
        """Serve these LoRA adapters (PEFT-named tensors and their peft.LoraConfig) from now on, in place of the last
        ones; returns how many tensors were loaded. `version` and `in_flight` as for `update_weights`."""
        raise NotImplementedError(f"{type(self).__name__} does not serve adapters")

    # ---- streaming (async_generation.mode: streaming): requests stay on the engine across calls ----------------
    def stream_admit(self, prompts: DataProto) -> None:
        """Start n samples per prompt row; `stream_run` returns them by group once all n finished."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def stream_run(self, max_steps: int) -> tuple[DataProto | None, bool, dict[str, float]]:
        """Up to `max_steps` engine steps: (the groups that finished, in rollout layout with each token's weight
        version, or None; whether requests remain; counters since the last call or `stream_stats`)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def stream_stats(self) -> dict[str, float]:
        """The streaming counters since the last call (engine steps, requests resumed across an update, ...)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    # ---- one request at a time (multi-turn rollouts: roll_backend.agentic drives these) -------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        seed: int | None,
        meta_info=None,
        updates_possible: bool = True,
        session: str | None = None,
    ) -> None:
        """Queue one sample of `max_tokens` at most, continuing `prompt_ids`, with the call's sampling settings
        (`meta_info` as given to `generate`). `updates_possible=False` promises that no weight update comes before
        it finishes (a generate call's turns): the engine may then skip keeping its partial state. Requests naming
        the same `session` (one trajectory's turns, each extending the last one's prompt and reply) may keep their
        KV cache between them until `end_session`; the sampled tokens are the engine's either way."""
        raise NotImplementedError(f"{type(self).__name__} does not take single requests")

    def end_session(self, session: str) -> None:
        """The trajectory of `session` ended: release what the engine kept for it (nothing, by default)."""

    def step(self) -> list[FinishedRequest]:
        """Advance the engine by one scheduling step; the requests that finished in it."""
        raise NotImplementedError(f"{type(self).__name__} does not take single requests")

    def has_unfinished_requests(self) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not take single requests")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not take single requests")


@dataclass(frozen=True)
class FinishedRequest:
    """A request `RolloutStrategy.step` finished: its sampled ids, their log-probs, why it stopped."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" (an end token) or "length" (max_tokens)
    versions: list[int] | None = None  # each token's weight version (trainer updates applied), where known
    computed_prompt_tokens: int | None = None  # prompt tokens the engine computed for it (not from its cache)
