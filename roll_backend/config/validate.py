"""Cross-field rules of a run config, checked before any actor starts. Each problem says what to change."""

from __future__ import annotations

import math
from pathlib import Path

from roll_backend import roles
from roll_backend.config.algorithm_rules import algorithm_problems, group_problems
from roll_backend.config.guard_rules import guard_problems
from roll_backend.config.hybrid_rules import hybrid_problems
from roll_backend.config.model_folders import TOKENIZER_FILES, describes_only
from roll_backend.config.reward_rules import reward_problems
from roll_backend.config.run_facts import replays_rollout_routes, run_facts
from roll_backend.config.run_memory import memory_problems
from roll_backend.config.schema import (
    ASYNC_MODES,
    DISTILL_MODES,
    LOGGER_NAMES,
    OFFLINE_PIPELINES,
    RL_PIPELINES,
    WANDB_MODES,
    PipelineConfig,
    RoleConfig,
)
from roll_backend.strategies.vllm.config import PARTIAL_ROLLOUT_MODES, sampling_range_problems

PIPELINES = RL_PIPELINES + OFFLINE_PIPELINES
# The roles each offline pipeline starts; the others' blocks must be left out (they would hold resources unused).
OFFLINE_ROLES = {
    "sft": (roles.ACTOR_TRAIN,),
    "reward_model": (roles.ACTOR_TRAIN,),
    "dpo": (roles.ACTOR_TRAIN, roles.REFERENCE),
}


def _check_model_path(
    config: PipelineConfig, what: str, model_path: str, problems: list[str], recipe_check: bool = False
) -> None:
    """`model_path` must be a local folder with a model config and a tokenizer, unless build_tiny_model writes it
    (or, in a recipe check, the folder holds only config.json: model_folders.describes_only)."""
    if not model_path or (config.build_tiny_model is not None and model_path == config.model_path):
        return  # empty: the strategies' own checks say so
    folder = Path(model_path)
    tiny_hint = " (or set build_tiny_model to write a tiny random model there)" if what == "model_path" else ""
    if folder.is_file():
        problems.append(
            f"{what}={model_path!r} is a file; point it at the folder that holds the model (config.json, "
            "weights, tokenizer)"
        )
        return
    if not folder.is_dir():
        problems.append(
            f"{what}={model_path!r} does not exist; point it at a local Hugging Face model folder (config.json, "
            f"weights, tokenizer): download one first, e.g. `huggingface-cli download NAME --local-dir DIR`{tiny_hint}"
        )
        return
    if not (folder / "config.json").is_file():
        problems.append(f"{what}={model_path!r} has no config.json; point it at a Hugging Face model folder")
    if recipe_check and describes_only(model_path):
        return  # the tokenizer and weights are where the run will be (model_folders.skipped_checks says so)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"{what}={model_path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the model's "
            "tokenizer there (tokenizer.save_pretrained)"
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_role(config: PipelineConfig, name: str, role: RoleConfig, problems: list[str]) -> None:
    """The layout against the role's ranks and model (any backend), then the strategy's own rules for this run."""
    layout = role.strategy.layout
    mp = layout.tp * layout.pp * layout.cp
    if role.world_size < 1:
        problems.append(f"{name}.world_size={role.world_size} must be >= 1")
    elif role.world_size % mp:
        problems.append(
            f"{name}: tp*pp*cp = {layout.tp}*{layout.pp}*{layout.cp} = {mp} does not divide {name}.world_size="
            f"{role.world_size}; set world_size to a multiple of {mp} or shrink the layout"
        )
    run = run_facts(config, name, role)
    fields = run.model_config or {}
    for what in ("num_attention_heads", "num_key_value_heads"):
        count = fields.get(what) or (fields.get("num_attention_heads") if what == "num_key_value_heads" else None)
        if count and count % layout.tp:
            problems.append(
                f"{name}.strategy.tp={layout.tp} does not divide {what}={count}; choose one of {_divisors(count)}"
            )
    problems.extend(f"{name}.strategy: {problem}" for problem in layout.expert_problems(role.world_size))
    problems.extend(role.strategy.config.problems(run))


