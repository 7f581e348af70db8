"""RewardModelWorker (Megatron forward-only with a value head on Ray): a trained Hugging Face reward model
(Qwen2/LlamaForSequenceClassification) scores as transformers does at TP1, TP2 and PP2; one score per sequence,
read at the last response token, placed there in TOKEN_LEVEL_SCORES, and unaffected by padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roll_backend import keys
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.models.tiny import TinyModelSpec, build_tiny_reward_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronInferConfig
from roll_backend.workers.reward_model import RewardModelConfig, RewardModelWorker

PROMPT_LEN, RESPONSE_LEN = 6, 5


@pytest.fixture(scope="module")
def reward_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny Qwen2 and Llama *ForSequenceClassification checkpoints standing in for trained reward models."""
    root = tmp_path_factory.mktemp("reward_models")
    return {
        kind: str(build_tiny_reward_model(root / kind, TinyModelSpec(seed=3), model_type=kind))
        for kind in ("qwen2", "llama")
    }


def start_reward_model(make_group, model_dir: str, layout: ParallelLayout):
    config = RewardModelConfig(
        strategy=MegatronInferConfig(
            model_path=model_dir, micro_batch_size=2, value_head=True, value_head_init="score_head"
        )
    )
    group = make_group(RewardModelWorker, layout.tp * layout.pp, layout, role="reward_model", worker_config=config)
    group.call(RewardModelWorker.init_model)
    return group


@pytest.fixture(scope="module")
def reward_model(make_group, reward_model_dirs):
    return start_reward_model(make_group, reward_model_dirs["qwen2"], ParallelLayout(tp=2))


def layout_rows(
    rows: list[tuple[list[int], list[int]]], prompt_len=PROMPT_LEN, response_len=RESPONSE_LEN, pad_id=0
) -> DataProto:
    """(prompt ids, response ids) pairs in the rollout layout: left-padded prompts, right-padded responses."""
    b = len(rows)
    prompts, responses = torch.full((b, prompt_len), pad_id), torch.full((b, response_len), pad_id)
    prompt_mask, response_mask = (
        torch.zeros(b, prompt_len, dtype=torch.long),
        torch.zeros(b, response_len, dtype=torch.long),
    )
    for i, (prompt, response) in enumerate(rows):
        prompts[i, prompt_len - len(prompt) :], prompt_mask[i, prompt_len - len(prompt) :] = torch.tensor(prompt), 1
        responses[i, : len(response)], response_mask[i, : len(response)] = torch.tensor(response), 1
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    return DataProto.from_dict(
        tensors={
            keys.PROMPTS: prompts,
            keys.RESPONSES: responses,
            keys.INPUT_IDS: torch.cat([prompts, responses], dim=1),
            keys.ATTENTION_MASK: attention,
            keys.POSITION_IDS: (attention.cumsum(1) - 1).clamp(min=0),
            keys.RESPONSE_MASK: response_mask,
        }
    )


ROWS = [
    ([5, 6, 7], [8, 9, 10, 2]),
    ([11, 12, 13, 14, 15, 16], [17]),
    ([20], [21, 22, 23, 24, 25]),
    ([30, 31], [32, 33]),
]


@pytest.mark.parametrize(
    "kind,layout",
    [
        ("qwen2", ParallelLayout(tp=2)),
        ("qwen2", ParallelLayout(tp=1)),
        ("qwen2", ParallelLayout(pp=2)),
        ("llama", ParallelLayout(tp=1)),
    ],
    ids=["qwen2-tp2", "qwen2-tp1", "qwen2-pp2", "llama-tp1"],
)
def test_trained_reward_model_scores_equal_transformers(make_group, reward_model_dirs, kind, layout):
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_dirs[kind], dtype=torch.float32).eval()
    with torch.no_grad():  # one unpadded sequence at a time: transformers reads its last (non-pad) token
        expected = torch.tensor(
            [float(hf(torch.tensor([prompt + response])).logits[0, 0]) for prompt, response in ROWS]
        )
    group = start_reward_model(make_group, reward_model_dirs[kind], layout)
    scores = group.call(RewardModelWorker.compute_rewards, layout_rows(ROWS)).batch[keys.SEQUENCE_SCORES]
    assert expected.std() > 0.05  # the score head is not ~0: a missing head load would show
    assert torch.allclose(scores, expected, atol=1e-5, rtol=0), (scores, expected)


def test_sequence_scores_on_the_last_response_token(reward_model):
    out = reward_model.call(RewardModelWorker.compute_rewards, layout_rows(ROWS))
    scores, token_level = out.batch[keys.SEQUENCE_SCORES], out.batch[keys.TOKEN_LEVEL_SCORES]
    assert scores.shape == (len(ROWS),) and token_level.shape == (len(ROWS), RESPONSE_LEN)
    assert torch.isfinite(scores).all() and scores.std() > 0
    for row, (_, response) in enumerate(ROWS):
        assert token_level[row, len(response) - 1] == scores[row]
        assert torch.count_nonzero(token_level[row]) <= 1


