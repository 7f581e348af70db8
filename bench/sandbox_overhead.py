"""What the OS boundary costs a well-behaved python-tool call: the same small programs run through the plain
subprocess (`backend: process`, the sandbox before the boundary) and through bubblewrap, interleaved, medians.
No compute dtype (interpreter start-up and a little arithmetic).
Run: .venv/bin/python bench/sandbox_overhead.py [--repeats 30]"""

from __future__ import annotations

import argparse
import statistics
import time

from _machine import announce

from roll_backend.agentic.sandbox import SandboxLimits, SandboxSettings, make_sandbox

PROGRAMS = {
    "print": "print(6 * 7)",
    "arithmetic": "print(sum(i * i for i in range(100_000)))",
    "json + re": "import json, re\nprint(json.dumps(re.findall(r'\\d+', 'a1 b22 c333')))",
}
LIMITS = SandboxLimits()


def median_seconds(sandbox, code: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = sandbox.run_python(code, LIMITS)
        times.append(time.perf_counter() - started)
        assert result.ok, result.as_tool_message()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    announce()
    plain, boundary = make_sandbox(SandboxSettings(backend="process")), make_sandbox(SandboxSettings())
    added = []
    for name, code in PROGRAMS.items():
        median_seconds(boundary, code, 2)  # warm the file cache for both
        before = median_seconds(plain, code, args.repeats)
        after = median_seconds(boundary, code, args.repeats)
        added.append(after - before)
        print(f"{name:>12}: process {before * 1e3:6.1f} ms, bubblewrap {after * 1e3:6.1f} ms ({after / before:.2f}x)")
    print(f"bubblewrap vs process: {max(added) * 1e3:+.1f} ms per call at most (target: <= +50 ms)")


if __name__ == "__main__":
    main()
