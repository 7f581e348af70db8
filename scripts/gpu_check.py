"""One-process, single-rank GPU smoke check of the Megatron train strategy (no Ray, no vLLM).

Run from the repository root:  python3 scripts/gpu_check.py --device cuda   (or --device cpu); on a machine without
the project installed, scripts/gpu_check.sh installs megatron-core, tensordict and pyvers from wheels in $WHEELS first.
Checks, each reported as one PASS/FAIL line with its numbers:
  dense qwen2 / qwen3 (float32): log-probs vs transformers on the same device, one actor_loss train step (loss equals
    the on-policy PPO value, finite grad norm, log-probs moved), HF export after the step vs the strategy's log-probs;
    qwen2 also a save/load checkpoint round trip; qwen3 trains with the distributed optimizer (and probes, uncounted,
    whether its checkpoint saves: megatron-core 0.16.1 refuses it with torch's Adam, "flattened_range is not
    supported");
  LoRA on qwen2: base = transformers before the step, base bit-identical after, only adapters trained, adapters-off
    forward = base, merged export = the trained log-probs;
  qwen3_moe with router_replay=R2: log-probs and recorded routes vs transformers, replayed train step;
  bf16 qwen3 (optional, loose): log-probs close to float32 transformers, a finite step.
Writes its log to $OUT/check.log too when OUT is set.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# The repository root: the working directory where it has roll_backend/ (how run.sh starts it), else this file's.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path.cwd() if (Path.cwd() / "roll_backend").is_dir() else Path(__file__).resolve().parent.parent
for extra in (REPO, REPO / "tests" / "support", REPO / "tests" / "strategies" / "megatron"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

_LOG = None


def log(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if _LOG is not None:
        _LOG.write(line + "\n")
        _LOG.flush()


RESULTS: list[tuple[str, bool]] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    ok = bool(ok)
    RESULTS.append((name, ok))
    log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    return ok


def section(fn, label: str | None = None):
    """Run one group of checks; an exception is one FAIL line plus its traceback, and the next group runs."""
    name = label or fn.__name__

    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.time()
        log(f"---- {name} ----")
        try:
            fn(*args, **kwargs)
        except Exception:
            check(f"{name} (raised)", False, traceback.format_exc().rstrip().splitlines()[-1])
            log(traceback.format_exc())
        finally:
            free_memory()
            log(f"     ({name}: {time.time() - start:.1f}s)")

    return run


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
def store_for_one_rank():
    """What roll_backend.distributed.parallel.rendezvous_store() returns outside Ray, built here: that function
    imports ray unconditionally (only for the node address, 127.0.0.1 without a Ray session), and ray is not on the
    device. The same TCPStore: 127.0.0.1, a port the OS gives the store's own socket."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=600)
    )
    return store, "127.0.0.1", store.port


class Env:
    def __init__(self, device: str, workdir: Path):
        self.device = device
        self.workdir = workdir

    def ctx(self):
        from roll_backend.workers.strategy_host import strategy_call_context

        return strategy_call_context("megatron_train", self.device)

    def call(self, fn, *args, **kwargs):
        """A strategy call inside the context a Megatron rank enters around each call (workers do the same)."""
        with self.ctx():
            return fn(*args, **kwargs)


def hf_reference(model_dir: str, tensors: dict, device: str, dtype=None, routes: bool = False):
    """transformers' response log-probs [B, T_resp] (float32 math) of the rows, on `device`; with `routes`, also the
    [B, T, L, k] top-k experts per real token (-1 at padding)."""
    import torch
    from megatron_batches import model_response_log_probs
    from transformers import AutoModelForCausalLM

    from roll_backend import keys

    dtype = dtype or torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    on_device = {k: v.to(device) for k, v in tensors.items()}
    with torch.no_grad():
        log_probs, _ = model_response_log_probs(model, on_device)
        route_ids = None
        if routes:
            attention = on_device[keys.ATTENTION_MASK]
            out = model(
                input_ids=on_device[keys.INPUT_IDS],
                attention_mask=attention,
                position_ids=on_device[keys.POSITION_IDS],
                output_router_logits=True,
            )
            k = model.config.num_experts_per_tok
            per_layer = [lg.float().topk(k, dim=-1).indices.view(*attention.shape, k) for lg in out.router_logits]
            route_ids = torch.stack(per_layer, dim=2).to(torch.int16)
            route_ids = route_ids.masked_fill(~attention.bool()[..., None, None], -1).cpu()
    del model
    free_memory()
    return log_probs.float().cpu(), route_ids