def _check_batches(config: PipelineConfig, problems: list[str]) -> None:
    algo = config.algorithm
    n = config.num_return_sequences_in_group
    if config.rollout_batch_size < 1 or n < 1:
        problems.append(
            f"rollout_batch_size={config.rollout_batch_size} and num_return_sequences_in_group={n} must be >= 1"
        )
        return
    step_batch = config.rollout_batch_size * n
    mini = algo.ppo_mini_batch_size or step_batch
    if step_batch % mini:
        problems.append(
            f"algorithm.ppo_mini_batch_size={mini} does not divide rollout_batch_size*num_return_sequences_in_group="
            f"{step_batch}; choose one of {_divisors(step_batch)}"
        )
    if config.response_length < 1:
        problems.append(f"response_length={config.response_length} must be >= 1 (the most tokens a response may have)")
    problems.extend(group_problems(config))


def _check_async(config: PipelineConfig, problems: list[str]) -> None:
    """One-step off-policy needs the rollout on its own resources: colocated, generation and training would share
    the devices they are meant to overlap on."""
    async_cfg = config.async_generation
    if not async_cfg.enabled:
        if async_cfg.prepare_ahead:
            problems.append(
                "async_generation.prepare_ahead=true prepares the next batch while the actor trains, which only "
                "the asynchronous loop does; set async_generation.enabled=true as well, or drop prepare_ahead"
            )
        return
    if async_cfg.mode not in ASYNC_MODES:
        problems.append(f"async_generation.mode={async_cfg.mode!r}; choose one of {', '.join(ASYNC_MODES)}")
    if async_cfg.mode == "streaming":
        _check_streaming(config, problems)
    elif async_cfg.max_staleness < 1:
        problems.append(
            f"async_generation.max_staleness={async_cfg.max_staleness}: one-step generation is one step "
            "behind at least; set it to 1 or more, mode=streaming (0 allowed) or async_generation.enabled=false"
        )
    infer, train = config.actor_infer, config.actor_train
    if infer is None:
        return  # (the pipeline check reports the missing rollout)
    if infer.colocate_with is not None or train.colocate_with == roles.ACTOR_INFER:
        problems.append(
            "async_generation.enabled=true needs actor_infer on resources disjoint from actor_train's; remove "
            f"colocate_with (actor_infer.colocate_with={infer.colocate_with!r}, actor_train.colocate_with="
            f"{train.colocate_with!r}) or turn async_generation off"
        )
    reference = config.reference
    if (
        async_cfg.prepare_ahead
        and reference is not None
        and (reference.colocate_with == roles.ACTOR_TRAIN or train.colocate_with == roles.REFERENCE)
    ):
        problems.append(
            "async_generation.prepare_ahead=true runs the reference while the actor trains, but the reference "
            "shares actor_train's devices; place it elsewhere (reference.colocate_with: actor_infer, or its "
            "own resources) or set async_generation.prepare_ahead=false"
        )


def _check_streaming(config: PipelineConfig, problems: list[str]) -> None:
    async_cfg = config.async_generation
    if async_cfg.max_staleness < 0:
        problems.append(f"async_generation.max_staleness={async_cfg.max_staleness} must be >= 0 in streaming mode")
    if async_cfg.partial_rollout not in PARTIAL_ROLLOUT_MODES:
        problems.append(
            f"async_generation.partial_rollout={async_cfg.partial_rollout!r}; choose one of "
            f"{', '.join(PARTIAL_ROLLOUT_MODES)}"
        )
    if async_cfg.on_stale not in ("drop", "regenerate"):
        problems.append(f"async_generation.on_stale={async_cfg.on_stale!r}; choose drop or regenerate")
    if async_cfg.steps_per_call < 1:
        problems.append(f"async_generation.steps_per_call={async_cfg.steps_per_call} must be >= 1")
    if async_cfg.prepare_ahead:
        problems.append(
            "async_generation.prepare_ahead=true is for mode=one_step; streaming scores each batch as the trainer "
            "takes it: drop prepare_ahead"
        )
    infer = config.actor_infer
    if infer is not None and infer.strategy.layout.tp > 1:
        problems.append(
            f"async_generation.mode=streaming with actor_infer.strategy.tp={infer.strategy.layout.tp}: streaming "
            "steps each rank's engine on its own; use tp=1 rollout ranks (more of them for DP) or mode=one_step"
        )
    routed = infer is not None and getattr(infer.strategy.config, "return_routed_experts", False)
    if replays_rollout_routes(config) or routed:
        problems.append(
            "async_generation.mode=streaming with the rollout's routed experts (actor_train.strategy.router_replay=R3 "
            "or actor_infer.strategy.return_routed_experts): streamed requests' routes are not collected yet; use "
            "router_replay=R2 or mode=one_step"
        )


