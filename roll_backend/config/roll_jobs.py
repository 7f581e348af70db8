"""ROLL's jobs beside RLVR: its SFT and DPO pipelines (the sft and dpo pipelines here: which one a job is, the config
it starts from), its on-policy distillation (a GRPO run with a `teacher:` role here), and the roles ROLL names
otherwise (`sft_train` and `student_train` are actor_train here, `student_infer` actor_infer)."""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {"sft_train": "actor_train", "student_train": "actor_train", "student_infer": "actor_infer"}
_PREFERENCE_KEYS = {"chosen_key", "rejected_key", "ipo"}  # top-level keys of ROLL's DPO pipeline


def offline_pipeline(settings: dict[str, Any]) -> str | None:
    """ "sft" for a job with an `sft_train` role, "dpo" for one with preference pairs and no rollout; None: an RL
    job."""
    sections = {key.split(".")[0] for key in settings}
    if "sft_train" in sections:
        return "sft"
    if sections & _PREFERENCE_KEYS and "actor_infer" not in sections:
        return "dpo"
    return None


def role_block(strategy: str, hybrid: bool | None = None) -> dict[str, Any]:
    """A converted role's block: the run's model (until the job names another) under `strategy`; `hybrid`: on the
    trainer's ranks (verl's colocated layout) or not, where the job decides."""
    block: dict[str, Any] = {"model_path": "${model_path}"}
    if hybrid is not None:
        block["hybrid"] = hybrid
    return block | {"strategy": {"name": strategy}}


def offline_tree(pipeline: str) -> dict[str, Any]:
    """The config an offline job's settings are written into: the trainer, and DPO's reference."""
    tree: dict[str, Any] = {"pipeline": pipeline, "actor_train": role_block("megatron_train")}
    if pipeline == "dpo":
        tree["reference"] = role_block("megatron_infer")
    return tree


def aliased(key: str) -> str:
    """A setting's key with ROLL's role names read as here (`sft_train.x` -> `actor_train.x`)."""
    role, _, rest = key.partition(".")
    return f"{ROLE_ALIASES[role]}.{rest}" if role in ROLE_ALIASES and rest else key


def distills_on_policy(settings: dict[str, Any]) -> bool:
    """A ROLL on-policy distillation job: a student trained on its own samples, scored by one `teacher` role."""
    sections = {key.split(".")[0] for key in settings}
    return "student_train" in sections and any(key.startswith(_TEACHER_SECTIONS) for key in settings)


def named_teachers(settings: dict[str, Any]) -> list[str]:
    """The teachers of a ROLL job with several (`teacher.<name>.model_args ...`, one per tag), in order."""
    return list(
        dict.fromkeys(
            key.split(".")[1]
            for key in settings
            if key.startswith("teacher.") and not key.startswith(_TEACHER_SECTIONS) and key.count(".") >= 3
        )
    )


_TEACHER_SECTIONS = ("teacher.model_args.", "teacher.strategy_args.", "teacher.device_mapping")


def distills_offline(settings: dict[str, Any]) -> bool:
    """ROLL's distill pipeline: a student fitted to a teacher's top-k logits over fixed data (none here)."""
    return bool({key.split(".")[0] for key in settings} & {"student", "student_pretrain", "teacher_pretrain"})
