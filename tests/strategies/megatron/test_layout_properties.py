"""Layout independence as a property of every shape (issue #28). Each example is a model shape and a batch; at TP1
(micro-batches of 2 rows) it gives the reference numbers, and TP2, PP2, TP2 x PP2, CP2, PP2 x vpp2, EP2 (two
data-parallel ranks, over which a MoE model splits its experts; also with micro-batches cut by a token budget and
packed, so the two ranks' micro-batches differ in number and shape) and TP1 with micro-batches of one row must give the
same, for the actor and for a critic (value head) on the same model, wherever the builder accepts the layout (vpp
needs the layers to split into chunks; the skipped layouts are printed), and a dense model at
TP2 x PP2 with sequence parallelism (the GPU default; a MoE model takes it at TP2 anyway):
- log-probs and entropy (values) before the step;
- every metric the step reports (loss, pg_loss, entropy, kl_loss, ppo_kl, pg_clipfrac, mtp_loss, grad_norm; loss,
  vf_loss, vf_clipfrac, grad_norm);
- log-probs (values) after the step, which must have moved them;
- for the actor, a checkpoint saved at TP1 after the step and loaded at TP2 x PP2, PP2 x vpp2 and EP2: the
  same log-probs, and the same next step (the optimizer state moved too).
The first two examples are the case the issue found (vocabulary 1001, which TP2 pads, 4 layers, MTP; untied and
tied); the others are drawn from a seeded generator over vocabulary size (divisible by TP or not), tied or untied
embeddings, the MLP's width (2, 3 or 5 times the hidden size), a Qwen3 model's head width (hidden / heads, or twice
that as Qwen3's own models have), layer counts that split evenly or not, GQA ratio, qkv
bias (qwen2) or q/k norms (qwen3), dense or MoE (qwen2_moe with a shared expert, qwen3_moe; without the
load-balancing loss, a per-micro-batch objective that the split moves by Megatron's design), MTP on or off, full
training or LoRA (every other drawn example: adapters on every projection, MTP layers' and experts' included; a MoE
model's at TP2 under sequence parallelism), and batches of left-padded prompts and right-padded responses with odd
widths and nearly empty rows, some of them multi-turn (an observation inside the response: attended, out of the
loss). A failing example is named with its whole shape; ROLL_BACKEND_PROPERTY_SEED / ROLL_BACKEND_PROPERTY_EXAMPLES
draw others.

Tolerances are derived from float32 rounding, not picked: a value computed two ways in float32 may differ by a few
units in the last place of the largest magnitude it went through (`float32_bound`). The step adds the rounding
of the update: Adam moves each weight by about lr, with a relative rounding of the gradient direction; its effect
on log-probs is bounded by the step's own effect on them times a small multiple of float32 epsilon per layer
(`after_step_bound`). The issue's MTP error (~1e-3 in the MTP loss) is about 20 times these bounds, and fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch
from megatron_batches import after_step_bound, float32_bound, rl_batch_of_lengths
from reconfigurable_workers import ReconfigurableActor

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import (
    LoRASettings,
    MegatronTrainConfig,
    OptimizerSettings,
)
from roll_backend.strategies.megatron.stage_splits import default_stage_split
from roll_backend.workers.actor import ActorConfig, ActorLossConfig
from roll_backend.workers.critic import CriticConfig, CriticLossConfig

SEED = int(os.environ.get("ROLL_BACKEND_PROPERTY_SEED", "2811"))
RANDOM_EXAMPLES = int(os.environ.get("ROLL_BACKEND_PROPERTY_EXAMPLES", "6"))
LR = 1e-3
WIDER = 9  # padding columns added in the `tp1_wider` run: more padding per micro-batch must change nothing
ROUTER_METRICS = ("moe/expert_load_min", "moe/expert_load_max", "moe/expert_load_imbalance")
AUX_METRICS = ("moe/load_balancing_loss", "moe/aux_loss")
# Token-budget and packed micro-batches at EP2, where the DP ranks' micro-batches must still line up for the
# experts' token exchange: budgets below most rows' lengths give the two ranks different counts and widths.
EXPERT_BATCHING = {
    "budget": {keys.META_MAX_TOKENS_PER_MICROBATCH: 16},
    "packed": {keys.META_MAX_TOKENS_PER_MICROBATCH: 12, keys.META_SEQUENCE_PACKING: True},
}


@dataclasses.dataclass(frozen=True)
class Example:
    family: str
    vocab_size: int
    tied: bool
    layers: int
    kv_heads: int
    mtp: int
    rows: int
    prompt_width: int
    response_width: int
    seed: int
    # Megatron's load-balancing loss is a per-micro-batch objective: another split moves it by design, so the
    # examples run without it and test_moe_load_balancing_loss_is_layout_independent adds it.
    aux_loss_coef: float = 0.0
    lora: bool = False  # LoRA adapters on every projection (MTP layers' and experts' too) instead of full training
    ffn_ratio: int = 2  # the dense MLP's width over the hidden size (Qwen2.5 models: 5.3 at 7B, 5.4 at 0.5B)
    # A head's width where it is not hidden / heads: Qwen3 models' heads are wider than that (Qwen3-30B-A3B: 32 heads
    # of 128 over a hidden size of 2048), so attention's projections are not square.
    head_dim: int | None = None

    def spec(self) -> TinyModelSpec:
        return TinyModelSpec(
            hidden_size=64,
            intermediate_size=64 * self.ffn_ratio,
            num_hidden_layers=self.layers,
            num_attention_heads=4,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            model_vocab_size=self.vocab_size,
            tie_word_embeddings=self.tied,
            family=self.family,
            seed=self.seed,
            router_aux_loss_coef=self.aux_loss_coef,
        )

    @property
    def moe(self) -> bool:
        return self.family.endswith("_moe")


def examples() -> list[Example]:
    issue_case = Example("qwen2", 1001, False, 4, 2, 1, 6, 7, 5, 0)
    drawn, rng = [], random.Random(SEED)
    head_dims = random.Random(f"{SEED}-head_dim")  # (its own generator: the other fields are drawn as before)
    for index in range(RANDOM_EXAMPLES):
        drawn.append(
            Example(
                family=rng.choice(["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"]),
                vocab_size=rng.randrange(330, 1100) | (1 if index % 2 == 0 else 0),  # odd: TP2 pads; even: it splits
                tied=rng.random() < 0.5,
                layers=rng.choice([2, 3, 4, 5]),
                kv_heads=rng.choice([2, 4]),
                mtp=rng.choice([0, 1]),
                rows=rng.randrange(3, 8),
                prompt_width=rng.randrange(3, 9),
                response_width=rng.randrange(2, 8),
                seed=rng.randrange(1000),
                lora=index % 2 == 0,
                ffn_ratio=rng.choice([2, 3, 5]),
            )
        )
        drawn[-1] = dataclasses.replace(
            drawn[-1], head_dim=head_dims.choice([None, 32]) if drawn[-1].family.startswith("qwen3") else None
        )
    # The config refuses MTP on MoE models (strategies/megatron/config.py: mtp_problem).
    drawn = [dataclasses.replace(e, mtp=0) if e.moe else e for e in drawn]
    return [issue_case, dataclasses.replace(issue_case, tied=True), *drawn]


def rl_batch(example: Example, vocab_size: int, groups: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of random lengths; row 0 has one prompt and one response
    token (nearly empty), every other row at least one response token. Odd rows of 3+ response tokens are
    multi-turn (agentic): a span inside the response is an inserted observation, attended but out of the loss."""
    gen = torch.Generator().manual_seed(example.seed)
    rows, p_width, r_width = example.rows, example.prompt_width, example.response_width
    prompt_lens = [1] + torch.randint(1, p_width + 1, (rows - 1,), generator=gen).tolist()
    response_lens = [1] + torch.randint(1, r_width + 1, (rows - 1,), generator=gen).tolist()
    batch = rl_batch_of_lengths(prompt_lens, response_lens, p_width, r_width, vocab_size, gen, groups)
    for row, length in enumerate(response_lens):
        if row % 2 and length >= 3:  # sampled, then the observation, then sampled again
            batch[keys.RESPONSE_MASK][row, 1 : 1 + max(1, (length - 2) // 2 + 1)] = 0
            batch[keys.RESPONSE_MASK][row, length - 1] = 1
    return batch


@dataclasses.dataclass(frozen=True)
class Role:
    """What one role computes before and after its step, and the metrics its step reports."""

    forward: object  # the worker method giving per-token outputs
    outputs: tuple[str, ...]  # their columns compared before the step (the first also after it)
    train: object
    metrics: tuple[str, ...]


ACTOR = Role(
    ReconfigurableActor.compute_log_probs,
    (keys.LOG_PROBS, keys.ENTROPY),
    ReconfigurableActor.train_step,
    ("loss", "pg_loss", "entropy", "kl_loss", "ppo_kl", "pg_clipfrac", "grad_norm"),
)
CRITIC = Role(
    ReconfigurableActor.compute_values,
    (keys.VALUES,),
    ReconfigurableActor.critic_train_step,
    ("loss", "vf_loss", "vf_clipfrac", "grad_norm"),
)


def _config(model_dir: str, example: Example, role: Role, micro_batch_size: int = 2) -> ActorConfig | CriticConfig:
    settings = dict(model_path=model_dir, micro_batch_size=micro_batch_size, optimizer=OptimizerSettings(lr=LR))
    if example.lora:
        settings["lora"] = LoRASettings(rank=4, alpha=8.0)
    if role is CRITIC:
        return CriticConfig(strategy=MegatronTrainConfig(**settings, value_head=True), loss=CriticLossConfig(0.2))
    return ActorConfig(
        strategy=MegatronTrainConfig(**settings, mtp_num_layers=example.mtp, mtp_loss_scaling_factor=0.3),
        loss=ActorLossConfig(kl_loss_coef=0.05, entropy_coef=0.01),
    )


def _run(group, config, role: Role, batch: DataProto) -> dict:
    group.call(ReconfigurableActor.init_model_with, config)
    before = group.call(role.forward, batch).batch
    metrics = next(m for m in group.call(role.train, batch) if m is not None)
    after = group.call(role.forward, batch).batch[role.outputs[0]]
    return {**{column: before[column] for column in role.outputs}, "metrics": metrics, "after": after}


def _widened(batch: DataProto, extra: int) -> DataProto:
    """The batch with `extra` more response columns, all padding: every micro-batch gets wider, nothing else."""
    total_width = (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)
    response_width = batch.batch[keys.RESPONSES].shape[1]
    tensors = {}
    for name, value in batch.batch.items():
        if name in total_width or (name != keys.PROMPTS and value.dim() == 2 and value.shape[1] == response_width):
            value = torch.nn.functional.pad(value, (0, extra))
        tensors[name] = value
    return DataProto.from_dict(tensors=tensors, meta_info=dict(batch.meta_info))


def _narrowed(run: dict, role: Role, width: int) -> dict:
    """A run's per-token outputs cut back to the first `width` response columns."""
    return {k: v[:, :width] if k in (*role.outputs, "after") else v for k, v in run.items()}


def _with_meta(batch: DataProto, meta: dict) -> DataProto:
    return DataProto.from_dict(tensors=dict(batch.batch.items()), meta_info={**batch.meta_info, **meta})


def _layout_problem(model_dir: str, layout) -> str | None:
    """Why the model cannot run at this layout (the builder's own rules; a critic runs wherever the actor does: its
    value head gathers the sequence under sequence parallelism), or None."""
    from transformers import AutoConfig

    from roll_backend.strategies.megatron.builder import HFArch

    try:
        arch = HFArch.from_hf_config(AutoConfig.from_pretrained(model_dir))
        first, last = default_stage_split(arch.num_layers, layout.pp, layout.vpp)
        arch.check_layout(layout.tp, layout.pp, layout.ep, layout.etp, layout.vpp, first, last)
    except ValueError as exc:
        return str(exc)
    return None


def _name(example: Example) -> str:
    tied = "tied" if example.tied else "untied"
    lora = "-lora" if example.lora else ""
    return (
        f"{example.family}-v{example.vocab_size}-{tied}-L{example.layers}-kv{example.kv_heads}-ffn{example.ffn_ratio}x"
        f"-mtp{example.mtp}{lora}{f'-d{example.head_dim}' if example.head_dim else ''}"
    )


def _role_batch(role: Role, tensors: dict, outputs: DataProto) -> DataProto:
    """The step's inputs from the reference's outputs: old log-probs and a reference policy a little away (so
    kl_loss > 0) for the actor; old values and returns for the critic."""
    noise = torch.randn(tensors[keys.RESPONSES].shape, generator=torch.Generator().manual_seed(1))
    if role is ACTOR:
        old = outputs.batch[keys.LOG_PROBS]
        return DataProto.from_dict(tensors={**tensors, keys.OLD_LOG_PROBS: old, keys.REF_LOG_PROBS: old + 0.1 * noise})
    values = outputs.batch[keys.VALUES]
    return DataProto.from_dict(tensors={**tensors, keys.VALUES: values, keys.RETURNS: values + noise})


def _compare(
    example: Example, role: Role, ref: dict, runs: dict, mask: torch.Tensor, router_metrics: bool = True
) -> list[str]:
    """Every check of every layout against the reference, as lines; failing ones start with 'FAIL'. Without
    `router_metrics`, the experts' loads are not compared (they count the tokens forwarded)."""
    first = role.outputs[0]
    moved = float(((ref["after"] - ref[first]).abs() * mask).max())
    post = after_step_bound(ref[first], ref["after"], mask, example.layers)
    lines = [f"the step moved {first} by {moved:.3g}" if moved > 100 * post else f"FAIL the step hardly moved {first}"]
    names = role.metrics + (("mtp_loss",) if role is ACTOR and example.mtp else ())
    names += ROUTER_METRICS if example.moe and router_metrics else ()
    names += AUX_METRICS if role is ACTOR and example.aux_loss_coef else ()
    for name, run in runs.items():
        checks = [
            (c, float(((run[c] - ref[c]).abs() * mask).max()), float32_bound(ref[c] * mask)) for c in role.outputs
        ]
        checks.append((f"{first} after the step", float(((run["after"] - ref["after"]).abs() * mask).max()), post))
        for metric in names:
            got, want = run["metrics"][metric], ref["metrics"][metric]
            checks.append((metric, abs(got - want), float32_bound(want, ref["metrics"]["loss"])))
        for what, diff, bound in checks:
            lines.append(f"{'FAIL ' if diff > bound else ''}{name} {what}: {diff:.3g} (bound {bound:.3g})")
    return lines


# A checkpoint saved at TP1 after the step loads at these layouts: the same log-probs, and the same next step (the
# optimizer's moments moved too).
CHECKPOINT_LAYOUTS = ("tp2pp2", "pp2vpp2", "ep2")  # (CP shards no weights)


class _MovedCheckpoint:
    """The reference group's state after `_run`, saved, and the reference's next step from it."""

    def __init__(self, reference, role: Role, batch: DataProto, path):
        self.role, self.batch, self.path = role, batch, str(path)
        reference.call(ReconfigurableActor.save_checkpoint, self.path)
        self.loaded = reference.call(role.forward, batch).batch[role.outputs[0]]
        reference.call(role.train, batch)
        self.next_step = reference.call(role.forward, batch).batch[role.outputs[0]]

    def check(self, name: str, group, mask: torch.Tensor, layers: int) -> list[str]:
        group.call(ReconfigurableActor.load_checkpoint, self.path)
        loaded = group.call(self.role.forward, self.batch).batch[self.role.outputs[0]]
        group.call(self.role.train, self.batch)
        next_step = group.call(self.role.forward, self.batch).batch[self.role.outputs[0]]
        checks = [
            ("loaded from TP1's checkpoint", loaded, self.loaded, float32_bound(self.loaded * mask)),
            (
                "the next step from it",
                next_step,
                self.next_step,
                after_step_bound(self.loaded, self.next_step, mask, layers),
            ),
        ]
        lines = []
        for what, got, want, bound in checks:
            diff = float(((got - want).abs() * mask).max())
            lines.append(
                f"{'FAIL ' if diff > bound else ''}checkpoint at {name}, {what}: {diff:.3g} (bound {bound:.3g})"
            )
        return lines


def _reference_runs(reference, model_dir: str, example: Example, tensors: dict):
    """For the actor and then the critic: (role, its name, its config, its step's batch, the reference group's run
    of it), the reference group left as the run left it."""
    for role in (ACTOR, CRITIC):
        config = _config(model_dir, example, role)
        reference.call(ReconfigurableActor.init_model_with, config)
        batch = _role_batch(role, tensors, reference.call(role.forward, DataProto.from_dict(tensors=tensors)))
        yield role, "actor" if role is ACTOR else "critic", config, batch, _run(reference, config, role, batch)


def _example_batch(example: Example, tmp_path, groups: list[int] | None = None):
    """(model folder, vocabulary size after the builder's padding, the batch) of an example."""
    model_dir = str(build_tiny_model(tmp_path / "model", example.spec()))
    vocab_size = int(json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"])
    return model_dir, vocab_size, rl_batch(example, vocab_size, groups)


@pytest.mark.parametrize("example", examples(), ids=_name)
def test_every_layout_gives_the_same_numbers(layout_actors, example, tmp_path):
    model_dir, vocab_size, tensors = _example_batch(example, tmp_path)
    mask = tensors[keys.RESPONSE_MASK].float()
    reference = layout_actors["tp1"]
    report = []
    for role, role_name, config, batch, ref in _reference_runs(reference, model_dir, example, tensors):
        if example.lora:  # only adapters (and a critic's new value head) train, the MTP layers' among them
            trained = {n for names in reference.call(ReconfigurableActor.optimizer_parameter_names) for n in names}
            assert trained and all(".lora." in n or "output_layer." in n for n in trained), sorted(trained)
            assert not example.mtp or role is CRITIC or any(n.startswith("module.mtp.") for n in trained)
        moved = (
            _MovedCheckpoint(reference, role, batch, tmp_path / f"{role_name}_checkpoint") if role is ACTOR else None
        )
        runs = {}
        for name, group in layout_actors.items():
            problem = _layout_problem(model_dir, group.layout) if name != "tp1" else "the reference"
            if problem is None:
                runs[name] = _run(group, config, role, batch)
                if moved is not None and name in CHECKPOINT_LAYOUTS:
                    report += moved.check(name, group, mask, example.layers)
            elif name != "tp1":
                report.append(f"{role_name} not at {name}: {problem}")
        if "tp2pp2" in runs and not example.moe:  # (a MoE model takes sequence parallelism at TP2 anyway)
            parallel = dataclasses.replace(config.strategy, sequence_parallel=True)
            runs["tp2pp2_sp"] = _run(
                layout_actors["tp2pp2"], dataclasses.replace(config, strategy=parallel), role, batch
            )
        runs["tp1_mbs1"] = _run(reference, _config(model_dir, example, role, micro_batch_size=1), role, batch)
        width = tensors[keys.RESPONSES].shape[1]
        runs["tp1_wider"] = _narrowed(_run(reference, config, role, _widened(batch, WIDER)), role, width)
        if "ep2" in runs:  # micro-batches cut by tokens: the two DP ranks' counts and shapes differ
            for mode, meta in EXPERT_BATCHING.items():
                if mode == "packed" and example.mtp and role is ACTOR:
                    continue  # refused: MTP labels would cross packed sequences
                runs[f"ep2_{mode}"] = _run(layout_actors["ep2"], config, role, _with_meta(batch, meta))
        report += [f"{role_name} {line}" for line in _compare(example, role, ref, runs, mask)]
    print(f"{_name(example)} (vocab {vocab_size}):", *report, sep="\n  ")
    failures = [line for line in report if "FAIL" in line]
    assert not failures, f"{example} (vocab {vocab_size}):\n" + "\n".join(failures)


# The split moves the load-balancing loss (a per-micro-batch objective), the model-parallel layout and the amount
# of padding must not: the same micro-batches at TP2 x PP2 (sequence parallel on a later stage) and CP2, and wider.
AUX_LAYOUTS = ("tp2pp2", "cp2")


@pytest.mark.parametrize(
    "example", [dataclasses.replace(e, aux_loss_coef=0.05) for e in examples() if e.moe][:2], ids=_name
)
def test_moe_load_balancing_loss_is_layout_independent(layout_actors, example, tmp_path):
    model_dir, _, tensors = _example_batch(example, tmp_path)
    config = _config(model_dir, example, ACTOR)
    reference = layout_actors["tp1"]
    reference.call(ReconfigurableActor.init_model_with, config)
    batch = _role_batch(ACTOR, tensors, reference.call(ACTOR.forward, DataProto.from_dict(tensors=tensors)))
    ref = _run(reference, config, ACTOR, batch)
    assert ref["metrics"]["moe/aux_loss"] > 0
    width = tensors[keys.RESPONSES].shape[1]
    runs = {"tp1_wider": _narrowed(_run(reference, config, ACTOR, _widened(batch, WIDER)), ACTOR, width)}
    for name in AUX_LAYOUTS:
        if _layout_problem(model_dir, layout_actors[name].layout) is None:
            runs[name] = _run(layout_actors[name], config, ACTOR, batch)
    report = _compare(example, ACTOR, ref, runs, tensors[keys.RESPONSE_MASK].float())
    print(f"{_name(example)} with the load-balancing loss:", *report, sep="\n  ")
    assert len(runs) > 1 and not [line for line in report if "FAIL" in line], "\n".join(report)


# Prompt sharing (issue 49): the rows of one prompt forward it once; every layout and micro-batching gives the
# unshared TP1 numbers. (layout, micro-batching) per run; budgets below most groups' lengths cut groups into segments.
SHARED_RUNS = {
    "tp1": ("tp1", {}),
    "tp2pp2": ("tp2pp2", {}),  # sequence parallelism at TP2
    "pp2vpp2": ("pp2vpp2", {}),
    "tp1_budget": ("tp1", {keys.META_MAX_TOKENS_PER_MICROBATCH: 24}),
    "cp2": ("cp2", {}),  # a segment's positions over two CP ranks, the mask's rows with them
    "ep2_packed": ("ep2", {keys.META_MAX_TOKENS_PER_MICROBATCH: 32, keys.META_SEQUENCE_PACKING: True}),
}


def shared_examples() -> list[Example]:
    """Drawn shapes with more rows; dense with MTP and MoE (which refuses MTP), full training and LoRA."""
    chosen = [examples()[i] for i in (0, 3, 6)]
    return [dataclasses.replace(e, mtp=0 if e.moe else 1, rows=e.rows + 5) for e in chosen]


def random_groups(rows: int, seed: int) -> list[int]:
    """Each row's group: consecutive runs of 1 to 4 rows (n samples of one prompt; a group of 1 shares nothing)."""
    rng, groups = random.Random(seed), []
    while len(groups) < rows:
        groups += [len(set(groups))] * rng.randint(1, 4)
    return groups[:rows]


@pytest.mark.parametrize("example", shared_examples(), ids=_name)
def test_shared_prompts_give_the_unshared_numbers(layout_actors, example, tmp_path):
    model_dir, vocab_size, tensors = _example_batch(example, tmp_path, random_groups(example.rows, example.seed))
    mask = tensors[keys.RESPONSE_MASK].float()
    reference = layout_actors["tp1"]
    report = []
    for role, role_name, config, batch, ref in _reference_runs(reference, model_dir, example, tensors):
        shared = dataclasses.replace(config, strategy=dataclasses.replace(config.strategy, share_prompts=True))
        runs = {}
        for name, (layout_name, meta) in SHARED_RUNS.items():
            group = layout_actors[layout_name]
            problem = _layout_problem(model_dir, group.layout)
            if problem is None:
                runs[f"shared_{name}"] = _run(group, shared, role, _with_meta(batch, meta))
            else:
                report.append(f"{role_name} not at {name}: {problem}")
        report += [f"{role_name} {line}" for line in _compare(example, role, ref, runs, mask, router_metrics=False)]
    print(f"{_name(example)} shared prompts (vocab {vocab_size}):", *report, sep="\n  ")
    failures = [line for line in report if "FAIL" in line]
    assert not failures, f"{example} (vocab {vocab_size}):\n" + "\n".join(failures)
