"""The stack imports in one process: the CPU torch build, megatron-core, vLLM, Ray, tensordict, omegaconf,
transformers.
"""

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


def test_a_plain_source_checkout_imports_workers_and_strategies():
    """As in a Ray job's uploaded working dir: no install, just the checkout on sys.path (-S: no site-packages)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); import roll_backend.workers, roll_backend.strategies; "
        "print(roll_backend.workers.__file__, roll_backend.strategies.__file__)"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(root / "workers" / "__init__.py"), str(root / "strategies" / "__init__.py")]


def test_a_plain_source_checkout_maps_only_workers_and_strategies_into_the_package():
    """The checkout's other folders (tests/, bench/, the package folder itself) are not roll_backend.* modules."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        f"import sys, importlib.util; sys.path.insert(0, {str(root)!r}); import roll_backend; "
        "print([importlib.util.find_spec('roll_backend.' + n) is not None "
        "for n in ('tests', 'bench', 'roll_backend', 'examples', 'workers', 'strategies')])"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[False, False, False, False, True, True]"
