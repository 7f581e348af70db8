"""Models that are not a backend: the tiny HF model and tokenizer builders (tests, demos, benchmarks)."""
