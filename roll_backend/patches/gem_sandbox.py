"""gem-llm runs model-written code (its code environments' tests, its python tool) through
`gem.utils.sandbox.run_python(code, sandbox_type, stdin, timeout) -> (success, stdout, stderr)`: either a plain
subprocess guarded by a list of forbidden imports (`sandbox_type="none"`, its default) or a bwrap that binds the
whole Python prefix read-only and keeps the host's network namespace rules to bwrap's defaults. This routes every
such call through roll-backend's sandbox (agentic.sandbox: bubblewrap, remote or, when named, process), so GEM's
environments get the same boundary as the python tool. Applied in the environment worker before a GEM environment
is built; pinned to the gem-llm version it was written against.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

TESTED_GEM_VERSIONS = ("0.1.0",)
# Where gem imported run_python by name (`from gem.utils.sandbox import run_python`), besides its home.
GEM_MODULES = ("gem.utils.sandbox", "gem.envs.code_env", "gem.tools.python_code_tool")

# (code, stdin, timeout seconds or None) -> (success, stdout, stderr): gem's contract, minus its sandbox_type.
Runner = Callable[[str, str, "float | None"], tuple[bool, str, str]]


def apply(runner: Runner) -> None:
    """Point gem's run_python at `runner` (agentic.environments builds it over the configured sandbox)."""
    version = importlib.metadata.version("gem-llm")
    if version not in TESTED_GEM_VERSIONS:
        raise RuntimeError(
            f"roll_backend.patches.gem_sandbox was written for gem-llm {', '.join(TESTED_GEM_VERSIONS)}, found "
            f"{version}: check that gem.utils.sandbox.run_python keeps its signature, then add the version"
        )

    def run_python(code: str, sandbox_type: str = "none", stdin: str | None = None, timeout: float | None = None):
        return runner(code, stdin or "", timeout)

    run_python.roll_backend_sandbox = True  # marks the patched function
    for name in GEM_MODULES:
        importlib.import_module(name).run_python = run_python
