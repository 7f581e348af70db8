"""What a model folder holds, for the checks before a run: a full Hugging Face folder (config.json, weights,
tokenizer) or only the model's config.json, the description a recipe is checked against away from the machine that
runs it (`roll-backend validate`); and what such a recipe check leaves unchecked."""

from __future__ import annotations

from pathlib import Path

from roll_backend import roles
from roll_backend.config.schema import PipelineConfig

# A model folder's tokenizer: any of the files transformers' AutoTokenizer reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# A model folder's weights (the Megatron strategies load safetensors; the other formats still mean "has weights").
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth")


def describes_only(model_path: str) -> bool:
    """A folder holding a model's config.json and neither weights nor a tokenizer: the model's description (as kept
    beside the GPU recipes in configs/gpu/models/), enough to check layouts against but not to run."""
    folder = Path(model_path) if model_path else None
    return (
        folder is not None
        and (folder / "config.json").is_file()
        and not any((folder / name).is_file() for name in TOKENIZER_FILES)
        and not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES)
    )


def same_tokenizer(path: str, other: str) -> bool:
    """Whether two model folders tokenize alike: the same vocabulary, special tokens and chat template (so one
    model's token ids mean the same text to the other)."""
    from transformers import AutoTokenizer

    if Path(path).resolve() == Path(other).resolve():
        return True
    first, second = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(other)
    return (
        first.get_vocab() == second.get_vocab()
        and first.all_special_ids == second.all_special_ids
        and first.chat_template == second.chat_template
    )


def data_files(config: PipelineConfig) -> list[str]:
    """The prompt files the run reads: data.train_path (one file or a mixture's) and data.val_path."""
    train = config.data.train_path
    files = [train] if isinstance(train, str) else [source.path for source in train or ()]
    return [*files, *config.data.val_paths()]


def skipped_checks(config: PipelineConfig) -> list[str]:
    """What a recipe check (`validate(config, recipe_check=True)`) left unchecked on this machine: the tokenizer and
    weights of each model folder that only describes its model and, when model_path is one, the prompts (missing
    files, and the rows of all: there is no tokenizer to encode them with). Empty for a config that can run here."""
    role_paths = [role.model_path for role in (getattr(config, name) for name in roles.MODEL_ROLES) if role]
    described = [path for path in dict.fromkeys([config.model_path, *role_paths]) if describes_only(path)]
    notes = [
        f"the tokenizer and weights of {path!r}, which holds only config.json (the layouts were checked against "
        "it; `run` needs the full model folder)"
        for path in described
    ]
    if config.model_path in described:
        missing = [path for path in data_files(config) if not Path(path).exists()]
        if missing:
            notes.append(f"the data files missing here: {', '.join(missing)}")
        notes.append("the prompt rows (there is no tokenizer here to encode them)")
    return notes
