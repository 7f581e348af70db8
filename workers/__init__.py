"""Ray actor classes, one per role: actor, critic, reference, reward, reward model, rollout. Each role calls its
strategy and never imports Megatron or vLLM itself; the driver runs a role method on every rank with
`group.call(RoleWorker.method, ...)`."""
