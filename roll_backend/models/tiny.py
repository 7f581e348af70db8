"""Build a tiny random Qwen-family model (Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) and a locally trained tokenizer:
no model hub needed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the end-of-turn token, used as EOS

DEFAULT_CHAR_ALPHABET = "0123456789 abcdefghijklmnopqrstuvwxyz+-*=?:.,"

# Qwen2-style chat template: the model answers after "<|im_start|>assistant\n" and ends with <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


MODEL_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny Qwen-family model (GQA, RoPE, SwiGLU, RMSNorm).

    `family`: "qwen2" (qkv bias), "qwen3" (q/k RMSNorm, no bias), "qwen2_moe" (qkv bias, routed experts plus a
    gated shared expert), "qwen3_moe" (q/k RMSNorm, top-k routing with `norm_topk_prob`, no shared expert).
    The expert fields apply to the MoE families only.
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    vocab_size: int = 320  # target size for the tokenizer's BPE training (tokenizer="bpe")
    # The model's vocabulary (embedding rows) when it should be larger than the tokenizer's, as real models pad
    # theirs (Qwen2.5: 151936 rows for 151665 tokens); None: the tokenizer's size.
    model_vocab_size: int | None = None
    seed: int = 0
    # "bpe": byte-level BPE trained on the corpus. "char": one token per character of `char_alphabet` (plus
    # the chat template's characters): a vocabulary of a few dozen, so a random model samples the right
    # token often enough for RL to find it (the demo's choice).
    tokenizer: str = "bpe"
    char_alphabet: str = DEFAULT_CHAR_ALPHABET
    family: str = "qwen2"
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    # Std of the random weights (transformers' default 0.02). At 0.02 the lm_head rows are so short that the logits,
    # read through the final RMSNorm, stay within about +-1.3 whatever the layers below compute: only training the
    # lm_head (or the norm) makes the model sure of a token. A LoRA run trains neither, so its base needs a larger
    # std, as a pretrained model's output layer has (configs/grpo_lora_cpu.yaml).
    initializer_range: float = 0.02
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 64  # qwen2_moe only
    router_aux_loss_coef: float = 0.01

    def __post_init__(self):
        if self.family not in MODEL_FAMILIES:
            raise ValueError(
                f"TinyModelSpec.family={self.family!r} is unknown; choose one of {', '.join(MODEL_FAMILIES)}."
            )


def default_corpus() -> list[str]:
    """A small synthetic corpus (arithmetic and words) to train the BPE merges on."""
    words = "the answer is what plus minus times add copy reverse count sum number digits letters"
    lines = [words]
    for a in range(30):
        for b in range(0, 30, 3):
            lines.append(f"what is {a} + {b}? the answer is {a + b}.")
            lines.append(f"{a} * {b} = {a * b}; {a} - {b} = {a - b}")
    return lines


def _as_transformers_tokenizer(tok):
    """Wrap a `tokenizers.Tokenizer` with our pad/eos tokens and chat template (left padding for prompts)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def build_tokenizer(vocab_size: int = 320, corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer locally; returns a PreTrainedTokenizerFast with pad/eos and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [PAD_TOKEN, IM_START, IM_END]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(
            f"vocab_size={vocab_size} is below the byte alphabet plus specials ({len(alphabet) + len(specials)}); "
            "raise it."
        )
    # Byte-level BPE (GPT-2/Qwen style): every string round-trips, which vLLM's detokenizer relies on.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus or default_corpus(), trainer=trainer)
    return _as_transformers_tokenizer(tok)


def build_char_tokenizer(alphabet: str = DEFAULT_CHAR_ALPHABET):
    """A byte-level tokenizer with one token per character of `alphabet` (plus the chat template's characters) and
    no merges.

    Same pipeline as `build_tokenizer` (byte-level BPE, pad/eos, chat template), just no merges and a tiny
    vocabulary: transformers 5 reloads a qwen2 model's tokenizer as `Qwen2Tokenizer`, which rebuilds a
    byte-level BPE from the vocabulary, so only this shape survives save/load unchanged. Characters outside
    the alphabet are dropped when encoding (byte-level BPE without an unknown token); keep prompts inside it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    template_chars = "user" + "assistant" + "system" + "\n"
    byte_to_unicode = {chr(code): mapped for code, mapped in zip(range(256), _byte_level_chars())}
    chars = sorted(set(alphabet) | set(template_chars))
    not_single_byte = [char for char in chars if char not in byte_to_unicode]
    if not_single_byte:
        raise ValueError(
            f"char_alphabet has characters outside Latin-1 {not_single_byte!r}; use single-byte characters."
        )
    specials = [PAD_TOKEN, IM_START, IM_END]
    vocab = {token: index for index, token in enumerate(specials + [byte_to_unicode[char] for char in chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return _as_transformers_tokenizer(tok)


def _byte_level_chars() -> list[str]:
    """The printable stand-in of each byte 0..255 that byte-level BPE (GPT-2) uses in its vocabulary."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapped, extra = {}, 0
    for code in range(256):
        if code in printable:
            mapped[code] = chr(code)
        else:
            mapped[code] = chr(256 + extra)
            extra += 1
    return [mapped[code] for code in range(256)]


def tokenizer_for(spec: TinyModelSpec, corpus: list[str] | None = None):
    """The tokenizer `spec.tokenizer` names: "bpe" (trained on `corpus`) or "char"."""
    if spec.tokenizer == "bpe":
        return build_tokenizer(spec.vocab_size, corpus)
    if spec.tokenizer == "char":
        return build_char_tokenizer(spec.char_alphabet)
    raise ValueError(f"TinyModelSpec.tokenizer={spec.tokenizer!r} is unknown; choose 'bpe' or 'char'.")


def _hf_config(spec: TinyModelSpec, tokenizer):
    """The transformers config of `spec` for its family (float32, default RoPE)."""
    from transformers import AutoConfig

    if spec.model_vocab_size is not None and spec.model_vocab_size < len(tokenizer):
        raise ValueError(
            f"TinyModelSpec.model_vocab_size={spec.model_vocab_size} is below the tokenizer's {len(tokenizer)} tokens; "
            "raise it or leave it None"
        )
    common = dict(
        vocab_size=spec.model_vocab_size or len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        initializer_range=spec.initializer_range,
    )
    if spec.family != "qwen2":
        common["head_dim"] = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    if spec.family.endswith("_moe"):
        common.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            router_aux_loss_coef=spec.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=spec.family == "qwen3_moe",
        )
    if spec.family == "qwen2_moe":
        common["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size
    return AutoConfig.for_model(spec.family, **common)


def build_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), corpus: list[str] | None = None
) -> Path:
    """Write a random-init model of `spec.family` (float32, safetensors) and its tokenizer to `out_dir`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    tokenizer = tokenizer_for(spec, corpus)
    config = _hf_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_tiny_reward_model(
    out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), model_type: str = "qwen2"
) -> Path:
    """Write a random-init Qwen2ForSequenceClassification or LlamaForSequenceClassification with one label (a
    scalar reward: the shape of a trained reward model, score head included) and its tokenizer to `out_dir`."""
    import dataclasses

    from transformers import AutoModelForSequenceClassification, LlamaConfig

    if model_type not in ("qwen2", "llama"):
        raise ValueError(f"model_type={model_type!r}; choose qwen2 or llama")
    tokenizer = tokenizer_for(spec)
    config = _hf_config(dataclasses.replace(spec, family="qwen2"), tokenizer)
    if model_type == "llama":  # the same shape without qkv bias
        shared = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "tie_word_embeddings",
            "rms_norm_eps",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        )
        config = LlamaConfig(**{key: getattr(config, key) for key in shared}, torch_dtype="float32")
    config.num_labels = 1
    torch.manual_seed(spec.seed)
    model = AutoModelForSequenceClassification.from_config(config).to(torch.float32)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # scores of order 1, not the init's ~0.02
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
