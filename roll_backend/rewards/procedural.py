"""The reward of reasoning-gym rows (pipelines.procedural_tasks): the library's own verifier for the row's dataset,
on the response's answer. Use it as a reward function (it runs isolated, like every user function):

    reward:
      functions: [{path: roll_backend.rewards.procedural, name: compute_score}]

The answer is the content of the last <answer>...</answer> tags (reasoning-gym's convention), else of the last
\\boxed{}, else the whole response."""

from __future__ import annotations

from roll_backend.rewards.exact_match import extract_final_answer

EXTRA_INFO_KEY = "reasoning_gym"  # where a row's extra_info holds {"dataset": name, "entry": the library's entry}


def response_answer(response_text: str) -> str:
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response_text, tag_name="answer")
    return tagged if tagged is not None else extract_final_answer(response_text).strip()


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The verifier's score (0..1) of the response for the row's reasoning-gym entry."""
    import reasoning_gym

    task = (extra_info or {}).get(EXTRA_INFO_KEY)
    if task is None:
        raise ValueError(
            f"row of data_source {data_source!r} has no extra_info['{EXTRA_INFO_KEY}']: this reward scores "
            "reasoning-gym rows only (data.reasoning_gym / data.val_reasoning_gym)"
        )
    verify = reasoning_gym.get_score_answer_fn(task["dataset"])
    return float(verify(answer=response_answer(str(solution_str)), entry=task["entry"]))
