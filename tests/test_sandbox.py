"""The Python tool's sandbox in normal use (print, sympy, errors, cut output, many calls in order) and
the remote sandbox against a real ``python -m envs.sandbox_server`` process on 127.0.0.1, directly and
behind a fault-injecting proxy (503s, an answer slower than the read timeout, a refused request)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from envs.sandbox import PythonSandbox, ToolResult, tool_result
from envs.service_keys import API_KEY_ENV
from fault_proxy import FaultProxy
from models.remote import ClientSettings, ServiceError
from models.remote_sandbox import RemoteSandbox

ROOT = Path(__file__).resolve().parents[1]
KEY = "mathrl-sandbox-test-key-8d21"
FAST = ClientSettings(connect_timeout=2.0, read_timeout=30.0, retries=2, backoff=0.01, max_backoff=0.05, api_key=KEY)


@pytest.fixture(scope="module")
def sandbox():
    with PythonSandbox(timeout_s=30.0, max_output_chars=64, workers=2) as box:
        yield box


def test_tool_result_keeps_the_error_line_within_the_cut():
    assert tool_result("abc\n", None, "", 3) == ToolResult("abc", True, None)
    assert tool_result("x" * 20, "E: bad", "E: bad", 10) == ToolResult("xxx\nE: bad", False, "E: bad")
    assert tool_result("", "timeout after 5.0 s", "", 100) == ToolResult("timeout after 5.0 s", False,
                                                                         "timeout after 5.0 s")
    assert tool_result("1\n", "killed by signal 9 (SIGKILL)", "", 100).output == "1\nkilled by signal 9 (SIGKILL)"


def test_print_sympy_and_errors(sandbox):
    assert sandbox.run("print(2 ** 10)") == ToolResult("1024\n", True, None)
    assert sandbox.run("import sympy\nx = sympy.Symbol('x')\nprint(sympy.factor(x**2 - 5*x + 6))") == \
        ToolResult("(x - 3)*(x - 2)\n", True, None)
    assert sandbox.run("print('partial')\n1 / 0") == ToolResult("partial\nZeroDivisionError: division by zero", False,
                                                                 "ZeroDivisionError: division by zero")
    assert sandbox.run("print(") == ToolResult("SyntaxError: '(' was never closed", False,
                                               "SyntaxError: '(' was never closed")
    assert sandbox.run("import sys\nsys.exit(3)") == ToolResult("exit status 3", False, "exit status 3")
    assert sandbox.run("import sys\nprint('done')\nsys.exit(0)") == ToolResult("done\n", True, None)
    assert sandbox.run("import sys\nprint('warned', file=sys.stderr)\nprint('ok')") == ToolResult("ok\n", True, None)


def test_output_is_cut(sandbox):
    assert sandbox.run("print('a' * 5000)") == ToolResult("a" * 64, True, None)
    result = sandbox.run("print('b' * 5000)\nraise ValueError('too big')")
    assert result == ToolResult("b" * (64 - 20) + "\nValueError: too big", False, "ValueError: too big")
    assert sandbox.run("print('é' * 100)").output == "é" * 64  # characters, not bytes


def test_calls_are_independent_and_in_order(sandbox):
    codes = [f"import os\nopen('n', 'a').write('x')\nprint({i}, len(open('n').read()), os.listdir('.'))"
             for i in range(12)]
    assert [r.output for r in sandbox.run_many(codes)] == [f"{i} 1 ['n']\n" for i in range(12)]
    assert sandbox.run("x = 1") == ToolResult("", True, None)
    assert sandbox.run("print(x)").error == "NameError: name 'x' is not defined"


def test_describe_isolation_names_every_layer(sandbox):
    lines = sandbox.describe_isolation().splitlines()
    layers = [line.split(":")[0] for line in lines if "namespace" in line.split(":")[0]]
    assert layers == ["network namespace", "private mount namespace", "PID namespace"] or \
        any(line.startswith("NO ") and "namespace" in line for line in lines)
    assert any(line.startswith(("Landlock ABI", "NO Landlock")) for line in lines)
    assert any(line.startswith(("seccomp filter: ", "NO seccomp filter")) for line in lines)
    assert lines[-1].startswith("rlimits per process: 5 CPU s, 512 MB address space, 16 MB per file, 32 processes")


def test_bad_limits_fail_before_starting():
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        PythonSandbox(timeout_s=0)
    with pytest.raises(ValueError, match="workers=0 must be >= 1"):
        PythonSandbox(workers=0)
    with pytest.raises(RuntimeError, match="raise memory_mb above"):
        PythonSandbox(memory_mb=8, workers=1)


@pytest.fixture(scope="module")
def server():
    """``python -m envs.sandbox_server`` on a free port (at most 10 s of wall clock per call, KEY), its URL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), API_KEY_ENV: KEY}
    process = subprocess.Popen([sys.executable, "-m", "envs.sandbox_server", "--port", "0", "--workers", "2",
                                "--timeout_s", "10"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        first = process.stdout.readline()  # "sandbox serving run_code on http://127.0.0.1:PORT"
        assert first.startswith("sandbox serving run_code on http://127.0.0.1:"), first
        yield first.split()[-1]
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0
        process.stdout.close()


def test_remote_sandbox_answers_as_the_local_one(server, sandbox):
    remote = RemoteSandbox(server, timeout_s=10.0, max_output_chars=64, settings=FAST)
    codes = ["print(2 ** 10)", "print('partial')\n1 / 0", "print('a' * 5000)",
             "import sympy\nprint(sympy.factor('x**2 - 1'))", "import ctypes\nctypes.string_at(0)"]
    assert remote.run_many(codes) == [sandbox.run(code) for code in codes]
    hasty = RemoteSandbox(server, timeout_s=1.0, settings=FAST)  # run_timeout shortens the server's 10 s
    assert hasty.run("import time\ntime.sleep(30)") == ToolResult("timeout after 1.0 s", False, "timeout after 1.0 s")
    with urllib.request.urlopen(f"{server}/health", timeout=10) as answer:
        assert b"rlimits per process" in answer.read()


def test_remote_sandbox_retries_and_times_out(server):
    with FaultProxy(server, fail_first=2) as proxy:  # two 503s, then the server
        remote = RemoteSandbox(proxy.url, timeout_s=10.0, settings=FAST)
        assert remote.run("print('after retries')") == ToolResult("after retries\n", True, None)
        assert remote.client.retried == 2 and proxy.forwarded == 1
    slow = ClientSettings(connect_timeout=2.0, read_timeout=5.0, retries=1, backoff=0.01, api_key=KEY)
    with FaultProxy(server, slow_first=1, delay=10.0) as proxy:  # the first answer comes after the read timeout
        remote = RemoteSandbox(proxy.url, timeout_s=4.0, settings=slow)
        assert remote.run("print('second try')") == ToolResult("second try\n", True, None)
        assert remote.client.retried == 1  # it gave up on the held answer and asked again
    with FaultProxy(server, fail_first=100) as proxy, pytest.raises(ServiceError, match="failed 3 times"):
        RemoteSandbox(proxy.url, timeout_s=1.0, settings=FAST).run("print(1)")


def test_remote_sandbox_refusals_are_errors(server):
    with FaultProxy(server, fail_first=100, fail_status=400) as proxy, pytest.raises(ServiceError, match="HTTP 400"):
        RemoteSandbox(proxy.url, timeout_s=1.0, settings=FAST).run("print(1)")
    with pytest.raises(ValueError, match="read_timeout=2.0 s must exceed timeout_s=5.0 s"):
        RemoteSandbox(server, timeout_s=5.0, settings=ClientSettings(read_timeout=2.0))
