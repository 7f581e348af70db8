"""One GRPO step, roll-backend vs TRL's GRPOTrainer, on the same random ~14M Qwen2 model: generated tokens/s.

roll-backend runs its product loop (PipelineRun + rl_step: Ray groups, vLLM rollout, Megatron actor and reference,
rule reward, weight sync); TRL runs GRPOTrainer on CPU (transformers generate). Both: 32 prompts (a JSONL file)
x 8 samples x exactly 128 new tokens, KL to a reference at 0.04, one optimizer step per step, and the same
precision: bf16 mixed precision where the CPU has bf16 natively (TRL's own default; Megatron bf16 with fp32 main
weights and vLLM in bf16), else float32 for both (bench/_machine.py; --dtype bfloat16|float32 chooses).
roll-backend runs as for a long run: use_torch_compile on the Megatron actor and reference, vLLM compiled
(--no-compile: the product's defaults), one vLLM engine per core (`placement`); TRL with its defaults.
Run: .venv/bin/python bench/grpo_step.py [--steps 2] [--actor-tp 1|2] [--dtype auto|bfloat16|float32] [--quick]
     [--only roll-backend|trl] [--no-compile] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _machine import add_dtype_option, announce

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Scale:
    prompts: int
    samples: int
    new_tokens: int
    micro_batch: int  # completions per forward/backward micro-batch, both sides
    model: dict  # TinyModelSpec fields

    @property
    def generated_tokens(self) -> int:
        return self.prompts * self.samples * self.new_tokens


FULL = Scale(
    32,
    8,
    128,
    64,
    dict(
        hidden_size=512,
        num_hidden_layers=6,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
)
QUICK = Scale(
    4,
    8,
    16,
    16,
    dict(
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
    ),
)


def prompt_rows(count: int) -> list[dict]:
    """Short arithmetic prompts with digit answers (the exact_match rule scores them the same on both sides)."""
    return [
        {
            "prompt": f"what is {7 * i % 50} + {13 * i % 40}? answer with the number only.",
            "answer": str(7 * i % 50 + 13 * i % 40),
        }
        for i in range(count)
    ]


def bench_inputs(scale: Scale, prefix: str) -> tuple[Path, str, list[dict], Path]:
    """A fresh work folder with the scale's model and its prompts as a JSONL file: (folder, model, rows, data)."""
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    work = Path(tempfile.mkdtemp(prefix=prefix))
    model_dir = str(build_tiny_model(work / "model", TinyModelSpec(seed=0, **scale.model)))
    rows = prompt_rows(scale.prompts)
    data_path = work / "prompts.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return work, model_dir, rows, data_path


def roll_backend_config(
    model_dir: str,
    data_path: Path,
    out_dir: Path,
    scale: Scale,
    steps: int,
    actor_tp: int,
    dtype: str,
    compile_models: bool = False,
    overrides: list[str] = (),
):
    """The demo config at the bench's scale: TP`actor_tp` Megatron actor, vLLM rollout, Megatron reference;
    `compile_models`: the Megatron strategies' use_torch_compile and vLLM's compiled model (enforce_eager off);
    `overrides`: key=value pairs applied last, as on the command line of `roll-backend run`."""
    from omegaconf import OmegaConf

    from roll_backend.config.loader import config_from_dict, resolve_yaml

    tree = resolve_yaml(REPO / "configs/grpo_tiny_cpu.yaml", [f"output_dir={out_dir}"])
    tree.update(
        model_path=model_dir,
        build_tiny_model=None,
        max_steps=1 + steps,
        rollout_batch_size=scale.prompts,
        num_return_sequences_in_group=scale.samples,
        response_length=scale.new_tokens,
    )
    tree["data"] = {"train_path": str(data_path), "max_prompt_length": 64}
    tree["algorithm"].update(
        use_kl_loss=True, kl_loss_coef=0.04, ppo_epochs=1, ppo_mini_batch_size=scale.prompts * scale.samples
    )  # one update per step
    tree["reward"] = {"rewards": {"exact_match": 1.0}, "world_size": 1}
    tree["logging"] = {"jsonl": False, "tensorboard": False, "progress_bar": False}
    tree["actor_train"].update(model_path=model_dir, world_size=actor_tp)
    tree["actor_train"]["strategy"].update(tp=actor_tp, micro_batch_size=scale.micro_batch)
    tree["actor_train"]["strategy"]["optimizer"]["lr"] = 1e-6
    for role in ("actor_train", "reference"):
        tree[role]["strategy"].update(params_dtype=dtype, use_torch_compile=compile_models)
    tree["actor_infer"]["strategy"].update(dtype=dtype, enforce_eager=not compile_models)
    tree["actor_infer"]["model_path"] = model_dir
    tree["actor_infer"]["strategy"].update(
        max_model_len=64 + scale.new_tokens + 64,
        max_prompt_length=64,
        max_num_batched_tokens=scale.prompts * scale.samples * 64,  # one prefill step
        sampling={"temperature": 1.0, "min_tokens": scale.new_tokens},
    )
    tree["reference"]["model_path"] = model_dir
    tree["reference"]["strategy"]["micro_batch_size"] = scale.micro_batch
    tree = OmegaConf.to_container(OmegaConf.merge(tree, OmegaConf.from_dotlist(list(overrides))))
    return config_from_dict(tree)