def _check_fault_tolerance(config: PipelineConfig, problems: list[str]) -> None:
    from dataclasses import fields

    from roll_backend.distributed.faults import FAULTS_OFF, parse_faults

    ft = config.fault_tolerance
    if ft.max_restarts < 0:
        problems.append(f"fault_tolerance.max_restarts={ft.max_restarts} must be >= 0 (0: no automatic restart)")
    if ft.max_restarts and not config.checkpoint.save_steps:
        problems.append(
            f"fault_tolerance.max_restarts={ft.max_restarts} restarts from checkpoints, but checkpoint.save_steps=0 "
            f"saves none; set checkpoint.save_steps (a restart would otherwise start over from step 1)"
        )
    for phase in fields(ft.timeouts):
        seconds = getattr(ft.timeouts, phase.name)
        if not seconds > 0:
            problems.append(f"fault_tolerance.timeouts.{phase.name}={seconds} must be > 0 seconds")
    if ft.inject not in (None, FAULTS_OFF):
        try:
            faults = parse_faults(ft.inject)
        except ValueError as exc:
            problems.append(f"fault_tolerance.inject: {exc}")
            return
        model_roles = {name: getattr(config, name) for name in roles.MODEL_ROLES}
        sizes = {name: role.world_size for name, role in model_roles.items() if role is not None}
        sizes[roles.REWARD] = config.reward.world_size
        for fault in faults:
            if fault.role not in sizes:
                problems.append(
                    f"fault_tolerance.inject={ft.inject!r}: role {fault.role!r} is not in this run; one of "
                    f"{', '.join(sizes)}"
                )
            elif fault.rank >= sizes[fault.role]:
                problems.append(
                    f"fault_tolerance.inject={ft.inject!r}: {fault.role} has ranks 0..{sizes[fault.role] - 1}"
                )


def _check_perf(config: PipelineConfig, problems: list[str]) -> None:
    perf = config.perf
    if perf.peak_tflops is not None and not perf.peak_tflops > 0:
        problems.append(
            f"perf.peak_tflops={perf.peak_tflops} must be > 0 (TFLOP/s of one rank's device) or null to measure it"
        )
    if perf.probe_seconds <= 0:
        problems.append(f"perf.probe_seconds={perf.probe_seconds} must be > 0")


def _data_elsewhere(config: PipelineConfig, recipe_check: bool) -> bool:
    """A recipe checked against a model folder holding only config.json is checked away from the machine that runs
    it: the prompt files it names need not be here either (model_folders.skipped_checks lists the missing)."""
    return recipe_check and describes_only(config.model_path)


def _check_eval(config: PipelineConfig, problems: list[str], recipe_check: bool = False) -> None:
    ev, paths = config.eval, config.data.val_paths()
    for path in paths:
        if not _data_elsewhere(config, recipe_check) and not Path(path).exists():
            problems.append(f"data.val_path: {path!r} does not exist")
    if ev.n < 1:
        problems.append(f"eval.n={ev.n} must be >= 1 (samples per validation prompt)")
    for name in ("pass_k", "maj_k"):
        wrong = [k for k in getattr(ev, name) if not 1 <= k <= ev.n]
        if wrong:
            problems.append(f"eval.{name}={list(getattr(ev, name))}: each k must be 1..eval.n={ev.n}; raise eval.n")
    if ev.every_steps < 0:
        problems.append(f"eval.every_steps={ev.every_steps} must be >= 0 (0: only before training and at the end)")
    if ev.n > 1 and ev.temperature == 0:
        problems.append(f"eval.n={ev.n} with eval.temperature=0: greedy samples are all the same; set a temperature")
    given = {"temperature": ev.temperature, "top_p": ev.top_p}  # (null: the rollout's, checked with its sampling)
    problems += [f"eval.{p}" for p in sampling_range_problems(**{k: v for k, v in given.items() if v is not None})]
    if ev.prompts_per_call < 1:
        problems.append(f"eval.prompts_per_call={ev.prompts_per_call} must be >= 1")
    if not config.data.has_validation() and (ev.every_steps or ev.pass_k or ev.maj_k):
        problems.append(
            "eval: every_steps, pass_k and maj_k need validation prompts; set data.val_path or data.val_reasoning_gym"
        )


