"""`roll-backend convert verl|roll INPUT`: a verl or ROLL job as a config here, with a report of every input key.

INPUT is a YAML config, or a run script (verl's `python3 -m verl.trainer.main_ppo key=value ...`), read by
config.job_reading. Each key
goes through config.foreign_keys: copied to its key here, converted where the meaning differs (verl's mini-batch
counts prompts, here responses; epochs become steps; GPU counts become world sizes), or listed as having no
equivalent. The result starts from a GRPO job on Megatron + vLLM with the rollout and reference on the trainer's GPUs
(verl's colocated layout is the hybrid engine here) and rewards by data source (verl's default scorer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from roll_backend.config.foreign_keys import FRAMEWORKS, rule_for
from roll_backend.config.roll_jobs import (
    aliased,
    distills_offline,
    distills_on_policy,
    named_teachers,
    offline_pipeline,
    offline_tree,
    role_block,
)
from roll_backend.config.schema import LAYOUT_KEYS

ROLES = ("actor_train", "actor_infer", "reference")
_VAL_KWARGS = "actor_rollout_ref.rollout.val_kwargs"
_EPOCHS = "actor_train.training_args.num_train_epochs"  # ROLL's
_BACKENDS = {
    "console": "console",
    "stdout": "console",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
}
_SECRET = re.compile(r"(^|_)(api_?key|access_?key|token|secret|password)$", re.IGNORECASE)
_OVERLONG_SWITCHES = ("overlong_buffer_cfg.enable", "overlong_buffer.enable")
_GPU_ROLE = {"num_gpus_per_rank": 1}


@dataclass
class Report:
    copied: list[str] = field(default_factory=list)  # "theirs = value -> ours"
    converted: list[str] = field(default_factory=list)  # "theirs = value -> ours = new value (why)"
    unmapped: list[str] = field(default_factory=list)  # "theirs = value: why"

    def text(self) -> str:
        sections = [
            ("Same meaning", self.copied),
            ("Converted (the meaning differs)", self.converted),
            ("No equivalent here", self.unmapped),
        ]
        return "\n".join(
            f"{title} ({len(lines)}):\n" + "".join(f"  {line}\n" for line in lines) for title, lines in sections
        )


def not_a_job_of(framework: str, settings: dict[str, Any]) -> str | None:
    """Why settings read from INPUT are not a `framework` job (a config of this project, another framework's keys,
    nothing at all), or None."""
    if not settings:
        return "it holds no settings (a YAML mapping, or a run script with key=value arguments)"
    if "pipeline" in settings and any(key.endswith(".strategy.name") for key in settings):
        return "it is a roll-backend config already: check it with `roll-backend validate`"
    matched = {name: sum(rule_for(name, key) is not None for key in settings) for name in FRAMEWORKS}
    likelier = max(matched, key=matched.get)
    if likelier != framework and matched[likelier] > 2 * matched[framework]:
        return (
            f"{matched[framework]} of its {len(settings)} keys are {framework}'s and {matched[likelier]} {likelier}'s: "
            f"convert it with `roll-backend convert {likelier}`"
        )
    return None


def convert(framework: str, settings: dict[str, Any]) -> tuple[dict[str, Any], Report]:
    """Our config tree for a job's settings, and the report."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"convert: unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}")
    job = _Job(framework, settings)
    for key, value in settings.items():
        job.take(key, value)
    job.finish()
    return job.tree, job.report