def masked_max(a, b, mask) -> float:
    from megatron_batches import max_masked_diff

    return max_masked_diff(a.cpu(), b.cpu(), mask.cpu())


def batch(vocab: int, seed: int):
    import torch
    from megatron_batches import rl_batch_of_lengths

    gen = torch.Generator().manual_seed(seed)
    return rl_batch_of_lengths([1, 6, 3, 5, 2], [1, 4, 6, 2, 5], 6, 6, vocab, gen)


def on_policy_ppo_loss(tensors) -> float:
    """The token-mean PPO loss when old == new log-probs (ratio 1): -mean(advantages) over response tokens."""
    from roll_backend import keys

    mask = tensors[keys.RESPONSE_MASK].double()
    return float(-(tensors[keys.ADVANTAGES].double() * mask).sum() / mask.sum())


def make_strategy(env: Env, model_dir: str, **overrides):
    from roll_backend.distributed.layout import ParallelLayout
    from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
    from roll_backend.strategies.megatron.train import MegatronTrainStrategy

    overrides.setdefault("optimizer", OptimizerSettings(lr=1e-2))
    cfg = MegatronTrainConfig(model_path=model_dir, micro_batch_size=2, **overrides)
    strategy = MegatronTrainStrategy(cfg, ParallelLayout(), env.device)
    env.call(strategy.initialize)
    return strategy


def log_probs_of(env: Env, strategy, tensors, meta=None):
    from roll_backend import keys
    from roll_backend.protocol import DataProto

    out = env.call(strategy.compute_log_probs, DataProto.from_dict(tensors=tensors, meta_info=meta))
    return out.batch[keys.LOG_PROBS], out


def train_once(env: Env, strategy, tensors):
    from roll_backend.protocol import DataProto
    from roll_backend.workers.actor import ActorLossConfig, actor_loss

    loss_fn = functools.partial(actor_loss, ActorLossConfig(clip_low=0.2))
    return env.call(strategy.train_step, DataProto.from_dict(tensors=tensors), loss_fn)


def tf32_state() -> str:
    import torch

    return (
        f"{torch.get_float32_matmul_precision()} (cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
        f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32})"
    )


def finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


# ---------------------------------------------------------------------------------------------------------------
def build_model(env: Env, name: str, **spec):
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    start = time.time()
    path = build_tiny_model(env.workdir / name, TinyModelSpec(**spec))
    log(f"     built {name} in {time.time() - start:.1f}s")
    return str(path)


DENSE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)


