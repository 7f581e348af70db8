"""The Python sandbox holds: an infinite loop, a fork bomb, a memory hog, writes outside its directory, a network
connection, ctypes and an output flood each end in an error message within the limits, and the next run works."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from roll_backend.agentic.sandbox import SandboxLimits, SandboxResult, run_python

SLACK_S = 2.0  # start-up and a loaded 2-core machine
FAST = SandboxLimits(wall_s=5, cpu_s=1, memory_mb=256, output_bytes=4096)


def run_timed(code: str, limits: SandboxLimits = FAST) -> tuple[SandboxResult, float]:
    started = time.monotonic()
    result = run_python(code, limits)
    return result, time.monotonic() - started


def assert_run_goes_on() -> None:
    result = run_python("print(6 * 7)", FAST)
    assert (result.error, result.stdout, result.exit_code) == (None, "42\n", 0)


def test_normal_code_returns_its_stdout():
    result = run_python("import math, json\nprint(json.dumps({'root': math.isqrt(49)}))", FAST)
    assert result.ok and result.error is None
    assert result.stdout == '{"root": 7}\n' and result.stderr == "" and result.exit_code == 0
    assert result.as_tool_message() == '{"root": 7}'
    assert run_python("x = 1", FAST).as_tool_message() == "(no output)"


def test_infinite_loop_hits_the_cpu_limit():
    result, seconds = run_timed("while True:\n    pass")
    assert result.error == "CPU time limit of 1s exceeded"
    assert seconds < FAST.cpu_s + SLACK_S
    assert_run_goes_on()


def test_cpu_limit_holds_when_the_code_ignores_sigxcpu():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    result, seconds = run_timed(code)
    assert result.error == "CPU time limit of 1s exceeded"  # the limit is SIGKILL, which no handler catches
    assert seconds < FAST.cpu_s + SLACK_S


def test_sleeping_code_hits_the_wall_clock_and_keeps_what_it_printed():
    result, seconds = run_timed("import time\nprint('started')\ntime.sleep(60)", SandboxLimits(wall_s=1, cpu_s=1))
    assert result.error == "timed out after 1s (wall clock)" and result.exit_code is None
    assert result.stdout == "started\n"
    assert 1 <= seconds < 1 + SLACK_S
    assert_run_goes_on()


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['ls'])",
        "import os\nos.system('ls')",
        "import multiprocessing\nmultiprocessing.get_context('spawn').Process(target=print).start()",
        "import _posixsubprocess\n_posixsubprocess.fork_exec()",
    ],
    ids=["fork-bomb", "subprocess", "os.system", "multiprocessing", "posixsubprocess"],
)
def test_starting_processes_is_blocked(code):
    result, seconds = run_timed(code)
    assert result.error is not None and result.error.startswith("starting processes is blocked in the sandbox")
    assert seconds < SLACK_S
    assert "SandboxViolation" in result.as_tool_message() and "prelude.py" not in result.as_tool_message()
    assert_run_goes_on()


def test_a_fork_bomb_that_swallows_the_refusal_still_ends_at_the_cpu_limit():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except BaseException:\n        pass"
    result, seconds = run_timed(code)
    assert result.error == "CPU time limit of 1s exceeded"
    assert seconds < FAST.cpu_s + SLACK_S


def test_processes_allowed_by_the_limits_run_and_are_killed_with_the_group():
    marker = f"{31 + uuid.uuid4().int % 1000 / 1000:.3f}"  # a sleep duration no other process uses
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nprint(subprocess.check_output(['echo', 'hi']))"
    result = run_python(code, SandboxLimits(max_processes=4))
    assert result.error is None and result.stdout == "b'hi\\n'\n"
    leftovers = [pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]
    assert leftovers == []


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize(
    "code", ["x = bytearray(2 * 10**9)", "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"]
)
def test_memory_hog_hits_the_memory_limit(code):
    result, seconds = run_timed(code)
    assert result.error == "memory limit of 256 MB exceeded (MemoryError)"
    assert seconds < SLACK_S
    assert_run_goes_on()


def test_writing_outside_the_directory_never_reaches_the_host_and_inside_works(tmp_path):
    """The host's folders are not in the sandbox (its /tmp is its own tmpfs): each attempt fails, and the host file
    never appears. Paths outside the sandbox's folder get the audit hook's message."""
    target = tmp_path / f"escape_{uuid.uuid4().hex}"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/{target.name}', 'w')",
        f"import os\nfd = os.open('/etc', os.O_RDONLY)\nos.open({target.name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        f"open('f', 'w').close()\nimport os\nos.rename('f', {str(target)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
    ):
        result = run_python(code, FAST)
        assert result.error is not None, code
        assert not target.exists()
    assert tmp_path.exists()
    for path in ("/etc/planted", "/usr/planted", "/planted"):
        result = run_python(f"open({path!r}, 'w').write('x')", FAST)
        assert result.error == f"writing outside the sandbox directory is blocked: {path}"
        assert not Path(path).exists()
    inside = run_python("import os\nopen('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read(), os.getcwd())")
    text, workdir = inside.stdout.split()
    assert inside.ok and text == "kept"
    assert run_python(f"import os\nprint(os.path.exists({workdir + '/notes.txt'!r}))").stdout == "False\n"  # gone


def test_the_environment_carries_no_secrets(monkeypatch):
    monkeypatch.setenv("ROLL_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))", FAST)
    assert "ROLL_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout
    assert "HOME" in result.stdout


def test_network_connection_is_blocked_and_the_listener_sees_nothing():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        listener.setblocking(False)
        for code in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
            f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))",
            "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
        ):
            result, seconds = run_timed(code)
            assert result.error is not None and result.error.startswith("network access is blocked in the sandbox")
            assert seconds < SLACK_S
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection arrived
        assert_run_goes_on()


def test_network_is_reachable_when_allowed():
    """The same connection succeeds with network=True: the refusals above were the sandbox's, not the machine's."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\nprint('ok')"
        result = run_python(code, SandboxLimits(network=True))
        listener.settimeout(2)
        connection, _ = listener.accept()
        connection.close()
    assert result.error is None and result.stdout == "ok\n"