def _check_colocated_gpus(model_roles: dict[str, RoleConfig | None], problems: list[str]) -> None:
    """Colocated roles share each rank's bundle: their GPU shares must fit one GPU."""
    for host in {role.colocate_with for role in model_roles.values() if role and role.colocate_with in model_roles}:
        members = {n: r for n, r in model_roles.items() if r and (n == host or r.colocate_with == host)}
        total = sum(r.num_gpus_per_rank for r in members.values())
        if total > 1:
            shares = ", ".join(f"{n} {r.num_gpus_per_rank:g}" for n, r in members.items())
            problems.append(
                f"roles colocated with {host}: their GPU shares per rank sum to {total:g} ({shares}); colocated ranks "
                "share one GPU, so give each a share (e.g. 0.5 each), or drop colocate_with to give each role GPUs "
                "of its own"
            )


def _check_train_path(config: PipelineConfig, problems: list[str], recipe_check: bool = False) -> None:
    """One prompt file, or a mixture whose every entry exists (or is on the machine that runs a recipe checked
    elsewhere: `_data_elsewhere`) and has a positive weight."""
    train_path = config.data.train_path
    data_elsewhere = _data_elsewhere(config, recipe_check)
    _check_source_weights(config.data, problems)
    if train_path is None:
        if config.data.synthetic is None and config.data.reasoning_gym is None:
            problems.append("data: set data.train_path (JSONL or parquet), data.reasoning_gym or data.synthetic")
        return
    if isinstance(train_path, str):
        if not data_elsewhere and not Path(train_path).exists():
            problems.append(f"data.train_path={train_path!r} does not exist")
        return
    if not train_path:
        problems.append(
            "data.train_path is an empty list; give one file, or at least one {path, weight, data_source} entry"
        )
    for index, source in enumerate(train_path):
        where = f"data.train_path[{index}]"
        if not data_elsewhere and not Path(source.path).is_file():
            problems.append(f"{where}.path={source.path!r} does not exist; point it at a JSONL or parquet file")
        if not (source.weight > 0 and math.isfinite(source.weight)):
            problems.append(
                f"{where}.weight={source.weight} must be a finite number > 0 (its share of each step's prompts is "
                "weight / sum of weights); drop the entry to leave the file out"
            )
        if source.data_source is not None and not source.data_source.strip():
            problems.append(f"{where}.data_source is empty; name the source, or drop the key to use the file's")


def _check_source_weights(data, problems: list[str]) -> None:
    """data.source_weights: over train_path rows, finite weights >= 0 with one > 0, not beside the files' weights."""
    weights = data.source_weights
    if weights is None:
        return
    if data.train_path is None:
        problems.append("data.source_weights weighs the sources of data.train_path's rows; set data.train_path")
    bad = {name: weight for name, weight in weights.items() if not (math.isfinite(weight) and weight >= 0)}
    if bad or not any(weight > 0 for weight in weights.values()):
        problems.append(
            f"data.source_weights={dict(weights)}: weights are finite numbers >= 0 (0 leaves a source out) and at "
            "least one is > 0"
        )
    if not isinstance(data.train_path, str) and any(entry.weight != 1.0 for entry in data.train_path or ()):
        problems.append(
            "data.source_weights draws by source, so the data.train_path entries' weights would be ignored; drop "
            "one of the two"
        )


def _check_logging(config: PipelineConfig, problems: list[str]) -> None:
    section = config.logging
    for name in section.backends or ():
        if name not in LOGGER_NAMES:
            problems.append(f"logging.backends: unknown backend {name!r}; choose from {', '.join(LOGGER_NAMES)}")
    # A listed backend whose switch is false: the switches only apply without `backends`, so one of them is a slip.
    for switch, backend in (("jsonl", "jsonl"), ("tensorboard", "tensorboard"), ("progress_bar", "console")):
        if not getattr(section, switch) and backend in (section.backends or ()):
            problems.append(
                f"logging.{switch}=false contradicts logging.backends, which names {backend!r}; drop one of the two"
            )
    if section.wandb_mode not in WANDB_MODES:
        problems.append(f"logging.wandb_mode={section.wandb_mode!r}; choose one of {', '.join(WANDB_MODES)}")
    if not section.project:
        problems.append("logging.project is empty; name the W&B project / MLflow experiment, e.g. roll-backend")


