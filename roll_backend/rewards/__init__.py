"""Rewards: rule-based (math verification, exact match, format) and reward-model scoring."""