def placement(cores: int, actor_tp: int) -> list[str]:
    """Where roll-backend's ranks run on a `cores`-core machine: one single-threaded vLLM engine per core (its CPU
    decode steps are small kernels between Python scheduling, which a second thread of one engine barely speeds up),
    the actor's TP ranks and the reference splitting all cores into threads. Ray gives each rank
    OMP_NUM_THREADS = its num_cpus_per_rank; the phases run one after another, so each may use every core."""
    return [
        f"actor_infer.world_size={cores}",
        "actor_infer.num_cpus_per_rank=1",
        f"actor_train.num_cpus_per_rank={max(1, cores // actor_tp)}",
        f"reference.num_cpus_per_rank={cores}",
    ]


def roll_backend_step_seconds(config, steps: int) -> tuple[list[float], list[dict]]:
    """A PipelineRun of 1 warm-up + `steps` rl_steps (the product's loop); returns each timed step's wall seconds
    and its metrics."""
    import ray

    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.pipelines.loops.rl_step import rl_step
    from roll_backend.pipelines.run import PipelineRun

    # Ray starts its workers at nice 15, while TRL runs in this (nice 0) process: on a shared machine
    # that alone would hand the cores to TRL, so both sides run at the same priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    init_local_ray(num_cpus=config.ray_num_cpus)
    try:
        start = time.perf_counter()
        with PipelineRun(config) as run:
            print(f"roll-backend: role groups up in {time.perf_counter() - start:.1f}s", flush=True)
            seconds, step_metrics = [], []
            for step in run.step_numbers():
                start = time.perf_counter()
                metrics = rl_step(run, step)
                seconds.append(time.perf_counter() - start)
                step_metrics.append(metrics)
                phases = " ".join(f"{k.split('/')[1]}={v:.1f}" for k, v in metrics.items() if k.startswith("timing/"))
                print(
                    f"roll-backend step {step}{' (warm-up)' if step == 1 else ''}: {seconds[-1]:.1f}s [{phases}] "
                    f"response_length={metrics['response_length/mean']:.0f} "
                    f"sync_gap={metrics.get('weight_sync/logprob_gap', float('nan')):.1e}",
                    flush=True,
                )
    finally:
        ray.shutdown()
    return seconds[1:], step_metrics[1:]


def trl_step_seconds_in_subprocess(
    model_dir: str, rows: list[dict], scale: Scale, work_dir: Path, steps: int, dtype: str
) -> tuple[list[float], list[dict]]:
    """TRL's steps and their phases, run by bench/_grpo_step_trl.py in a fresh process with roll-backend's CPU-rank
    allocator env."""
    from _grpo_step_trl import PHASES_PREFIX, RESULT_PREFIX

    from roll_backend.distributed.ray_env import cpu_rank_env

    request = dict(
        model_dir=model_dir,
        rows=rows,
        work_dir=str(work_dir),
        steps=steps,
        dtype=dtype,
        scale=dict(
            prompts=scale.prompts, samples=scale.samples, new_tokens=scale.new_tokens, micro_batch=scale.micro_batch
        ),
    )
    env = os.environ | cpu_rank_env()
    print(
        f"TRL: a fresh process with {' '.join(f'{k}={v}' for k, v in cpu_rank_env().items()) or 'the inherited env'}",
        flush=True,
    )
    process = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_grpo_step_trl.py")), json.dumps(request)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    print("\n".join(line for line in process.stdout.splitlines() if line.startswith("TRL:")), flush=True)

    def result(prefix: str):
        return json.loads([line for line in process.stdout.splitlines() if line.startswith(prefix)][-1][len(prefix) :])

    return result(RESULT_PREFIX), result(PHASES_PREFIX)