@pytest.mark.parametrize(
    "code",
    [
        "import ctypes\nctypes.CDLL(None).system(b'true')",
        "import importlib.util as u\nu.module_from_spec(u.find_spec('_ctypes'))",
    ],
    ids=["import", "module_from_spec"],
)
def test_ctypes_escape_is_blocked(code):
    result = run_python(code, FAST)
    assert result.error is not None and "is blocked in the sandbox (native code or processes)" in result.error
    assert_run_goes_on()


def test_libraries_that_try_ctypes_still_import():
    result = run_python(
        "import numpy as np\nprint(int(np.arange(5).sum()))", dataclasses.replace(FAST, libraries=["numpy"])
    )
    assert result.error is None and result.stdout == "10\n"


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    print('x' * 1000)",
        "print('x' * 10**7)",
        "import sys\nwhile True:\n    sys.stderr.write('e' * 1000)",
    ],
)
def test_output_flood_is_truncated_and_stopped(code):
    result, seconds = run_timed(code)
    assert result.error == "output truncated at 4096 bytes (the program was stopped)"
    assert len(result.stdout.encode()) <= 4096 and len(result.stderr.encode()) <= 4096
    assert seconds < FAST.wall_s  # stopped at the overflow, not at the deadline
    assert len(result.as_tool_message()) < 4096 + 2100
    assert_run_goes_on()


def test_errors_come_back_as_tracebacks():
    syntax = run_python("x = = 1", FAST)
    assert syntax.error == "exited with code 1: SyntaxError: invalid syntax" and syntax.exit_code == 1
    assert 'File "main.py", line 1' in syntax.as_tool_message()
    raised = run_python("def f():\n    return 1 / 0\nf()", FAST)
    assert raised.error == "exited with code 1: ZeroDivisionError: division by zero"
    message = raised.as_tool_message()
    assert 'File "main.py", line 3, in <module>' in message and "return 1 / 0" in message
    assert "prelude.py" not in message
    assert run_python("import sys\nsys.exit(3)", FAST).error == "exited with code 3"
    assert_run_goes_on()


def test_signalling_other_processes_and_raising_limits_are_blocked():
    killed = run_python(f"import os\nos.kill({os.getpid()}, 9)", FAST)  # this test's own process
    assert killed.error is not None and killed.error.startswith("signalling other processes is blocked")
    raised = run_python("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", FAST)
    assert raised.error == "changing resource limits is blocked in the sandbox"


def test_limits_are_validated_with_the_field_and_value():
    with pytest.raises(ValueError, match=r"sandbox.cpu_s=0 must be a positive number of seconds"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match=r"sandbox.memory_mb=8 is out of range; .*at least 64"):
        SandboxLimits(memory_mb=8)
    with pytest.raises(ValueError, match=r"sandbox.max_processes=-1 .*; sandbox.output_bytes=0"):
        SandboxLimits(max_processes=-1, output_bytes=0)


def test_the_python_tools_limits_are_checked_before_the_run_starts():
    from roll_backend.agentic.config import AgenticConfig
    from roll_backend.config.typed import build

    def problems(kwargs: dict) -> list[str]:
        return build(AgenticConfig, {"tools": [{"builtin": "python", "kwargs": kwargs}]}).problems()

    assert problems({"wall_s": 3, "libraries": ["numpy"]}) == []
    [unknown] = problems({"librarys": ["numpy"]})
    assert unknown.startswith("agentic.tools[0].kwargs: unknown sandbox limit(s) 'librarys'; known: wall_s, ")
    assert problems({"cpu_s": 0}) == ["agentic.tools[0].kwargs: sandbox.cpu_s=0 must be a positive number of seconds"]
    [missing] = problems({"libraries": ["numpy", "no_such_module_xyz"]})
    assert missing.startswith("agentic.tools[0].kwargs.libraries: no_such_module_xyz not installed here")