def dense_checks(
    env: Env,
    family: str,
    tol: float,
    distributed_optimizer: bool = False,
    checkpoint: bool = False,
    probe: bool = False,
):
    import torch

    from roll_backend import keys
    from roll_backend.strategies.megatron.config import OptimizerSettings

    model_dir = build_model(env, family, family=family, seed=3, **DENSE)
    tensors = batch(300, 7)
    mask = tensors[keys.RESPONSE_MASK]
    reference, _ = hf_reference(model_dir, tensors, env.device)
    optimizer = OptimizerSettings(lr=1e-2, use_distributed_optimizer=distributed_optimizer)
    log(f"     use_distributed_optimizer={distributed_optimizer}")
    strategy = make_strategy(env, model_dir, optimizer=optimizer)
    params = [p for chunk in strategy.model for p in chunk.parameters()]
    devices = sorted({str(p.device) for p in params})
    check(f"{family}/params_on_device", all(p.device.type == env.device for p in params), f"devices={devices}")
    before, out = log_probs_of(env, strategy, tensors)
    diff = masked_max(before, reference, mask)
    check(f"{family}/log_probs_vs_hf", diff < tol, f"max|diff|={diff:.3g} tol={tol:g} (out device {before.device})")

    step_batch = {**tensors, keys.OLD_LOG_PROBS: before}
    metrics = train_once(env, strategy, step_batch)
    want = on_policy_ppo_loss(tensors)
    check(
        f"{family}/train_step_finite",
        finite(metrics["loss"]) and finite(metrics["grad_norm"]) and metrics["grad_norm"] > 0 and metrics["update_ok"],
        f"loss={metrics['loss']:.6g} grad_norm={metrics['grad_norm']:.6g} lr={metrics['lr']:g} "
        f"update_ok={metrics['update_ok']}",
    )
    check(
        f"{family}/train_step_loss_on_policy",
        abs(metrics["loss"] - want) < 1e-5,
        f"loss={metrics['loss']:.8f} expected -mean(adv)={want:.8f} |diff|={abs(metrics['loss'] - want):.3g}",
    )
    after, _ = log_probs_of(env, strategy, tensors)
    moved = masked_max(after, before, mask)
    check(f"{family}/log_probs_moved", moved > 1e-3 and torch.isfinite(after).all(), f"max|after-before|={moved:.3g}")

    export_dir = env.workdir / f"{family}_export"
    env.call(strategy.export_hf, str(export_dir))
    if probe:  # not counted: megatron-core 0.16.1 refuses this checkpoint (flattened_range), on CPU at least
        try:
            env.call(strategy.save_checkpoint, str(env.workdir / f"{family}_probe_ckpt"))
            log(f"INFO {family}/probe save_checkpoint with the distributed optimizer: worked")
        except Exception as exc:
            what = f"{type(exc).__name__}: {exc}"
            log(f"INFO {family}/probe save_checkpoint with the distributed optimizer: raised {what}")
    if checkpoint:
        ckpt = env.workdir / f"{family}_ckpt"
        env.call(strategy.save_checkpoint, str(ckpt))
        second_batch = {**tensors, keys.OLD_LOG_PROBS: after}
        second = train_once(env, strategy, second_batch)
        del strategy
        free_memory()
        restored = make_strategy(env, model_dir, optimizer=optimizer)
        env.call(restored.load_checkpoint, str(ckpt))
        loaded, _ = log_probs_of(env, restored, tensors)
        diff = masked_max(loaded, after, mask)
        again = train_once(env, restored, second_batch)
        same_step = abs(again["loss"] - second["loss"]) + abs(again["grad_norm"] - second["grad_norm"])
        check(
            f"{family}/checkpoint_round_trip",
            diff < 1e-6 and same_step < 1e-5 and restored.steps_done == 2,
            f"max|loaded-after|={diff:.3g}; 2nd step after load vs before: |dloss|+|dgrad_norm|={same_step:.3g} "
            f"(grad_norm {again['grad_norm']:.6g} vs {second['grad_norm']:.6g})",
        )
        del restored
    else:
        del strategy
    free_memory()
    exported, _ = hf_reference(str(export_dir), tensors, env.device)
    diff = masked_max(exported, after, mask)
    check(f"{family}/export_after_step_vs_hf", diff < tol, f"max|hf(export)-after|={diff:.3g} tol={tol:g}")