def step_model_flops(model_dir: str, rows: list[dict], scale: Scale) -> dict[str, float]:
    """Model FLOPs of one step's phases, the same on both sides: every completion is exactly `new_tokens` long
    after its chat-templated prompt (roll_backend.perf.flops counts them)."""
    from transformers import AutoConfig, AutoTokenizer

    from roll_backend.perf.flops import ModelFlops

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_lengths = [
        len(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in rows
    ]
    model = ModelFlops.from_hf_config(AutoConfig.from_pretrained(model_dir))
    samples = [n for n in prompt_lengths for _ in range(scale.samples)]
    sequences = [n + scale.new_tokens for n in samples]
    groups = [i for i in range(len(prompt_lengths)) for _ in range(scale.samples)]
    return {
        "generate": model.generation_flops(samples, [scale.new_tokens] * len(samples), groups),
        "reference": model.forward_flops(sequences),
        "train": model.train_flops(sequences),
    }


def machine_peak_tflops(model_dir: str, dtype: str) -> float:
    """The GEMM peak of this machine (all cores, this process) in `dtype` on the model's MLP shapes."""
    import torch
    from transformers import AutoConfig

    from roll_backend.perf.peak import gemm_shapes, measure_gemm_tflops

    config = AutoConfig.from_pretrained(model_dir)
    torch.set_num_threads(os.cpu_count() or 1)
    return measure_gemm_tflops(dtype, "cpu", gemm_shapes(config.hidden_size, config.intermediate_size), seconds=2.0)


def print_phases(results: dict[str, tuple[list[float], list[dict]]], flops: dict[str, float], peak: float) -> None:
    """Seconds and MFU per phase, mean over the timed steps, both sides against the same measured peak."""
    print(f"{'phase':<12}" + "".join(f"{name + ' s':>22}{'MFU':>7}" for name in results))
    for phase in ("generate", "reference", "train"):
        cells = ""
        for seconds_per_step in (sum(p[phase] for p in phases) / len(phases) for _, phases in results.values()):
            cells += f"{seconds_per_step:>22.2f}{flops[phase] / seconds_per_step / 1e12 / peak:>7.0%}"
        print(f"{phase:<12}{cells}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side, after one warm-up step")
    parser.add_argument("--actor-tp", type=int, default=1, choices=(1, 2), help="Megatron actor world size (= TP)")
    parser.add_argument("--quick", action="store_true", help="tiny scale smoke test (not the benchmark)")
    add_dtype_option(parser)
    parser.add_argument("--only", choices=("roll-backend", "trl"), help="run one side only (no ratio)")
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="roll-backend without use_torch_compile and with vLLM in eager mode (both defaults of the product)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a roll-backend config override, e.g. actor_infer.world_size=2 (repeatable)",
    )
    return parser.parse_args()


def print_rates(results: dict[str, tuple[list[float], list[dict]]], scale: Scale) -> None:
    """Generated tokens/s per side over its timed steps, and the ratio when both ran."""
    rates = {}
    for name, (seconds, _) in results.items():
        mean = sum(seconds) / len(seconds)
        rates[name] = scale.generated_tokens / mean
        steps = ", ".join(f"{s:.1f}" for s in seconds)
        print(f"{name}: {mean:.1f} s/step (steps {steps}), {rates[name]:.0f} generated tokens/s")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if len(rates) == 2:
        print(f"tokens/s vs TRL GRPOTrainer: {rates['roll-backend'] / rates['TRL GRPOTrainer']:.1f}x")


def main() -> None:
    args = parse_args()
    dtype = announce(args.dtype)
    # Neither side inherits a thread count: roll-backend's ranks take theirs from num_cpus_per_rank (`placement`),
    # TRL's process uses every core, whichever sides run.
    os.environ.pop("OMP_NUM_THREADS", None)
    scale = QUICK if args.quick else FULL

    work, model_dir, rows, data_path = bench_inputs(scale, "grpo_step_")
    params = sum(
        p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).parameters()
    )
    print(
        f"model: {params / 1e6:.1f}M params; {scale.prompts} prompts x {scale.samples} samples x "
        f"{scale.new_tokens} new tokens = {scale.generated_tokens} tokens/step",
        flush=True,
    )

    peak = machine_peak_tflops(model_dir, dtype)
    flops = step_model_flops(model_dir, rows, scale)
    print(
        f"GEMM peak: {peak * 1e3:.0f} GFLOP/s in {dtype} on {os.cpu_count()} threads (this run, model's MLP shapes); "
        "model FLOPs per step: " + ", ".join(f"{k} {v / 1e12:.2f}T" for k, v in flops.items()),
        flush=True,
    )

    results = {}
    if args.only in (None, "roll-backend"):
        overrides = placement(os.cpu_count() or 1, args.actor_tp) + args.overrides
        print(f"roll-backend: {' '.join(overrides)}", flush=True)
        config = roll_backend_config(
            model_dir,
            data_path,
            work / "rb",
            scale,
            args.steps,
            args.actor_tp,
            dtype,
            compile_models=args.compile,
            overrides=overrides,
        )
        seconds, metrics = roll_backend_step_seconds(config, args.steps)
        results["roll-backend"] = seconds, [{p: m[f"timing/{p}"] for p in flops} for m in metrics]
    if args.only in (None, "trl"):
        results["TRL GRPOTrainer"] = trl_step_seconds_in_subprocess(
            model_dir, rows, scale, work / "trl", args.steps, dtype
        )
        print(f"TRL steps: {' '.join(f'{s:.1f}s' for s in results['TRL GRPOTrainer'][0])}", flush=True)

    print_phases(results, flops, peak)
    print_rates(results, scale)


if __name__ == "__main__":
    main()
