"""A multi-turn rollout's output: trajectories as rows in the rollout batch layout, the agentic/ metrics, and the
tasks and environment seeds of prompt rows."""

from __future__ import annotations

import uuid

import numpy as np
import torch

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import left_pad, sequence_columns


def trajectory_rows(
    batch: DataProto,
    trajectories: list,
    width: int,
    tokenizer,
    prompt_width: int | None,
    reward_mode: str,
    metrics: dict,
    versions: bool = False,
) -> DataProto:
    """Each trajectory's segments as rows (the prompt row's columns repeated; `Trajectory.row` indexes `batch`),
    responses `width` wide, prompts at least `prompt_width`; `versions`: with TOKEN_POLICY_VERSION, each token's
    weight version (-1 on inserted tokens)."""
    segments = [(traj, seg) for traj in trajectories for seg in traj.conv.segments] if trajectories else []
    pad_id = tokenizer.pad_token_id
    longest = max((len(seg.prompt_ids) for _, seg in segments), default=1)
    prompts, prompt_mask = left_pad([seg.prompt_ids for _, seg in segments], pad_id, max(longest, prompt_width or 0))
    responses = torch.full((len(segments), width), pad_id, dtype=torch.int64)
    present = torch.zeros((len(segments), width), dtype=torch.int64)
    loss_mask = torch.zeros((len(segments), width), dtype=torch.int64)
    log_probs = torch.zeros((len(segments), width), dtype=torch.float32)
    for i, (_, seg) in enumerate(segments):
        length = len(seg.response_ids)
        responses[i, :length] = torch.tensor(seg.response_ids, dtype=torch.int64)
        present[i, :length] = 1
        loss_mask[i, :length] = torch.tensor(seg.loss_mask, dtype=torch.int64)
        log_probs[i, :length] = torch.tensor(seg.log_probs, dtype=torch.float32)
    rows = [traj.row for traj, _ in segments]
    if versions:
        token_versions = torch.full((len(segments), width), -1, dtype=torch.int64)
        for i, (_, seg) in enumerate(segments):
            token_versions[i, : len(seg.versions)] = torch.tensor(seg.versions, dtype=torch.int64)
    tensors = sequence_columns(prompts, prompt_mask, responses, present)
    tensors |= {
        keys.RESPONSE_MASK: loss_mask,
        keys.ROLLOUT_LOG_PROBS: log_probs,
        keys.ENV_REWARDS: torch.tensor([traj.reward(reward_mode) for traj, _ in segments], dtype=torch.float32),
    }
    if versions:
        tensors[keys.TOKEN_POLICY_VERSION] = token_versions
    if batch.batch is not None:
        tensors |= {k: v[rows] for k, v in batch.batch.items() if k not in tensors and k != keys.ATTENTION_MASK}
    non_tensors = {name: column[rows] for name, column in batch.non_tensor_batch.items()}
    if keys.UID not in non_tensors:
        uids = np.array([uuid.uuid4().hex for _ in range(len(batch))], dtype=object)
        non_tensors[keys.UID] = uids[rows]
    texts = tokenizer.batch_decode([seg.response_ids for _, seg in segments], skip_special_tokens=True)
    non_tensors[keys.RESPONSE_TEXT] = np.array(texts, dtype=object)
    meta_info = dict(batch.meta_info)
    meta_info[keys.META_METRICS] = metrics
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)


def trajectory_metrics(trajs: list, reward_mode: str, env_key: str | None = None) -> dict[str, float]:
    """agentic/...: how the trajectories went (success, turns, tokens, tools, errors, template breaks); with
    `env_key` (a run of several environments), also per environment: agentic/env/<name>/... by the row's
    extra_info[env_key] ("default": rows that name none and play `agentic.env`)."""
    if not trajs:
        return {}
    successes = [t.success if t.success is not None else (t.terminated and t.reward(reward_mode) > 0) for t in trajs]
    by_env = {} if env_key is None else _per_environment(trajs, successes, reward_mode, env_key)
    return by_env | {
        "agentic/success_rate": float(np.mean(successes)),
        "agentic/env_reward_mean": float(np.mean([t.reward(reward_mode) for t in trajs])),
        "agentic/turns_mean": float(np.mean([t.conv.turns for t in trajs])),
        # replies given to the environment or the tools (every turn's, the last one's too)
        "agentic/acted_turns_mean": float(np.mean([len(t.rewards) for t in trajs])),
        "agentic/trajectory_tokens_mean": float(np.mean([len(t.conv.current.response_ids) for t in trajs])),
        "agentic/sampled_tokens_mean": sum(t.conv.sampled_tokens for t in trajs) / len(trajs),
        "agentic/truncated_fraction": float(np.mean([t.truncated for t in trajs])),
        "agentic/tool_calls_count": float(sum(t.tool_calls for t in trajs)),
        "agentic/tool_errors_count": float(sum(t.tool_errors for t in trajs)),
        "agentic/tool_reward_mean": float(np.mean([t.tool_reward for t in trajs])),  # stateful tools' share
        "agentic/env_errors_count": float(sum(t.error is not None for t in trajs)),
        "agentic/template_breaks_count": float(sum(t.conv.breaks for t in trajs)),
        "agentic/env_seconds": float(sum(t.env_seconds for t in trajs)),
        # tokens the engine computed to start a turn after the first: its inserted messages + 1 where the
        # trajectory keeps its KV cache (agentic.keep_kv_between_turns), more where only full blocks are reused
        "agentic/later_turn_input_tokens_mean": sum(t.later_turn_input_tokens for t in trajs)
        / max(sum(max(t.conv.turns - 1, 0) for t in trajs), 1),
    }


def _per_environment(trajs: list, successes: list, reward_mode: str, env_key: str) -> dict[str, float]:
    names = [str(t.task["extra_info"].get(env_key, "default")) for t in trajs]
    metrics = {}
    for name in sorted(set(names)):
        mine = [i for i, other in enumerate(names) if other == name]
        metrics |= {
            f"agentic/env/{name}/trajectories_count": float(len(mine)),
            f"agentic/env/{name}/success_rate": float(np.mean([successes[i] for i in mine])),
            f"agentic/env/{name}/env_reward_mean": float(np.mean([trajs[i].reward(reward_mode) for i in mine])),
            f"agentic/env/{name}/turns_mean": float(np.mean([trajs[i].conv.turns for i in mine])),
        }
    return metrics


def tasks_of(batch: DataProto) -> list[dict]:
    """Each prompt row as the task an environment or agent sees: prompt, answer, extra_info."""
    columns = batch.non_tensor_batch
    rows = len(batch)
    pick = lambda name, default: list(columns[name]) if name in columns else [default] * rows  # noqa: E731
    prompts, answers, extras = pick(keys.PROMPT_TEXT, ""), pick(keys.ANSWER, ""), pick(keys.EXTRA_INFO, None)
    return [
        {
            "prompt": plain_prompt(p),
            "answer": "" if a is None else str(a),
            "extra_info": dict(e) if isinstance(e, dict) else {},
        }
        for p, a, e in zip(prompts, answers, extras)
    ]


def plain_prompt(prompt):
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return [dict(message) for message in prompt]
    return str(prompt)


def env_seed(task: dict, base_seed: int | None, row: int) -> int | None:
    """A row's `extra_info.seed`, else one derived from the call's seed and the row (the n samples share it)."""
    seed = task["extra_info"].get("seed")
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return int(seed)
    return None if base_seed is None else (int(base_seed) * 31 + row) % (2**31 - 1)