def lora_checks(env: Env, tol: float):
    import torch

    from roll_backend import keys
    from roll_backend.strategies.megatron.config import LoRASettings

    model_dir = build_model(env, "lora_base", family="qwen2", seed=9, **DENSE)
    tensors = batch(300, 2)
    mask = tensors[keys.RESPONSE_MASK]
    base_ref, _ = hf_reference(model_dir, tensors, env.device)
    strategy = make_strategy(env, model_dir, lora=LoRASettings(rank=4, alpha=8.0))

    def base_weights(chunks=strategy.model):
        return {n: p.detach().clone() for chunk in chunks for n, p in chunk.named_parameters() if ".lora." not in n}

    base_before = base_weights()
    before, _ = log_probs_of(env, strategy, tensors)
    diff = masked_max(before, base_ref, mask)
    check("lora/before_step_equals_base_hf", diff < tol, f"max|diff|={diff:.3g} tol={tol:g}")
    trained = {id(p) for group in strategy.optimizer.param_groups for p in group["params"]}
    names = [n for chunk in strategy.model for n, p in chunk.named_parameters() if id(p) in trained]
    check(
        "lora/optimizer_holds_adapters_only",
        names and all(".lora." in n for n in names),
        f"{len(names)} trained params, e.g. {names[:2]}",
    )
    metrics = train_once(env, strategy, {**tensors, keys.OLD_LOG_PROBS: before})
    check(
        "lora/train_step_finite",
        finite(metrics["loss"]) and finite(metrics["grad_norm"]) and metrics["grad_norm"] > 0,
        f"loss={metrics['loss']:.6g} grad_norm={metrics['grad_norm']:.6g}",
    )
    base_after = base_weights()
    same = all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    check("lora/base_bit_identical_after_step", same, f"{len(base_before)} base tensors compared")
    after, _ = log_probs_of(env, strategy, tensors)
    moved = masked_max(after, before, mask)
    check("lora/log_probs_moved", moved > 1e-3, f"max|after-before|={moved:.3g}")
    off, _ = log_probs_of(env, strategy, tensors, meta={keys.META_BASE_MODEL: True})
    diff = masked_max(off, base_ref, mask)
    check("lora/adapters_off_equals_base_hf", diff < tol, f"max|diff|={diff:.3g} tol={tol:g}")
    export_dir = env.workdir / "lora_merged"
    env.call(strategy.export_hf, str(export_dir))
    del strategy
    free_memory()
    merged, _ = hf_reference(str(export_dir), tensors, env.device)
    diff = masked_max(merged, after, mask)
    check("lora/merged_export_vs_after", diff < tol, f"max|hf(merged)-after|={diff:.3g} tol={tol:g}")


def moe_r2_checks(env: Env, tol: float):
    import torch
    from router_checks import same_routes

    from roll_backend import keys

    model_dir = build_model(
        env,
        "qwen3_moe",
        family="qwen3_moe",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        seed=11,
        router_aux_loss_coef=0.0,
    )
    tensors = batch(300, 7)
    mask = tensors[keys.RESPONSE_MASK]
    reference, hf_routes = hf_reference(model_dir, tensors, env.device, routes=True)
    strategy = make_strategy(env, model_dir, router_replay="R2")
    log(f"     token dispatcher: {strategy.model[0].config.moe_token_dispatcher_type}")
    before, out = log_probs_of(env, strategy, tensors)
    diff = masked_max(before, reference, mask)
    check("qwen3_moe/log_probs_vs_hf", diff < tol, f"max|diff|={diff:.3g} tol={tol:g}")
    recorded = out.batch[keys.RECORDED_ROUTES]
    real = tensors[keys.ATTENTION_MASK].bool()
    agree = same_routes(recorded, hf_routes, tensors[keys.ATTENTION_MASK])
    differing = int((recorded.sort(-1).values != hf_routes.sort(-1).values).any(-1)[real].sum())
    check(
        "qwen3_moe/recorded_routes_equal_hf",
        agree,
        f"shape={list(recorded.shape)} dtype={recorded.dtype}; {differing} of {int(real.sum()) * recorded.shape[2]} "
        "(token, layer) expert sets differ",
    )
    step_batch = {**tensors, keys.OLD_LOG_PROBS: before, keys.RECORDED_ROUTES: recorded}
    metrics = train_once(env, strategy, step_batch)
    moe = {k: round(v, 6) for k, v in metrics.items() if k.startswith("moe/")}
    want = on_policy_ppo_loss(tensors)
    check(
        "qwen3_moe/r2_train_step",
        finite(metrics["loss"])
        and finite(metrics["grad_norm"])
        and metrics["grad_norm"] > 0
        and abs(metrics["loss"] - want) < 1e-5
        and moe.get("moe/replay_mismatched_tokens", 0.0) == 0.0,
        f"loss={metrics['loss']:.8f} (expected {want:.8f}) grad_norm={metrics['grad_norm']:.6g} {moe}",
    )
    after, _ = log_probs_of(env, strategy, tensors)
    moved = masked_max(after, before, mask)
    check("qwen3_moe/log_probs_moved", moved > 1e-3 and torch.isfinite(after).all(), f"max|after-before|={moved:.3g}")


