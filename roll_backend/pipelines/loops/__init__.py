"""The control loops: one RL step (sync), one-step off-policy, streaming, the offline trainers, and the phases
they share (generate, score, reference, advantages, train, sync)."""
