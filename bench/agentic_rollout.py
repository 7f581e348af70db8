"""Multi-turn rollouts against a slow environment vs single-turn generation of as many tokens, on the same engine.

One in-process vLLM engine (the rollout strategy, no Ray) with a tiny Qwen2-style model. Multi-turn: --trajectories
trajectories of --turns turns of exactly --turn-tokens sampled tokens each (min_tokens = max_tokens), the
environment's step taking --latency seconds (bench/_slow_env.py, in --workers worker processes, as in a run).
Single-turn: as many prompts, each sampling turns x turn-tokens tokens at once. Generated tokens per second of
each; the multi-turn rollout also re-reads the inserted observations (prefill) and waits for the environment, which
the loop hides behind other trajectories' generation. float32 (the tiny model's vLLM CPU path).
Run: .venv/bin/python bench/agentic_rollout.py [--trajectories 64] [--turns 4] [--turn-tokens 96] [--latency 0.05]
Last line: `multi-turn vs single-turn tokens/s: Nx` (and the engine busy fraction).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _machine import announce

BENCH_DIR = Path(__file__).resolve().parent
MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=96)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds per environment step")
    parser.add_argument("--workers", type=int, default=16, help="environment worker processes")
    parser.add_argument(
        "--worker-threads", type=int, default=None, help="calls one worker runs at once (default: agentic's)"
    )
    parser.add_argument(
        "--no-kv-sessions", action="store_true", help="every turn a new request (agentic.keep_kv_between_turns: false)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    announce()
    sys.path.insert(0, str(BENCH_DIR))  # the env workers import _slow_env
    os.environ["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), os.environ.get("PYTHONPATH", "")])

    from roll_backend import keys
    from roll_backend.agentic.config import AgenticConfig
    from roll_backend.agentic.environments import EnvSpec
    from roll_backend.agentic.multi_turn import AgenticRollout
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
    from roll_backend.protocol import DataProto
    from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
    from roll_backend.strategies.vllm.strategy import VllmRolloutStrategy

    total = args.turns * args.turn_tokens
    with tempfile.TemporaryDirectory() as folder:
        model = build_tiny_model(Path(folder) / "model", TinyModelSpec(**MODEL, seed=0))
        strategy = VllmRolloutStrategy(
            VllmRolloutConfig(
                model_path=str(model),
                max_model_len=1024,
                enable_chunked_prefill=False,
                sampling=SamplingConfig(n=1, temperature=1.0, max_tokens=total + 512, min_tokens=args.turn_tokens),
            )
        )
        strategy.initialize()
        agentic = AgenticConfig(
            env=EnvSpec(path="_slow_env", name="SlowEnv", kwargs={"latency_s": args.latency}),
            max_turns=args.turns,
            max_tokens_per_turn=args.turn_tokens,
            workers=args.workers,
            keep_kv_between_turns=not args.no_kv_sessions,
            **({} if args.worker_threads is None else {"worker_threads": args.worker_threads}),
        )
        rollout = AgenticRollout(strategy, strategy.tokenizer, agentic, max_model_len=1024)
        prompts = DataProto.from_dict(
            non_tensors={keys.PROMPT_TEXT: np.array(["start the task"] * args.trajectories, dtype=object)},
            meta_info={keys.META_SAMPLING_SEED: 0},
        )
        multi, single, busy = [], [], []
        for repeat in range(args.repeats + 1):  # the first round warms both paths up
            started = time.perf_counter()
            batch = rollout.generate(prompts, n=1, max_tokens=total + 512, temperature=1.0)
            seconds = time.perf_counter() - started
            sampled = int(batch.batch[keys.RESPONSE_MASK].sum())
            assert sampled == args.trajectories * total, sampled
            metrics = batch.meta_info[keys.META_METRICS]
            started = time.perf_counter()
            one = prompts.select_idxs(list(range(len(prompts))))
            one.meta_info = {keys.META_SAMPLING_SEED: 0, "max_tokens": total, "min_tokens": total}
            flat = strategy.generate(one)
            flat_seconds = time.perf_counter() - started
            assert int(flat.batch[keys.RESPONSE_MASK].sum()) == sampled
            if repeat:
                multi.append(sampled / seconds)
                single.append(sampled / flat_seconds)
                busy.append(metrics["agentic/engine_busy_fraction"])
                print(
                    f"round {repeat}: multi-turn {sampled / seconds:,.0f} tokens/s ({seconds:.2f}s, engine busy "
                    f"{busy[-1]:.0%}, environment {metrics['agentic/env_seconds']:.1f}s summed), single-turn "
                    f"{sampled / flat_seconds:,.0f} tokens/s ({flat_seconds:.2f}s)",
                    flush=True,
                )
        rollout.close()
    print(
        f"{args.trajectories} trajectories x {args.turns} turns x {args.turn_tokens} tokens, environment step "
        f"{args.latency * 1000:.0f} ms in {args.workers} workers; engine busy fraction {np.mean(busy):.0%}"
    )
    print(f"multi-turn vs single-turn tokens/s: {np.mean(multi) / np.mean(single):.2f}x")


if __name__ == "__main__":
    main()