class _Job:
    def __init__(self, framework: str, settings: dict[str, Any]):
        self.framework, self.settings, self.report = framework, settings, Report()
        self._by_lookup = {aliased(key) if framework == "roll" else key: value for key, value in settings.items()}
        self.offline = offline_pipeline(settings) if framework == "roll" else None  # (ROLL's SFT and DPO jobs)
        if self.offline is not None:
            self.tree = offline_tree(self.offline)
            return
        # verl's critic comes with GAE or its own keys; ROLL's with a `critic:` section (the actor's model unless
        # critic.model_args.model_name_or_path says otherwise)
        with_critic = any(key.startswith("critic.") for key in settings) or (
            framework == "verl" and settings.get("algorithm.adv_estimator") == "gae"
        )
        self.tree: dict[str, Any] = {
            "pipeline": "ppo" if with_critic else "grpo",
            "reward": {"rewards": None, "by_source": "auto" if framework == "verl" else {}},
            "actor_train": role_block("megatron_train"),
            "actor_infer": role_block("vllm_rollout", hybrid=framework == "verl"),
            "reference": role_block("megatron_infer", hybrid=framework == "verl"),
        }
        if framework == "roll" and distills_on_policy(settings):  # ROLL's teacher: a role of its own here too
            self.tree["teacher"] = role_block("megatron_infer")
            self.tree["distillation"] = {}
        if with_critic:  # verl's critic: the actor's model unless critic.model.path says otherwise
            self.tree["critic"] = role_block("megatron_train", hybrid=framework == "verl")

    def set(self, key: str, value: Any) -> None:
        node = self.tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def take(self, key: str, value: Any) -> None:
        """Write one setting of theirs into the tree and the report (`key` as they wrote it, its rule looked up under
        the role's name here)."""
        lookup = aliased(key) if self.framework == "roll" else key
        rule = rule_for(self.framework, lookup)
        parts, entry = lookup.split("."), ""
        while rule is None and len(parts) > 1:  # a mapping setting (flattened): its parent's rule, if it has none
            entry = f".{parts.pop()}{entry}"
            parent = rule_for(self.framework, ".".join(parts))
            rule = parent if parent is not None and (parent.target is None or parent.mapping) else None
        if _shell_variable(value):
            self.report.unmapped.append(f"{key} = {value}: a shell variable; set the value in the output yourself")
            if rule is not None and rule.target == "model_path":  # (every role refers to it: validation names it)
                self.set("model_path", value)
            return
        if rule is None or rule.target is None:
            why = rule.note if rule else "not a setting this converter knows"
            shown = "'***'" if _SECRET.search(key.rsplit(".", 1)[-1]) else repr(value)  # (the report is shared)
            self.report.unmapped.append(f"{key} = {shown}: {why}")
            return
        role = lookup.split(".")[0]
        target = rule.target.replace("{role}", role) + (entry if rule.mapping else "")
        if rule.derived or rule.note:
            new = self.derive(lookup, target, value, role)
            if new is not _SKIP:
                self.report.converted.append(f"{key} = {value!r} -> {target} = {new!r} ({rule.note})")
            return
        self.set(target, value)
        self.report.copied.append(f"{key} = {value!r} -> {target}")

    def derive(self, key: str, target: str, value: Any, role: str) -> Any:
        leaf = key.rsplit(".", 1)[-1]
        if leaf in _VALUE_CONVERSIONS:
            value = _VALUE_CONVERSIONS[leaf](value)
            if leaf == "dtype" and role == "actor_infer":  # the engine's setting is `dtype`
                target = "actor_infer.strategy.dtype"
        elif leaf in ("train_files", "file_name") and isinstance(value, list):
            value = value[0] if len(value) == 1 else [{"path": path} for path in value]
        elif leaf == "ppo_mini_batch_size":
            value = int(value) * int(self._get("actor_rollout_ref.rollout.n", 1))
        elif leaf == "total_epochs":
            files = self._get("data.train_files", None)
            value = self._epochs_to_steps(key, int(value), files, int(self._get("data.train_batch_size", 1)))
        elif leaf in ("n_gpus_per_node", "nnodes"):
            gpus = int(self._get("trainer.n_gpus_per_node", 1)) * int(self._get("trainer.nnodes", 1))
            for name in ROLES:
                self.set(f"{name}.world_size", gpus)
                self.set(f"{name}.num_gpus_per_rank", 1)
            return gpus
        elif leaf == "device_mapping":
            value = len(_gpu_list(value))
            self.set(f"{role}.num_gpus_per_rank", 1)
        elif leaf == "gradient_accumulation_steps":
            value = self._roll_mini_batch(int(value))
        elif leaf in ("clip_ratio", "pg_clip"):
            self.set("algorithm.clip_ratio_high", value)
        elif leaf == "name" and key.endswith("rollout.name"):
            value = _STRATEGIES.get(value, value)
        elif leaf == "sequence_length":
            if self.offline is None:  # (an RL job's limits are its prompt_length and response_length)
                self.report.unmapped.append(f"{key} = {value}: the limits are data.max_prompt_length, response_length")
                return _SKIP
            return self._split_sequence_length(int(value))
        elif leaf == "virtual_pipeline_model_parallel_size" and value is not None and int(value) <= 1:
            self.report.converted.append(f"{key} = {value} -> {target} = null (one model chunk per stage: no vpp)")
            return _SKIP
        elif leaf == "max_num_gen_batches" and not int(value):
            self.report.converted.append(f"{key} = 0 (no limit) -> {target} left at its default (a limit is needed)")
            return _SKIP
        elif leaf == "do_sample":
            if value:
                self.report.unmapped.append(f"{key} = True: validation samples at eval.temperature")
                return _SKIP
            value = 0.0  # (set again by finish: a val_kwargs.temperature written later does not undo it)
        elif key == "adv_estimator" and self.framework == "roll":
            if value == "reinforce":  # (ROLL computes GRPO's returns the same way, after a group normalisation)
                value = "grpo" if self._get("norm_mean_type", None) == "group" else "reinforce_plus_plus"
        elif key.startswith("custom_reward_function."):
            return self._reward_function(key.removeprefix("custom_reward_function."), value)
        elif key.startswith("rewards."):
            return self._roll_reward(key, value)
        if value is not _SKIP:
            self.set(target, value)
        return value

    def _split_sequence_length(self, length: int) -> str:
        """ROLL's offline pipelines bound prompt + response together; here each has its own limit: half each."""
        prompt = length // 2
        self.set("data.max_prompt_length", prompt)
        self.set("response_length", length - prompt)
        return f"data.max_prompt_length = {prompt}, response_length = {length - prompt}"

    def _get(self, key: str, default: Any) -> Any:
        """A setting of theirs by its key with the role's name here (ROLL's sft_train is actor_train)."""
        value = self._by_lookup.get(key, default)
        return default if _shell_variable(value) else value

    def _epochs_to_steps(self, key: str, epochs: int, files: Any, batch: int) -> Any:
        """max_steps for `epochs` passes over the rows of `files` at `batch` rows a step (reported where the files
        are not here to count)."""
        files = [files] if isinstance(files, str) else files or []
        try:
            prompts = sum(_count_rows(path) for path in files)
        except (OSError, ValueError):
            prompts = 0
        if not prompts:
            self.report.unmapped.append(f"{key} = {epochs}: the data files are not here; set max_steps")
            return _SKIP
        steps = epochs * math.ceil(prompts / batch)
        self.set("max_steps", steps)
        return steps

    def _roll_mini_batch(self, accumulation: int) -> int:
        micro = int(self._get("actor_train.training_args.per_device_train_batch_size", 1))
        sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        prefix = "actor_train.strategy_args.strategy_config"
        model_parallel = math.prod(int(self._get(f"{prefix}.{size}", 1) or 1) for size in sizes)
        ranks = len(_gpu_list(self._get("actor_train.device_mapping", [0])))
        value = micro * accumulation * max(1, ranks // model_parallel)
        self.set("algorithm.ppo_mini_batch_size", value)
        return value

    def _reward_function(self, setting: str, value: Any) -> Any:
        """verl's custom_reward_function (`path`, `name`, `reward_kwargs.<argument>`) as reward.functions[0]."""
        functions = self.tree["reward"].setdefault("functions", [{}])
        if setting.startswith("reward_kwargs"):
            if isinstance(value, dict):  # (an empty mapping: nothing to pass)
                return value
            functions[0].setdefault("kwargs", {})[setting.removeprefix("reward_kwargs.")] = value
        else:
            functions[0][setting] = value
        self.tree["reward"]["by_source"] = None  # verl calls a custom function for every row
        return value

    def _roll_reward(self, key: str, value: Any) -> Any:
        from roll_backend.rewards.source_routing import known_scorer

        domain = key.split(".")[1]
        scorer = known_scorer(domain)
        if scorer is None:
            self.report.unmapped.append(f"{key} = {value!r}: no built-in scorer for domain {domain!r}")
            return _SKIP
        table = self.tree["reward"]["by_source"]
        table[domain] = scorer
        if key.endswith("tag_included"):
            table |= {str(tag): scorer for tag in value}
        return scorer

    def finish(self) -> None:
        self._unconverted_pipelines()
        self._validation_files()
        if self.offline is not None:
            self._finish_offline()
            self._packing_budget()
            return
        uses_kl = self._get("actor_rollout_ref.actor.use_kl_loss", self._get("use_kl_loss", False))
        in_reward = self._get("algorithm.use_kl_in_reward", self._get("add_token_level_kl", False))
        if not (uses_kl or in_reward):  # (verl's and ROLL's defaults: no KL, so no reference)
            del self.tree["reference"]
            self.tree.setdefault("algorithm", {}).update(use_kl_loss=False, use_kl_in_reward=False)
        if self.tree["reward"]["by_source"] == {}:
            self.tree["reward"]["by_source"] = "auto"
        infer = self.tree["actor_infer"]
        if infer.get("hybrid"):  # verl's colocated engine: the hybrid engine at the trainer's world size
            infer["world_size"] = self.tree["actor_train"].get("world_size", 1)
            for hosted in ("reference", "critic"):
                if hosted in self.tree:
                    self.tree[hosted]["world_size"] = infer["world_size"]
                    self.tree[hosted].pop("num_gpus_per_rank", None)
        self._packing_budget()
        self._reward_model()
        self._overlong_buffer()
        if self._get(f"{_VAL_KWARGS}.do_sample", True) is False:
            self.set("eval.temperature", 0.0)
        self._hosted_layouts()
        prompt = self.tree.get("data", {}).get("max_prompt_length")
        if prompt is not None:
            infer["strategy"].setdefault("max_prompt_length", prompt)
            response = self.tree.get("response_length")
            if response is not None:
                written = infer["strategy"].get("max_model_len")
                infer["strategy"]["max_model_len"] = max(written or 0, prompt + response)
                if written is not None and written < prompt + response:
                    self.report.converted.append(
                        f"max_model_len = {written} -> actor_infer.strategy.max_model_len = {prompt + response} (the "
                        "longest prompt plus the response must fit the engine here)"
                    )

    def _unconverted_pipelines(self) -> None:
        """ROLL's pipelines with no counterpart to convert into, said first in the report."""
        if self.framework != "roll":
            return
        sections = {key.split(".")[0] for key in self.settings}
        if sections & {"train_env_manager", "custom_envs"}:
            self.report.unmapped.insert(
                0,
                "train_env_manager / custom_envs: ROLL's agentic pipeline is not converted (its environments and env "
                "managers): write an `agentic:` block by hand (configs/agentic_frozenlake_cpu.yaml plays FrozenLake); "
                "the rest below is converted as a single-turn job",
            )
        teachers = named_teachers(self.settings)
        if teachers:
            self.report.unmapped.insert(
                0,
                f"teacher.{{{', '.join(teachers)}}}: ROLL's several teachers (one per tag) are not converted; "
                "distillation here takes one `teacher:` role (and distillation.*): write it by hand",
            )
        if distills_offline(self.settings):
            self.report.unmapped.insert(
                0,
                "student / teacher: ROLL's distill pipeline (offline distillation from the teacher's top-k logits) is "
                "not converted; distillation here is on-policy, a `teacher:` role in a GRPO run (distillation.*)",
            )

    def _finish_offline(self) -> None:
        """A step of ROLL's SFT and DPO is one optimizer step (per-device batch x accumulation x data-parallel ranks),
        and their length is in epochs: the same here, where the data files are there to count. The ipo loss takes no
        label smoothing (ROLL ignores it there; here it is refused)."""
        preference = self.tree.get("preference", {})
        if preference.get("loss") == "ipo" and preference.get("label_smoothing"):
            self.report.unmapped.append(f"label_smoothing = {preference.pop('label_smoothing')}: the ipo loss has none")
        mini = self.tree.get("algorithm", {}).get("ppo_mini_batch_size")
        if "rollout_batch_size" not in self.tree and mini:
            self.set("rollout_batch_size", mini)
            self.report.converted.append(f"rollout_batch_size = {mini} (a step of theirs is one optimizer step)")
        epochs_key = next((key for key in self.settings if aliased(key) == _EPOCHS), _EPOCHS)  # (as they wrote it)
        epochs = self._get(_EPOCHS, None)
        if epochs and "max_steps" not in self.tree:
            files, batch = self.tree.get("data", {}).get("train_path"), self.tree.get("rollout_batch_size", 1)
            files = [entry["path"] if isinstance(entry, dict) else entry for entry in _as_list(files)]
            steps = self._epochs_to_steps(epochs_key, int(epochs), files, int(batch))
            if steps is not _SKIP:
                self.report.converted.append(f"{epochs_key} = {epochs} -> max_steps = {steps} (epochs become steps)")

    def _validation_files(self) -> None:
        every = self.tree.get("eval", {}).get("every_steps")
        if every and not self.tree.get("data", {}).get("val_path"):
            del self.tree["eval"]["every_steps"]
            self.report.unmapped.append(f"eval.every_steps = {every}: no validation files given; set data.val_path too")

    def _overlong_buffer(self) -> None:
        """verl's DAPO penalty applies only where its enable flag is true; otherwise its other keys are dropped."""
        overlong = self.tree["reward"].get("overlong_buffer")
        if overlong is None or any(
            self._get(key, False) is True for key in self.settings if key.endswith(_OVERLONG_SWITCHES)
        ):
            return
        del self.tree["reward"]["overlong_buffer"]
        self.report.unmapped.append(
            f"reward.overlong_buffer = {overlong}: its enable flag is not true, so verl applies no overlong penalty; "
            "nor does the config written"
        )

    def _packing_budget(self) -> None:
        """verl's use_remove_padding and ROLL's use_sequence_packing drop the padding of micro-batches of
        micro_batch_size rows; packing here fills rows up to a token budget: as many tokens as that many whole
        sequences, unless a budget is set."""
        for role, block in self.tree.items():
            strategy = block.get("strategy", {}) if isinstance(block, dict) else {}
            if not strategy.get("use_sequence_packing") or strategy.get("max_tokens_per_microbatch"):
                continue
            rows = strategy.get("micro_batch_size", 1)
            prompt, response = self.tree.get("data", {}).get("max_prompt_length"), self.tree.get("response_length")
            key = f"{role}.strategy.use_sequence_packing = True"
            if not (prompt and response):
                strategy["use_sequence_packing"] = False
                self.report.unmapped.append(f"{key}: packing needs a token budget; set max_tokens_per_microbatch")
                continue
            budget = rows * (prompt + response)
            strategy["max_tokens_per_microbatch"] = budget
            self.report.converted.append(
                f"{key} -> {role}.strategy.max_tokens_per_microbatch = {budget} ({self.framework} removes the padding "
                f"of micro-batches of {rows} rows; here sequences are packed into rows of at most {rows} whole "
                "sequences' tokens)"
            )

    def _reward_model(self) -> None:
        """verl's reward model (reward_model.enable): a Megatron scorer here, on a GPU of its own unless said. ROLL's
        `reward_model` served by vLLM is an LLM judge's engine, which has no equivalent here."""
        if self.framework != "verl":
            judge = self.tree.get("reward_model", {}).get("strategy", {}).get("name") == "vllm_rollout"
            if judge:
                del self.tree["reward_model"]
                self.report.unmapped.append(
                    "reward_model (served by vLLM): an LLM judge's engine; judging by generation has no equivalent here"
                )
            return
        if not self._get("reward_model.enable", False):
            self.tree.pop("reward_model", None)
            return
        block = self.tree.setdefault("reward_model", {})
        block.setdefault("model_path", "${model_path}")
        block.setdefault("strategy", {}).setdefault("name", "megatron_infer")
        block.setdefault("world_size", block["strategy"].get("tp", 1))
        if "num_gpus_per_rank" in self.tree["actor_train"]:
            block.setdefault("num_gpus_per_rank", 1)
        self.report.converted.append(
            f"reward_model.enable = True -> reward_model (a Megatron scorer on world_size={block['world_size']} ranks "
            "of its own GPUs: raise world_size, or colocate it, to spread it)"
        )

    def _hosted_layouts(self) -> None:
        """Roles hosted by the hybrid engine share actor_train's processes and so its parallel layout."""
        actor = self.tree["actor_train"]["strategy"]
        for role in ("reference", "critic"):
            block = self.tree.get(role)
            if not block or not block.get("hybrid"):
                continue
            for size in LAYOUT_KEYS:
                theirs, ours = block["strategy"].get(size), actor.get(size)
                if theirs is not None and theirs != ours:
                    self.report.converted.append(
                        f"{role}.strategy.{size} = {theirs!r} -> {ours!r} (a role on the hybrid engine runs in "
                        "actor_train's processes, with its parallel layout)"
                    )
                if ours is None:
                    block["strategy"].pop(size, None)
                else:
                    block["strategy"][size] = ours


_SKIP = object()
# Their engines' and trainers' names: the backend here that does the job (vLLM serves, Megatron trains and infers)
_STRATEGIES = {
    "vllm": "vllm_rollout",
    "sglang": "vllm_rollout",
    "trtllm": "vllm_rollout",
    "fsdp2_train": "megatron_train",
    "deepspeed_train": "megatron_train",
    "fsdp2_infer": "megatron_infer",
    "deepspeed_infer": "megatron_infer",
    "hf_infer": "megatron_infer",
}


# Values whose meaning differs, by the setting's last part: theirs -> ours.
_VALUE_CONVERSIONS: dict[str, Any] = {
    "test_freq": lambda value: max(int(value), 0),  # (-1: never during training)
    "loss_mode": lambda value: "ppo" if value == "vanilla" else value,
    "dtype": lambda value: {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(value, value),
    "disable_gradient_checkpointing": lambda value: not value,
    "recompute_granularity": lambda value: value == "full",
    "logger": lambda value: _backends(value),
    "track_with": lambda value: _backends(value),
    "resume_mode": lambda value: "auto" if value == "auto" else None,
    "resume_from_checkpoint": lambda value: value or None,  # (false: a fresh run)
    "strategy_name": lambda value: _STRATEGIES.get(value, value),
    "ipo": lambda value: "ipo" if value else "sigmoid",
    "lr_scheduler_type": lambda value: {"constant_with_warmup": "constant"}.get(value, value),
}


def _backends(trackers: Any) -> list[str]:
    """verl's loggers or ROLL's trackers as logging.backends: those there is a backend for (console and stdout: the
    progress bar, which shows the step's metrics), after jsonl, the run's metrics.jsonl that `plot` reads."""
    trackers = trackers if isinstance(trackers, list) else [trackers]
    return list(dict.fromkeys(["jsonl"] + [_BACKENDS[name] for name in trackers if name in _BACKENDS]))


def _as_list(value: Any) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def _shell_variable(value: Any) -> bool:
    """A value the run script takes from a shell variable set nowhere (`$train_files`, `$DATA/train.parquet`, or a
    list of them): not known here."""
    if isinstance(value, list):
        return any(_shell_variable(item) for item in value)
    return isinstance(value, str) and re.search(r"\$\{?[A-Za-z_]", value) is not None


def _gpu_list(value: Any) -> list:
    """ROLL's device_mapping: a list, or the text `list(range(a, b))`."""
    if isinstance(value, str) and value.strip().startswith("["):
        value = yaml.safe_load(value)
    if isinstance(value, list):
        return value
    match = re.fullmatch(r"\s*list\(range\((\d+)\s*,\s*(\d+)\)\)\s*", str(value))
    return list(range(int(match.group(1)), int(match.group(2)))) if match else [value]


def _count_rows(path: str) -> int:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(1 for line in Path(path).read_text().splitlines() if line.strip())
