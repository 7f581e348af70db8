"""The ready recipes under configs/ (every YAML there, so a new one is covered at once) pass `roll-backend validate`,
run in-process through the CLI's own entry: the CPU ones as they are, the GPU ones (configs/gpu/) against the model's
Hugging Face config.json kept in configs/gpu/models/<model_path's folder name>/, with no GPU, weights, tokenizer or
prompt files on this machine. A layout that does not fit the model is reported naming the key and the model's own
numbers, so that config.json is really read; and only validate accepts such a folder, only when it holds nothing but
config.json. No Ray, no model runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from roll_backend import cli
from roll_backend.config.loader import load_config, resolve_yaml
from roll_backend.config.typed import ConfigError

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs"
GPU_RECIPES = CONFIGS / "gpu"
MODELS = GPU_RECIPES / "models"
RECIPES = sorted(CONFIGS.rglob("*.yaml"))
GPU = [recipe for recipe in RECIPES if GPU_RECIPES in recipe.parents]
SKIPPED = "roll-backend validate: not checked here:"


def recipe_id(recipe: Path) -> str:
    return str(recipe.relative_to(CONFIGS))


def model_folder(recipe: Path) -> Path:
    """The folder a GPU recipe is checked against: configs/gpu/models/<the name of its model_path's folder>."""
    folder = MODELS / Path(resolve_yaml(recipe)["model_path"]).name
    assert (folder / "config.json").is_file(), f"{recipe_id(recipe)}: keep the model's config.json in {folder}"
    return folder


def validate(recipe: Path, capsys, *overrides: str) -> tuple[int, str, str]:
    code = cli.main(["validate", str(recipe), *overrides])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_recipes_are_found():
    names = {recipe_id(recipe) for recipe in RECIPES}
    assert {"ppo_critic_cpu.yaml", "grpo_async_cpu.yaml", "grpo_moe_ep_cpu.yaml"} <= names
    assert {"gpu/qwen2.5-7b_grpo_8gpu.yaml", "gpu/qwen3-30b-a3b_grpo_ep_16gpu.yaml"} <= names


def chained_inputs(recipe: Path, tmp_path: Path) -> list[str]:
    """Overrides for what a recipe reads from another recipe's run: ppo_reward_model_cpu.yaml scores with the reward
    model reward_model_cpu.yaml exports, grpo_distill_cpu.yaml learns from the model sft_cpu.yaml exports; tiny ones
    with the same tokenizer stand in (the validator compares their vocabularies and reads the score head)."""
    tree = resolve_yaml(recipe)
    if recipe in GPU:
        return []
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model

    overrides = []
    if tree.get("reward_model") is not None:
        spec = TinyModelSpec(**tree["build_tiny_model"])
        overrides.append(f"reward_model.model_path={build_tiny_reward_model(tmp_path / 'reward_model', spec)}")
    if tree.get("teacher") is not None:  # (grpo_distill_cpu.yaml: the model sft_cpu.yaml fine-tunes)
        spec = TinyModelSpec(**tree["build_tiny_model"])
        overrides.append(f"teacher.model_path={build_tiny_model(tmp_path / 'teacher', spec)}")
    return overrides


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_every_recipe_validates(recipe, tmp_path, capsys):
    on_gpus = recipe in GPU
    overrides = [f"output_dir={tmp_path}", *([f"model_path={model_folder(recipe)}"] if on_gpus else [])]
    overrides += chained_inputs(recipe, tmp_path)
    code, out, err = validate(recipe, capsys, *overrides)
    assert code == cli.EXIT_OK, err
    assert f"output_dir: {tmp_path}" in out
    assert "roll-backend validate: memory plan: actor_train's devices peak at" in err  # (`plan` prints the rest)
    if on_gpus:  # what config.json alone cannot answer is named, not silently passed
        assert f"{SKIPPED} the tokenizer and weights of '{model_folder(recipe)}', which holds only config.json" in err
    else:
        assert SKIPPED not in err


@pytest.mark.parametrize("recipe", GPU, ids=recipe_id)
def test_a_layout_that_does_not_fit_the_model_names_the_key(recipe, capsys):
    """A TP size that does not divide the model's attention heads (and, for a MoE model, an EP size that does not
    divide its experts) is refused with the model's numbers: they come from the recipe's config.json."""
    folder = model_folder(recipe)
    fields = json.loads((folder / "config.json").read_text())
    heads = fields["num_attention_heads"]
    tp = next(size for size in range(2, heads) if heads % size)
    overrides = [f"model_path={folder}", f"actor_train.strategy.tp={tp}"]
    expected = [f"actor_train.strategy.tp={tp} does not divide num_attention_heads={heads}"]
    if fields.get("num_experts"):
        experts = fields["num_experts"]
        ep = next(size for size in range(2, experts) if experts % size)
        overrides.append(f"actor_train.strategy.ep={ep}")
        expected.append(f"actor_train.strategy.ep={ep} does not divide num_experts={experts}")
    code, out, err = validate(recipe, capsys, *overrides)
    assert code == cli.EXIT_USAGE and out == ""
    for message in expected:
        assert message in err, err


