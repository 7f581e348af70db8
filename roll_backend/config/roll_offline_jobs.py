"""ROLL's offline jobs (its SFT and DPO pipelines) as the sft and dpo pipelines here: which one a job is, the config
it starts from, and the role ROLL names otherwise (its `sft_train` is actor_train here)."""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {"sft_train": "actor_train"}
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


def offline_tree(pipeline: str) -> dict[str, Any]:
    """The config an offline job's settings are written into: the trainer, and DPO's reference."""
    tree: dict[str, Any] = {
        "pipeline": pipeline,
        "actor_train": {"model_path": "${model_path}", "strategy": {"name": "megatron_train"}},
    }
    if pipeline == "dpo":
        tree["reference"] = {"model_path": "${model_path}", "strategy": {"name": "megatron_infer"}}
    return tree


def aliased(key: str) -> str:
    """A setting's key with ROLL's role names read as here (`sft_train.x` -> `actor_train.x`)."""
    role, _, rest = key.partition(".")
    return f"{ROLE_ALIASES[role]}.{rest}" if role in ROLE_ALIASES and rest else key
