"""The vLLM backend: `config` (engine and sampling settings, run rules), `rollout` (the strategy), `weight_sync`
(loading new weights into a running engine)."""