@pytest.mark.parametrize("recipe", GPU, ids=recipe_id)
def test_only_validate_accepts_a_folder_holding_only_config_json(recipe, tmp_path, capsys):
    """`run` (load_config without recipe_check) still needs the tokenizer and the data; and a folder that holds
    weights or a tokenizer is a model folder, checked in full by validate as well."""
    folder = model_folder(recipe)
    with pytest.raises(ConfigError) as info:
        load_config(recipe, [f"model_path={folder}"])
    assert f"model_path='{folder}' has no tokenizer" in str(info.value)
    assert "does not exist" in str(info.value)  # the recipe's prompt files are not on this machine

    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    shutil.copy(folder / "config.json", weights_only)
    (weights_only / "model.safetensors").write_bytes(b"")
    code, _, err = validate(recipe, capsys, f"model_path={weights_only}")
    assert code == cli.EXIT_USAGE and f"model_path='{weights_only}' has no tokenizer" in err, err

    with_tokenizer = tmp_path / "with_tokenizer"
    with_tokenizer.mkdir()
    shutil.copy(folder / "config.json", with_tokenizer)
    (with_tokenizer / "tokenizer_config.json").write_text("{}")
    code, _, err = validate(recipe, capsys, f"model_path={with_tokenizer}")
    train_path = resolve_yaml(recipe)["data"]["train_path"]
    assert code == cli.EXIT_USAGE and f"data.train_path={train_path!r} does not exist" in err, err


def test_the_console_script_validates_a_gpu_recipe_on_a_machine_without_gpus():
    recipe = GPU_RECIPES / "qwen3-30b-a3b_grpo_ep_16gpu.yaml"
    folder = model_folder(recipe)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "roll-backend"), "validate", str(recipe), f"model_path={folder}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "num_gpus_per_rank: 0.5" in done.stdout and "ep: 8" in done.stdout
    assert f"{SKIPPED} the data files missing here: data/math/train.parquet, data/math/test500.parquet" in done.stderr


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_every_recipe_has_a_memory_plan(recipe, tmp_path, capsys):
    """`roll-backend plan` plans every model role of every recipe; a GPU recipe's declared devices fit every phase
    (its validation checks that too), and the numbers its comments state are the plan's."""
    overrides = [f"output_dir={tmp_path}", *([f"model_path={model_folder(recipe)}"] if recipe in GPU else [])]
    code = cli.main(["plan", str(recipe), *overrides, *chained_inputs(recipe, tmp_path)])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK, err
    tree = resolve_yaml(recipe)
    for name in ("actor_train", "actor_infer", "reference", "critic", "reward_model", "teacher"):
        if tree.get(name) is not None and not tree[name].get("from_actor_base"):  # (that one runs on the actor)
            assert f"\n{name} (" in out, out
    assert "not planned" not in out and "DOES NOT FIT" not in out, out
    if recipe in GPU:
        assert tree["device_memory_gib"] and "fits" in out
        stated = stated_figures(recipe.read_text())
        assert stated, f"{recipe_id(recipe)} states no figure of its plan"
        sections, device_totals = plan_sections(out)
        for role, figure in stated:
            # a role's figure is one of that role's terms, or the total of its devices or of its phase on a device
            totals = [line for line in device_totals.splitlines() if f"{role}'s devices" in line or f" {role} " in line]
            assert figure in sections[role] or any(figure in line for line in totals), (
                f"{recipe_id(recipe)} states {figure} (plan) for {role}; the plan says:\n{out}"
            )


MODEL_ROLES = ("actor_train", "actor_infer", "reference", "critic", "reward_model", "teacher")
_ROLE_LINE = re.compile(rf"^#\s+(?:GPUs [0-9-]+\s+)?({'|'.join(MODEL_ROLES)}):")


def stated_figures(recipe_text: str) -> list[tuple[str, str]]:
    """(role, "40.94 GiB") for each "... 40.94 GiB (plan) ..." of a recipe's comments, under the role whose placement
    line ("#   actor_train: ...") it follows."""
    stated, role = [], None
    for line in recipe_text.splitlines():
        if not line.startswith("#"):
            continue
        if match := _ROLE_LINE.match(line):
            role = match.group(1)
        for figure in re.findall(r"([0-9.]+ [GMK]iB) \(plan\)", line):
            assert role is not None, f"{figure} (plan) stated before any role's placement line: {line}"
            stated.append((role, figure))
    return stated


def plan_sections(out: str) -> tuple[dict[str, str], str]:
    """`roll-backend plan`'s output split into each role's lines and the per-device lines after them."""
    body, _, device_totals = out.partition("\nper device, by phase")
    sections = dict.fromkeys(MODEL_ROLES, "")
    role = None
    for line in body.splitlines():
        role = next((name for name in MODEL_ROLES if line.startswith(f"{name} (")), role)
        if role is not None:
            sections[role] += line + "\n"
    return sections, device_totals


@pytest.mark.parametrize("recipe", GPU, ids=recipe_id)
def test_a_gpu_recipe_on_smaller_devices_is_refused_naming_the_largest_terms(recipe, capsys):
    code, out, err = validate(recipe, capsys, f"model_path={model_folder(recipe)}", "device_memory_gib=16")
    assert code == cli.EXIT_USAGE and out == ""
    assert "over device_memory_gib=16; largest: actor_train" in err and "to shrink them: actor_train.strategy:" in err
