"""What a measured memory peak may differ from the plan by beyond a tolerance, for reasons no plan can fix."""

from __future__ import annotations


def collective_hold_bytes(arch, width: int = 4) -> int:
    """A weight sync between ranks: what one collective handed on (a broadcast Hugging Face tensor, or a parameter's
    gathered shards: at most the largest parameter whole) may still be alive while the next parameter is made. Seen
    at PP2 (broadcast) and TP2 (all-gather) in some runs and not others: most likely the process group's worker
    thread, which lets go of a work item's tensors when it retires the item, not when the call returns (NCCL's
    watchdog also keeps a finished collective's tensors until it cleans the work up)."""
    h, moe = arch.hidden_size, arch.moe
    rows = [arch.vocab_size, 2 * arch.ffn_hidden_size, (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim]
    if moe is not None:
        rows += [2 * moe.expert_ffn_hidden_size, 2 * (moe.shared_expert_ffn_hidden_size or 0)]
    return max(rows) * h * width