def test_scores_ignore_padding_and_depend_on_the_last_token(reward_model):
    base = reward_model.call(RewardModelWorker.compute_rewards, layout_rows(ROWS)).batch[keys.SEQUENCE_SCORES]
    # The same sequences with wider padding on both sides.
    wider = reward_model.call(
        RewardModelWorker.compute_rewards, layout_rows(ROWS, prompt_len=PROMPT_LEN + 3, response_len=RESPONSE_LEN + 2)
    )
    assert torch.allclose(wider.batch[keys.SEQUENCE_SCORES], base, atol=1e-5)
    # Garbage in the padded tail is not read ...
    tail_garbage = layout_rows(ROWS)
    tail = tail_garbage.batch[keys.RESPONSE_MASK] == 0
    tail_garbage.batch[keys.RESPONSES] = tail_garbage.batch[keys.RESPONSES].masked_fill(tail, 99)
    tail_garbage.batch[keys.INPUT_IDS] = torch.cat(
        [tail_garbage.batch[keys.PROMPTS], tail_garbage.batch[keys.RESPONSES]], dim=1
    )
    assert torch.allclose(
        reward_model.call(RewardModelWorker.compute_rewards, tail_garbage).batch[keys.SEQUENCE_SCORES], base, atol=1e-5
    )
    # ... while the last real token is.
    changed = [(prompt, response[:-1] + [response[-1] + 40]) for prompt, response in ROWS]
    moved = reward_model.call(RewardModelWorker.compute_rewards, layout_rows(changed)).batch[keys.SEQUENCE_SCORES]
    assert (moved - base).abs().min() > 1e-6


# ---- a reward model with its own tokenizer and chat template ---------------------------------------------------

OTHER_TEMPLATE = (  # not the policy's Qwen-style template: plain role headers, no special tokens around turns
    "{% for message in messages %}{{ message['role'] | upper + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}"
)
CONVERSATIONS = [  # (prompt as the policy saw it, the response text the policy wrote)
    ([{"role": "system", "content": "be brief."}, {"role": "user", "content": "copy 7"}], "7"),
    ([{"role": "user", "content": "add 12 and 30"}], "it is 42"),
    ("copy 3", ""),  # a raw-text prompt and an empty response
    ([{"role": "user", "content": "say the longest word you know"}], "pneumonoultramicroscopic"),
]


@pytest.fixture(scope="module")
def other_tokenizer_reward_model(tmp_path_factory) -> str:
    """A BPE reward model (the policy's tokenizer is a char one) whose chat template is another than the policy's."""
    import json

    folder = build_tiny_reward_model(tmp_path_factory.mktemp("rm_bpe") / "rm", TinyModelSpec(seed=5, tokenizer="bpe"))
    config_file = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["chat_template"] = OTHER_TEMPLATE
    config_file.write_text(json.dumps(tokenizer_config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return str(folder)


def test_a_reward_model_with_another_tokenizer_scores_the_decoded_responses_as_transformers(
    make_group, other_tokenizer_reward_model
):
    import numpy as np
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from roll_backend.config.model_folders import same_tokenizer
    from roll_backend.models.tiny import build_char_tokenizer
    from roll_backend.rewards.retemplate import as_messages

    rm_tokenizer = AutoTokenizer.from_pretrained(other_tokenizer_reward_model)
    assert rm_tokenizer.chat_template == OTHER_TEMPLATE
    hf = AutoModelForSequenceClassification.from_pretrained(other_tokenizer_reward_model, dtype=torch.float32).eval()
    with torch.no_grad():  # the whole conversation as the reward model's template renders it, scored at its end
        expected = torch.tensor(
            [
                float(
                    hf(
                        torch.tensor(
                            [
                                rm_tokenizer.apply_chat_template(
                                    [*as_messages(prompt), {"role": "assistant", "content": text}], tokenize=True
                                )["input_ids"]
                            ]
                        )
                    ).logits[0, 0]
                )
                for prompt, text in CONVERSATIONS
            ]
        )
    # The policy's rows: its own (char) token ids, which the reward model must not read.
    policy = build_char_tokenizer()
    rows = [
        (policy.encode(str(prompt), add_special_tokens=False)[:6] or [1], policy.encode(text)[:5] or [2])
        for prompt, text in CONVERSATIONS
    ]
    batch = layout_rows(rows)
    prompts = np.empty(len(CONVERSATIONS), dtype=object)
    prompts[:] = [prompt for prompt, _ in CONVERSATIONS]
    batch.non_tensor_batch[keys.PROMPT_TEXT] = prompts
    batch.non_tensor_batch[keys.RESPONSE_TEXT] = np.array([text for _, text in CONVERSATIONS], dtype=object)
    config = RewardModelConfig(
        strategy=MegatronInferConfig(
            model_path=other_tokenizer_reward_model, micro_batch_size=2, value_head=True, value_head_init="score_head"
        ),
        retemplate=True,
    )
    group = make_group(RewardModelWorker, 2, ParallelLayout(tp=2), role="reward_model", worker_config=config)
    group.call(RewardModelWorker.init_model)
    out = group.call(RewardModelWorker.compute_rewards, batch)
    assert expected.std() > 0.05
    assert torch.allclose(out.batch[keys.SEQUENCE_SCORES], expected, atol=1e-5, rtol=0)
    # Scores land on the policy's rows: the last token of each policy response.
    token_level = out.batch[keys.TOKEN_LEVEL_SCORES]
    assert token_level.shape == batch.batch[keys.RESPONSE_MASK].shape
    for row, (_, response) in enumerate(rows):
        assert token_level[row, len(response) - 1] == out.batch[keys.SEQUENCE_SCORES][row]
    # The driver tells the two tokenizers apart (the same-tokenizer fast path stays for equal ones).
    policy_dir = Path(other_tokenizer_reward_model).parent / "policy_tokenizer"
    policy.save_pretrained(policy_dir)
    assert not same_tokenizer(str(policy_dir), other_tokenizer_reward_model)
    assert same_tokenizer(other_tokenizer_reward_model, other_tokenizer_reward_model)