def _check_distillation(config: PipelineConfig, problems: list[str]) -> None:
    distill = config.distillation
    if distill.mode not in DISTILL_MODES:
        problems.append(f"distillation.mode={distill.mode!r}; choose one of {', '.join(DISTILL_MODES)}")
    if not distill.coef >= 0:
        problems.append(f"distillation.coef={distill.coef} must be >= 0")


def _check_same_vocabulary(config: PipelineConfig, problems: list[str]) -> None:
    """A teacher reads the policy's token ids: its vocabulary must be the policy's. (A reward model with another
    tokenizer reads the responses as text: model_folders.same_tokenizer.)"""
    policy = run_facts(config, roles.ACTOR_TRAIN).model_config or {}
    for name in (roles.TEACHER,):
        if getattr(config, name) is None:
            continue
        other = run_facts(config, name).model_config or {}
        if policy.get("vocab_size") and other.get("vocab_size") and policy["vocab_size"] != other["vocab_size"]:
            problems.append(
                f"{name}.model_path: vocab_size={other['vocab_size']} differs from the policy's "
                f"{policy['vocab_size']}; the {name} reads the policy's token ids, so it needs the policy's tokenizer"
            )


def _check_offline(config: PipelineConfig, problems: list[str]) -> None:
    """sft, reward_model and dpo: the roles they start, their objective's settings, the batch."""
    from roll_backend.algorithms.preference import DPO_LOSSES

    needed = OFFLINE_ROLES[config.pipeline]
    for name in roles.MODEL_ROLES:
        if name not in needed and getattr(config, name) is not None:
            problems.append(
                f"{name}: pipeline={config.pipeline} does not use this role (it starts {', '.join(needed)}); remove "
                f"the block ({name}=null)"
            )
    if config.pipeline == "dpo" and not config.has_reference:
        problems.append(
            "pipeline=dpo needs a `reference:` role block (the frozen starting policy, e.g. model_path: "
            "${model_path} with strategy megatron_infer)"
        )
    pref = config.preference
    if pref.loss not in DPO_LOSSES:
        problems.append(f"preference.loss={pref.loss!r}; choose one of {', '.join(DPO_LOSSES)}")
    if not pref.beta > 0:
        problems.append(f"preference.beta={pref.beta} must be > 0 (0.1 is usual)")
    if not 0 <= pref.label_smoothing < 0.5:
        problems.append(f"preference.label_smoothing={pref.label_smoothing} must be in [0, 0.5)")
    if pref.loss == "ipo" and pref.label_smoothing:
        problems.append("preference.label_smoothing applies to the sigmoid loss; set it to 0 with loss=ipo")
    for section, value in (("async_generation.enabled", config.async_generation.enabled), ("agentic", config.agentic)):
        if value:
            problems.append(f"{section}: pipeline={config.pipeline} trains on a dataset, without a rollout; drop it")
    if config.rollout_batch_size < 1:
        problems.append(f"rollout_batch_size={config.rollout_batch_size} (examples or pairs per step) must be >= 1")
    if config.response_length < 1:
        problems.append(f"response_length={config.response_length} must be >= 1 (the longest response trained on)")


