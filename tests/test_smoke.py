"""The stack imports in one process: the CPU torch build, megatron-core, vLLM, Ray, tensordict, omegaconf, transformers."""

import importlib


def test_stack_imports_and_versions():
    versions = {}
    for name in ("torch", "megatron.core", "vllm", "ray", "tensordict", "omegaconf", "transformers"):
        versions[name] = importlib.import_module(name).__version__
    print(versions)
    import torch

    assert torch.cuda.is_available() or "+cpu" in versions["torch"], "a CUDA torch on a machine without GPUs"
    assert all(versions.values())


def test_workers_and_strategies_install_inside_roll_backend():
    import roll_backend.strategies
    import roll_backend.workers

    assert roll_backend.workers.__name__ == "roll_backend.workers"
    assert roll_backend.strategies.__file__.replace("\\", "/").endswith("strategies/__init__.py")
