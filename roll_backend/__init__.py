"""roll-backend: PPO/GRPO pipelines on Ray, Megatron-core training and vLLM rollout.

The repository's top level is fixed by the design card: `workers/` and `strategies/` sit beside this package and
install as `roll_backend.workers` and `roll_backend.strategies` (pyproject's package-dir). In a plain source
checkout on sys.path (e.g. a Ray job's uploaded working dir) the finder below maps exactly those two names to
those two folders; nothing else of the checkout is importable as `roll_backend.*`.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_CHECKOUT_SUBPACKAGES = ("workers", "strategies")


class _CheckoutSubpackageFinder(importlib.abc.MetaPathFinder):
    """Finds `roll_backend.workers` / `roll_backend.strategies` in a source checkout; after every other finder,
    so an installed (or editable) mapping wins."""

    def __init__(self, root: Path):
        self.locations = {f"{__name__}.{name}": root / name for name in _CHECKOUT_SUBPACKAGES}

    def find_spec(self, fullname, path=None, target=None):
        location = self.locations.get(fullname)
        if location is None or not (location / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, location / "__init__.py", submodule_search_locations=[str(location)]
        )


if not any(isinstance(finder, _CheckoutSubpackageFinder) for finder in sys.meta_path):
    sys.meta_path.append(_CheckoutSubpackageFinder(Path(__file__).resolve().parent.parent))

# Start-up: tensordict and megatron-core imported without torch's compiler stack (patches/deferred_compile.py).
from roll_backend.patches import deferred_compile as _deferred_compile  # noqa: E402

_deferred_compile.install()