def validate(config: PipelineConfig, recipe_check: bool = False) -> list[str]:
    """Every cross-field problem of `config` (empty when it can run). `recipe_check` (roll-backend validate): a model
    folder holding only config.json passes, as on a machine other than the run's (model_folders.skipped_checks)."""
    problems: list[str] = []
    if config.max_steps < 1:
        problems.append(
            f"max_steps={config.max_steps} must be >= 1 (the number of RL steps to run); set e.g. max_steps=10"
        )
    if config.pipeline not in PIPELINES:
        problems.append(f"pipeline={config.pipeline!r} is unknown; choose one of {', '.join(PIPELINES)}")
    if config.pipeline == "agentic" and config.agentic is None:
        problems.append(
            "pipeline=agentic needs an `agentic:` section (e.g. agentic: {env: {gymnasium: FrozenLake-v1}})"
        )
    if config.pipeline == "ppo" and config.critic is None:
        problems.append("pipeline=ppo needs a `critic:` role block (or use pipeline=grpo)")
    if config.pipeline in RL_PIPELINES and config.actor_infer is None:
        problems.append(
            f"pipeline={config.pipeline} needs an `actor_infer:` role block (the rollout engine, strategy vllm_rollout)"
        )
    if config.agentic is not None:
        problems += config.agentic.problems()
    model_roles = {name: getattr(config, name) for name in roles.MODEL_ROLES}
    _check_model_path(config, "model_path", config.model_path, problems, recipe_check)
    for name, role in model_roles.items():
        if role is not None:
            if role.model_path != config.model_path:
                _check_model_path(config, f"{name}.model_path", role.model_path, problems, recipe_check)
            _check_role(config, name, role, problems)
            if role.colocate_with is not None:
                other = model_roles.get(role.colocate_with)
                if other is None:
                    problems.append(
                        f"{name}.colocate_with={role.colocate_with!r} names no role in this config; known: "
                        f"{', '.join(n for n, r in model_roles.items() if r)}"
                    )
                elif other.world_size != role.world_size:
                    problems.append(
                        f"{name}.colocate_with={role.colocate_with!r}: world sizes differ ({role.world_size} vs "
                        f"{other.world_size}); colocated roles share bundles rank by rank"
                    )
    _check_colocated_gpus(model_roles, problems)
    _check_train_path(config, problems, recipe_check)
    if not config.model_path and config.build_tiny_model is None:
        problems.append("model_path is empty; point it at a Hugging Face model folder")
    _check_eval(config, problems, recipe_check)
    if config.offline:
        _check_offline(config, problems)
    elif config.pipeline in RL_PIPELINES:
        problems.extend(algorithm_problems(config) + reward_problems(config))
        _check_async(config, problems)
        _check_batches(config, problems)
        _check_distillation(config, problems)
        _check_same_vocabulary(config, problems)
    for check in (_check_lora_uses, _check_fault_tolerance, _check_perf, _check_logging):
        check(config, problems)
    problems += hybrid_problems(config) + guard_problems(config.guards)
    return problems or memory_problems(config)  # (the plan of a config with problems would plan the wrong run)


def _check_lora_uses(config: PipelineConfig, problems: list[str]) -> None:
    """What needs the actor's LoRA adapters: `reference: {from_actor_base: true}` (and the actor's ranks free to run
    it) and checkpoint.export_peft_dir."""
    train = config.actor_train.strategy
    has_lora = getattr(train.config, "lora", None) is not None
    if config.checkpoint.export_peft_dir and not has_lora:
        problems.append(
            f"checkpoint.export_peft_dir writes LoRA adapters, and actor_train.strategy ({train.name}) has no `lora:`; "
            "add one, or use checkpoint.export_hf_dir for the whole model"
        )
    streaming = config.async_generation.enabled and config.async_generation.mode == "streaming"
    partial = config.async_generation.partial_rollout
    if has_lora and train.config.lora.sync == "adapter" and streaming and partial != "resubmit":
        problems.append(
            "actor_train.strategy.lora.sync=adapter with async_generation.mode=streaming and "
            f"partial_rollout={partial}: a request keeps the adapter it was added with, so the requests in flight at "
            "a sync must be added again under the new one; set async_generation.partial_rollout=resubmit, or use "
            "lora.sync=merged"
        )
    if not config.reference_from_actor_base:
        return
    if not has_lora:
        problems.append(
            "reference.from_actor_base=true computes the reference as the actor with its LoRA adapters off, and "
            f"actor_train.strategy ({train.name}) has no `lora:`; add actor_train.strategy.lora, or give the "
            "reference a role of its own (reference: {model_path: ..., strategy: {name: megatron_infer}})"
        )
    if config.offline and config.pipeline != "dpo":
        problems.append(f"reference.from_actor_base: pipeline={config.pipeline} uses no reference; remove it")
    if config.async_generation.enabled and config.async_generation.prepare_ahead:
        problems.append(
            "async_generation.prepare_ahead=true runs the reference while the actor trains, and "
            "reference.from_actor_base=true runs it on the actor's ranks; set prepare_ahead=false"
        )
