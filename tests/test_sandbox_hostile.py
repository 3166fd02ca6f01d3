"""Hostile code in the Python tool's sandbox: each attack is contained within its limits, the caller
(this test process) is unharmed, the call gets a one-line error, and nothing is left behind: no
process, no file, no descriptor. The fork bomb runs last.

The limits are small (1 CPU second, 256 MB, 4 MB files, 16 processes) so that the suite stays fast.
The sandbox's wall clock is long (60 s) so that an attack that needs CPU time to reach its limit gets
there even on a busy machine; the attacks that only wait run under a 2 s wall clock of their own.
"""

from __future__ import annotations

import base64
import gzip
import io
import os
import socket
import zipfile
from pathlib import Path

import pytest

from envs.sandbox import PythonSandbox, ToolResult, tool_result

TIMEOUT = "timeout after 2.0 s"
MEMORY = "memory limit (256 MB)"
OUTPUT = "output limit (1.0 MB)"
CPU = "cpu limit (1 s)"
MAX_PROCESSES = 16
SECRET = "hunter2-sandbox-secret"


def descendants(pid: int = os.getpid()) -> set[int]:
    """Every process below ``pid`` (from /proc: the worker processes and anything a call left)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue  # it exited while we looked
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def sandbox():
    os.environ["MATHRL_SANDBOX_TEST_TOKEN"] = SECRET  # a key the caller holds: no call may see it
    try:
        with PythonSandbox(timeout_s=60.0, cpu_seconds=1, memory_mb=256, max_output_chars=200, max_file_mb=4,
                           max_processes=MAX_PROCESSES, workers=2) as box:
            box.baseline = descendants()  # the workers' own processes
            yield box
    finally:
        del os.environ["MATHRL_SANDBOX_TEST_TOKEN"]


def assert_unharmed(sandbox: PythonSandbox) -> None:
    """The sandbox still answers, with the same worker processes and nothing else below this process,
    and every call directory is gone."""
    assert sandbox.run("print(6 * 7)").output == "42\n"
    assert descendants() == sandbox.baseline
    assert [list(worker.base_dir.iterdir()) for worker in sandbox.idle.queue] == [[], []]


def run(sandbox: PythonSandbox, code: str, timeout_s: float | None) -> ToolResult:
    """``sandbox.run(code)``, under a shorter wall clock when ``timeout_s`` is given."""
    record = sandbox.execute(code, timeout_s)
    return tool_result(record["stdout"], record["error"], record["error_line"], sandbox.limits.max_output_chars)


def assert_contained(sandbox: PythonSandbox, code: str, errors: set[str], timeout_s: float | None = None) -> str:
    """Run ``code``: it fails with one of ``errors`` (one line); the caller is unharmed. Returns the output."""
    result = run(sandbox, code, timeout_s)
    assert not result.ok and result.error in errors, result
    assert "\n" not in result.error and len(result.output) <= 200
    assert_unharmed(sandbox)
    return result.output


def test_infinite_loop(sandbox):
    assert_contained(sandbox, "while True:\n    pass", {CPU})


def test_sleeping_forever_and_ignoring_sigterm(sandbox):
    code = ("import signal, time\nfor sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
            "    signal.signal(sig, signal.SIG_IGN)\nprint('ignoring', flush=True)\nwhile True:\n    time.sleep(0.05)")
    assert assert_contained(sandbox, code, {TIMEOUT}, timeout_s=2.0) == f"ignoring\n{TIMEOUT}"


def test_ten_gigabytes(sandbox):
    assert assert_contained(sandbox, "x = bytearray(10 * 2**30)", {MEMORY}) == "MemoryError"
    # Mapped without being touched, so the limit is reached at once: ENOMEM from mmap is the same limit.
    assert_contained(sandbox, "import mmap\nmaps = []\nwhile True:\n    maps.append(mmap.mmap(-1, 2**26))",
                     {MEMORY})


def test_a_hundred_megabytes_of_output(sandbox):
    """Stopped after 1 MB (the worker reads no more); the output is its head and the reason."""
    output = assert_contained(sandbox, "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)", {OUTPUT})
    assert output == "x" * (200 - len(OUTPUT) - 1) + "\n" + OUTPUT
    assert assert_contained(sandbox, "while True:\n    print('y' * 1000)", {OUTPUT}).startswith("y" * 150)
    result = sandbox.run("print('z' * 5000)")  # under the limit: cut to max_output_chars, not an error
    assert result == result.__class__("z" * 200, True, None)


def test_deep_recursion(sandbox):
    assert assert_contained(sandbox, "def f(n):\n    return f(n + 1)\nf(0)",
                            {"RecursionError: maximum recursion depth exceeded"}) == \
        "RecursionError: maximum recursion depth exceeded"
    # Past Python's guard, recursion in C (json's encoder on a nested list) overflows the C stack: SIGSEGV.
    assert_contained(sandbox, "import json, sys\nsys.setrecursionlimit(10**8)\nx = []\nfor _ in range(10**5):\n"
                              "    x = [x]\njson.dumps(x)", {"killed by signal 11 (SIGSEGV)"})


def test_segfault(sandbox):
    assert_contained(sandbox, "import ctypes\nctypes.string_at(0)", {"killed by signal 11 (SIGSEGV)"})


def test_writing_outside_its_directory(sandbox, tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("original")
    target.chmod(0o666)
    for path in (target, Path("/tmp/mathrl-sandbox-escape.txt"), Path.home() / "mathrl-sandbox-escape.txt"):
        assert_contained(sandbox, f"open({str(path)!r}, 'w').write('escaped')",
                         {"PermissionError: [Errno 13] Permission denied: " + repr(str(path)),
                          "FileNotFoundError: [Errno 2] No such file or directory: " + repr(str(path))})
    assert target.read_text() == "original"
    assert not Path("/tmp/mathrl-sandbox-escape.txt").exists()
    assert not (Path.home() / "mathrl-sandbox-escape.txt").exists()
    result = sandbox.run("open('own.txt', 'w').write('mine')\nprint(open('own.txt').read())")
    assert result.output == "mine\n" and result.ok  # its own directory is writable
    assert_unharmed(sandbox)


def test_reading_the_users_home(sandbox, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text(f"machine example.com password {SECRET}")
    (home / ".netrc").chmod(0o644)
    output = assert_contained(sandbox, f"print(open({str(home / '.netrc')!r}).read())",  # out of sight, or barred
                              {f"{error}: {str(home / '.netrc')!r}" for error in (
                                  "PermissionError: [Errno 13] Permission denied",
                                  "FileNotFoundError: [Errno 2] No such file or directory")})
    assert SECRET not in output
    # /root itself: in a call, either unreadable or (under the worker's tmpfs) holding only the Python install.
    listing = sandbox.run("import os\ntry:\n    print(*os.listdir('/root'))\nexcept OSError as e:\n    print(e)")
    assert not (set(os.listdir("/root")) - {".pyenv"}) & set(listing.output.split())
    environment = sandbox.run("import os\nprint(*sorted(os.environ))\nprint(os.environ['HOME'])")
    assert SECRET not in environment.output
    names, home_dir = environment.output.splitlines()
    assert names == "HOME LANG MKL_NUM_THREADS OMP_NUM_THREADS OPENBLAS_NUM_THREADS PATH TMPDIR"
    assert home_dir.startswith(tuple(str(worker.base_dir) for worker in sandbox.idle.queue))


def test_socket_to_a_real_listener(sandbox):
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp.bind(("127.0.0.1", 0))
        tcp.settimeout(0.2)
        udp.settimeout(0.2)
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=2)\n"
                "s.sendall(b'leak')")
        assert_contained(sandbox, code, {"PermissionError: [Errno 13] Permission denied",
                                         "OSError: [Errno 101] Network is unreachable"})
        code = ("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                f".sendto(b'leak', ('127.0.0.1', {udp.getsockname()[1]}))")
        assert_contained(sandbox, code, {"OSError: [Errno 101] Network is unreachable"})
        with pytest.raises(socket.timeout):
            tcp.accept()
        with pytest.raises(socket.timeout):
            udp.recv(16)


def test_killing_its_parent_and_everyone(sandbox):
    assert_contained(sandbox, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                     {"PermissionError: [Errno 1] Operation not permitted"})
    assert_contained(sandbox, f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
                     {"ProcessLookupError: [Errno 3] No such process",
                      "PermissionError: [Errno 1] Operation not permitted"})
    # -1: every process it may signal but itself: there is none.
    assert_contained(sandbox, "import os, signal\nos.kill(-1, signal.SIGKILL)",
                     {"ProcessLookupError: [Errno 3] No such process"})


def test_zip_bomb(sandbox):
    """Half a megabyte that inflates to 512 MB in memory (gzip members of 16 MB of zeros), and a zip
    archive whose member inflates to 16 MB on disk."""
    bomb = base64.b64encode(gzip.compress(bytes(2**24), compresslevel=9) * 32).decode()
    code = f"import base64, gzip\ndata = gzip.decompress(base64.b64decode('{bomb}'))\nprint(len(data))"
    assert_contained(sandbox, code, {MEMORY})
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("zeros", bytes(2**24))
    archive = base64.b64encode(buffer.getvalue()).decode()
    code = f"import base64, io, zipfile\nzipfile.ZipFile(io.BytesIO(base64.b64decode('{archive}'))).extractall()"
    assert_contained(sandbox, code, {"file size limit (4 MB)"})


def test_a_thousand_calls_leave_nothing_behind(sandbox):
    descriptors = open_descriptors()
    results = sandbox.run_many([f"print({i} * {i})" for i in range(1000)])
    assert [r.output for r in results] == [f"{i * i}\n" for i in range(1000)]
    assert all(r.ok for r in results)
    assert open_descriptors() == descriptors
    assert_unharmed(sandbox)


def test_process_limit(sandbox):
    """Children that sleep: forks fail at exactly max_processes (the call's own user id counts them all)."""
    if "own user id" not in sandbox.describe_isolation():
        pytest.skip("calls share the user id of the caller here: RLIMIT_NPROC counts the caller's processes too")
    code = ("import os, time\nn = 0\nfor _ in range(1000):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
            "        break\nprint(n)")
    result = sandbox.run(code)
    assert result == result.__class__(f"{MAX_PROCESSES - 1}\n", True, None)
    assert_unharmed(sandbox)  # the sleeping children are gone


def test_fork_bomb_last(sandbox):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    assert_contained(sandbox, code, {CPU, TIMEOUT}, timeout_s=2.0)  # 16 processes spin: either limit
