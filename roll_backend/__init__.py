"""roll-backend: PPO/GRPO pipelines on Ray, Megatron-core training and vLLM rollout."""

__version__ = "0.1.0"

# Installed, workers/ and strategies/ are roll_backend.workers and roll_backend.strategies (setuptools
# package-dir). In a plain source checkout on sys.path (e.g. a Ray job's uploaded working dir) they sit
# beside this package instead: let the subpackage imports find them there.
from pathlib import Path as _Path

_checkout_root = _Path(__file__).resolve().parent.parent
if (_checkout_root / "workers" / "__init__.py").is_file() and (_checkout_root / "strategies" / "__init__.py").is_file():
    __path__.append(str(_checkout_root))
del _Path, _checkout_root
