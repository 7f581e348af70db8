"""The denominator of MFU: a short GEMM probe of what this process's device multiplies per second in a dtype."""

from __future__ import annotations

import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gemm_shapes(hidden_size: int, ffn_hidden_size: int, tokens: int = 2048) -> list[tuple[int, int, int]]:
    """(m, k, n) of the model's large matmuls: the MLP's up and down projections over a batch of tokens."""
    return [(tokens, hidden_size, ffn_hidden_size), (tokens, ffn_hidden_size, hidden_size)]


def measure_gemm_tflops(dtype: str, device: str, shapes: list[tuple[int, int, int]], seconds: float = 0.2) -> float:
    """Best TFLOP/s of torch.matmul over `shapes` in `dtype` on `device`, each timed for about `seconds`
    after one warm-up (oneDNN/cuBLAS pick and JIT their kernel on the first call)."""
    torch_dtype = DTYPES[dtype]
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(torch_dtype)
        b = torch.randn(k, n, device=device).to(torch_dtype)
        torch.matmul(a, b)
        _synchronize(device)
        calls, start = 0, time.perf_counter()
        while True:
            torch.matmul(a, b)
            calls += 1
            if calls % 4 == 0:
                _synchronize(device)
                elapsed = time.perf_counter() - start
                if elapsed >= seconds:
                    break
        best = max(best, 2.0 * m * k * n * calls / elapsed / 1e12)
    return best


def _synchronize(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
