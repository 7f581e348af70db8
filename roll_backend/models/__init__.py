"""Model building: HF <-> Megatron weight conversion, tiny model and tokenizer builders."""
