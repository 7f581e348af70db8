"""Ray actor classes, one per role: actor, critic, reference, reward, rollout."""
