"""The Megatron-core backend, one home for all of it. Read from the strategies down:

- `train` / `infer`: the strategies (training with DDP + Megatron's optimizer; forward-only log-probs/values);
- `config`: their configs, the rules they check against the run before Ray starts, and pipeline splits;
- `model_setup`: this rank's model chunks, built (`builder`: HF config -> TransformerConfig, layer specs) and
  loaded from HF files (`convert`, `hf_files`, `moe_convert`); `mtp`, `moe`, `compiled_layers`, `layers`;
- `micro_batches`: fixed, token-budget and packed micro-batches; `cp`: context-parallel slicing;
- `schedule`: the pipelined forward/backward; `log_probs`: vocab-parallel log-probs, entropy and values;
- `weights`: full HF-named weights gathered over TP/EP/PP (weight sync, HF export); `hf_export`: the sharded
  safetensors writer and the *ForSequenceClassification config of a value-head export.
"""