def bf16_checks(env: Env):
    import torch

    from roll_backend import keys

    model_dir = build_model(env, "qwen3_bf16", family="qwen3", seed=3, **DENSE)
    tensors = batch(300, 7)
    mask = tensors[keys.RESPONSE_MASK]
    reference, _ = hf_reference(model_dir, tensors, env.device)
    strategy = make_strategy(env, model_dir, params_dtype="bfloat16")
    before, _ = log_probs_of(env, strategy, tensors)
    diff = masked_max(before.float(), reference, mask)
    mean = float(((before.double() - reference.double()).abs() * mask).sum() / mask.sum())
    check("bf16_qwen3/log_probs_vs_hf_fp32 (optional)", diff < 0.1, f"max|diff|={diff:.3g} mean={mean:.3g} (loose 0.1)")
    metrics = train_once(env, strategy, {**tensors, keys.OLD_LOG_PROBS: before})
    after, _ = log_probs_of(env, strategy, tensors)
    check(
        "bf16_qwen3/train_step (optional)",
        finite(metrics["loss"]) and finite(metrics["grad_norm"]) and torch.isfinite(after).all(),
        f"loss={metrics['loss']:.6g} grad_norm={metrics['grad_norm']:.6g} moved={masked_max(after, before, mask):.3g}",
    )


# ---------------------------------------------------------------------------------------------------------------
def main() -> int:
    global _LOG
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--tol", type=float, default=None, help="float32 log-prob tolerance (default 1e-5 cpu, 1e-4 cuda)"
    )
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: dense,lora,moe,bf16")
    args = parser.parse_args()
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        _LOG = open(os.path.join(os.environ["OUT"], "check.log"), "a")
    started = time.time()
    skip = set(filter(None, args.skip.split(",")))
    tol = args.tol if args.tol is not None else (1e-4 if args.device == "cuda" else 1e-5)

    import torch

    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, device={args.device}, tol={tol:g}")
    if args.device == "cuda":
        name, capability = torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)
        log(f"cuda {torch.version.cuda}, {name}, capability {capability}")
    try:
        import megatron.core
        import transformers

        log(f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}")
    except Exception:
        log(traceback.format_exc())
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:
        pass
    log(f"float32 matmul precision at start: {tf32_state()}")

    try:
        from roll_backend.distributed.layout import ParallelLayout
        from roll_backend.distributed.parallel import destroy_distributed, init_distributed

        store, addr, port = store_for_one_rank()
        coords = init_distributed(0, 1, addr, port, ParallelLayout(), args.device, store=store)
        import torch.distributed as dist

        check(
            "init_distributed", True, f"{coords.describe()} backend={dist.get_backend()} ({time.time() - started:.1f}s)"
        )
    except Exception:
        check("init_distributed", False, traceback.format_exc().rstrip().splitlines()[-1])
        log(traceback.format_exc())
        return finish(started)

    with tempfile.TemporaryDirectory(prefix="gpucheck_") as tmp:
        env = Env(args.device, Path(tmp))
        if "dense" not in skip:
            section(dense_checks, "dense_qwen2")(env, "qwen2", tol, checkpoint=True)
            section(dense_checks, "dense_qwen3")(env, "qwen3", tol, distributed_optimizer=True, probe=True)
        if "lora" not in skip:
            section(lora_checks)(env, tol)
        if "moe" not in skip:
            section(moe_r2_checks)(env, tol)
        log(f"float32 matmul precision after the float32 checks: {tf32_state()}")
        if "bf16" not in skip:
            section(bf16_checks)(env)
    if args.device == "cuda":
        log(f"cuda max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    try:
        destroy_distributed()
    except Exception:
        log("destroy_distributed raised:", traceback.format_exc().rstrip().splitlines()[-1])
    return finish(started)


def finish(started: float) -> int:
    heavy = sorted(m for m in ("ray", "vllm") if m in sys.modules)
    log(f"modules: ray imported={'ray' in sys.modules} vllm imported={'vllm' in sys.modules}")
    failed = [name for name, ok in RESULTS if not ok]
    passed = len(RESULTS) - len(failed)
    verdict = "PASS" if not failed and RESULTS else "FAIL"
    log(
        f"SUMMARY {verdict}: {passed}/{len(RESULTS)} checks passed in {time.time() - started:.1f}s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; heavy modules imported: {heavy}" if heavy else "")
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
