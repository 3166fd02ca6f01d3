"""Hostile code in the Python tool's sandbox: each attack is contained within its limits, the caller
(this test process) is unharmed, the call gets a one-line error, and nothing is left behind: no
process, no file, no descriptor. The fork bomb runs last.

The limits are small (1 CPU second, 256 MB, 4 MB files, 16 processes) so that the suite stays fast.
The sandbox's wall clock is long (60 s) so that an attack that needs CPU time to reach its limit gets
there even on a busy machine; the attacks that only wait run under a 2 s wall clock of their own.
"""

from __future__ import annotations

import base64
import ctypes
import gzip
import io
import math
import os
import socket
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from envs.sandbox import PythonSandbox, ToolResult, tool_result
from envs.sandbox_worker import remove_tree

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


def test_a_tree_deeper_than_pythons_recursion_limit(sandbox):
    """Deleting the call's directory takes no recursion: the next calls, on either worker, answer. (Landlock
    checks each access up the whole path, so a call's CPU limit bounds how deep it can go.)"""
    code = ("import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\n    open('f', 'w').close()\n"
            "os.mkdir('locked')\nos.chmod('locked', 0)\nos.chmod('.', 0o500)\nprint('built')")
    assert sandbox.run(code) == ToolResult("built\n", True, None)
    start = time.monotonic()
    assert [r.output for r in sandbox.run_many(["print(6 * 7)"] * 4)] == ["42\n"] * 4
    assert time.monotonic() - start < 10
    assert_unharmed(sandbox)


def test_remove_tree_takes_any_depth_and_follows_no_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("kept")
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    (root / ".up-0").mkdir()  # the names it moves entries to are taken already
    (root / ".up-1").write_text("x")
    directory = os.open(root, os.O_RDONLY)
    for _ in range(3000):  # deeper than a path may be long: by descriptors
        os.mkdir("d", dir_fd=directory)
        inner = os.open("d", os.O_RDONLY, dir_fd=directory)
        os.close(directory)
        directory = inner
    os.symlink(outside, "link", dir_fd=directory)
    os.fchmod(directory, 0)
    os.close(directory)
    remove_tree(str(root))
    assert not root.exists() and (outside / "keep").read_text() == "kept"
    remove_tree(str(root))  # gone already: nothing to do


@pytest.mark.parametrize("descriptors", [
    "os.close(1)\nos.close(2)",
    "null = os.open('/dev/null', os.O_WRONLY)\nos.dup2(null, 1)\nos.dup2(null, 2)",
    "if os.fork():\n    os._exit(0)\nos.setsid()\nos.close(1)\nos.close(2)",  # its orphan sleeps on
])
def test_the_wall_clock_holds_whatever_a_call_does_with_its_descriptors(sandbox, descriptors):
    start = time.monotonic()
    result = run(sandbox, f"import os, time\n{descriptors}\ntime.sleep(60)", 2.0)
    assert result.error in {TIMEOUT, None} and time.monotonic() - start < 10, result
    assert_unharmed(sandbox)


def test_a_dead_worker_is_never_handed_out_again(sandbox):
    """Both workers killed from outside: each slot's next call says so, and every later call is served."""
    killed = list(sandbox.idle.queue)
    for worker in killed:
        worker.process.kill()
        worker.process.wait()
    try:
        results = sandbox.run_many(["print(1)"] * 8)
        assert {r.error for r in results} <= {None, "sandbox worker died"}
        assert sum(r.error == "sandbox worker died" for r in results) <= 2
        assert [r.output for r in sandbox.run_many(["print(6 * 7)"] * 6)] == ["42\n"] * 6
        assert not any(worker.base_dir.exists() or worker.cgroup for worker in killed)  # cleaned up, not leaked
    finally:
        sandbox.baseline = descendants()  # the new workers (the later tests' baseline, whatever happened here)
    assert_unharmed(sandbox)


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, -1.0, 0.0, True, "5"])
def test_a_timeout_that_is_not_finite_seconds_is_refused(sandbox, timeout_s):
    with pytest.raises(ValueError, match="must be a finite number of seconds > 0"):
        sandbox.execute("print(1)", timeout_s)
    worker = sandbox.idle.get()
    try:  # a worker that is sent NaN anyway falls back to its own limit
        assert worker.call("print(1)", math.nan)["stdout"] == "1\n"
    finally:
        sandbox.idle.put(worker)
    assert_unharmed(sandbox)


PROBE = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n" \
        "def probe(name, result):\n    print(name, 'ok' if result >= 0 else os.strerror(ctypes.get_errno()))\n"
DENIED = "Operation not permitted"
SECCOMP = "seccomp filter: "
KEY_CALLS = {"x86_64": {"add_key": 248, "keyctl": 250}, "aarch64": {"add_key": 217, "keyctl": 219}}


def seccomp_in_force(sandbox: PythonSandbox) -> bool:
    return any(line.startswith(SECCOMP) for line in sandbox.describe_isolation().splitlines())


def test_system_v_ipc_and_message_queues_die_with_the_call(sandbox):
    create = PROBE + ("probe('shmget', libc.shmget(0x5A17, 64 << 20, 0o1600))\n"
                      "probe('msgget', libc.msgget(0x5A17, 0o1600))\nprobe('semget', libc.semget(0x5A17, 4, 0o1600))\n"
                      "probe('mq_open', libc.mq_open(b'/mathrl-probe', os.O_CREAT | os.O_RDWR, 0o600, None))\n"
                      "print(os.readlink('/proc/self/ns/ipc'))")
    find = PROBE + "probe('shmget', libc.shmget(0x5A17, 0, 0))\nprobe('msgget', libc.msgget(0x5A17, 0))"
    created = [r.output.splitlines() for r in sandbox.run_many([create] * 2)]
    if seccomp_in_force(sandbox):
        assert [lines[:4] for lines in created] == [[f"{name} {DENIED}" for name in
                                                     ("shmget", "msgget", "semget", "mq_open")]] * 2
    assert all(lines[-1] != os.readlink("/proc/self/ns/ipc") for lines in created)  # an IPC namespace per call
    for result in sandbox.run_many([find] * 2):
        assert "ok" not in result.output, result
    with open("/proc/sysvipc/shm") as segments:
        assert f"{0x5A17:d}" not in {line.split()[0] for line in segments.readlines()[1:]}
    assert_unharmed(sandbox)


@pytest.mark.skipif(os.uname().machine not in KEY_CALLS, reason="the key syscalls' numbers are known here for two "
                                                                "architectures")
def test_keyrings_are_out_of_reach(sandbox):
    """A key in the caller's session keyring cannot be found or read; nothing a call puts in its user
    keyring reaches a later call."""
    calls = KEY_CALLS[os.uname().machine]
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(calls["add_key"], b"user", b"mathrl-sandbox-test", SECRET.encode(), len(SECRET), -3)
    assert key > 0, os.strerror(ctypes.get_errno())
    try:
        keyctl = calls["keyctl"]
        steal = PROBE + (f"buffer = ctypes.create_string_buffer(256)\n"
                         f"probe('search', libc.syscall({keyctl}, 10, -3, b'user', b'mathrl-sandbox-test', 0))\n"
                         f"probe('read', libc.syscall({keyctl}, 11, {key}, buffer, 256))\nprint(buffer.value)")
        carry = PROBE + f"probe('add', libc.syscall({calls['add_key']}, b'user', b'carried', b'data', 4, -4))"
        fetch = PROBE + f"probe('search', libc.syscall({calls['keyctl']}, 10, -4, b'user', b'carried', 0))"
        results = sandbox.run_many([steal] * 2 + [carry] * 2 + [fetch] * 2)
        assert all(SECRET not in r.output and " ok" not in r.output for r in results), results
        if seccomp_in_force(sandbox):
            assert all(DENIED in r.output for r in results)
    finally:
        libc.syscall(calls["keyctl"], 3, key)  # revoke
        libc.syscall(calls["keyctl"], 9, key, -3)  # unlink
    assert_unharmed(sandbox)


def test_memory_outside_the_address_space_is_bounded(sandbox):
    """memfd and /dev/shm are closed; the call's directory holds 4 x max_file_mb (16 MB) in all."""
    if "private mount namespace" not in sandbox.describe_isolation():
        pytest.skip("no mount namespace here: the call's directory is on the host's disk")
    files = "for i in range(8):\n    open(f'f{i}', 'wb').write(bytes(3 * 2**20))\n    print(i)"
    assert assert_contained(sandbox, files, {"OSError: [Errno 28] No space left on device"}).startswith("0\n1\n2\n")
    shm = "open('/dev/shm/fill', 'wb').write(bytes(2**20))"
    assert_contained(sandbox, shm, {"PermissionError: [Errno 13] Permission denied: '/dev/shm/fill'",
                                    "OSError: [Errno 30] Read-only file system: '/dev/shm/fill'"})
    if seccomp_in_force(sandbox):
        assert_contained(sandbox, "import os\nos.memfd_create('fill')", {f"PermissionError: [Errno 1] {DENIED}"})


def test_memory_of_a_call_as_a_whole_is_bounded(sandbox):
    """Eight processes of 100 MB each (each under the address-space limit, 800 MB together) against the
    call's 256 MB: the kernel kills the call's processes, never the worker."""
    if not any(line.startswith("memory cgroup: ") for line in sandbox.describe_isolation().splitlines()):
        pytest.skip("no memory cgroup here (describe_isolation says why)")
    code = ("import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        block = b'1' * (100 * 2**20)\n"
            "        time.sleep(2)\n        os._exit(0)\nfor _ in range(8):\n    os.wait()")
    assert_contained(sandbox, code, {MEMORY})


def test_host_unix_sockets_are_out_of_sight(sandbox):
    """World-writable listeners in /tmp, /run and /dev/shm, and an abstract one: no call connects."""
    listeners, paths = [], []
    try:
        for directory in ("/tmp", "/run", "/dev/shm"):
            if os.path.isdir(directory):
                path = os.path.join(directory, f"mathrl-sandbox-test-{os.getpid()}.sock")
                listener = socket.socket(socket.AF_UNIX)
                listener.bind(path)
                os.chmod(path, 0o777)
                listener.listen()
                listener.settimeout(0.2)
                listeners.append(listener)
                paths.append(path)
        abstract = socket.socket(socket.AF_UNIX)
        abstract.bind(f"\0mathrl-sandbox-test-{os.getpid()}")
        abstract.listen()
        abstract.settimeout(0.2)
        listeners.append(abstract)
        for path in paths:
            assert_contained(sandbox, f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})",
                             {"FileNotFoundError: [Errno 2] No such file or directory"})
        assert_contained(sandbox, "import socket\nsocket.socket(socket.AF_UNIX).connect("
                                  f"'\\0mathrl-sandbox-test-{os.getpid()}')",
                         {f"PermissionError: [Errno 1] {DENIED}", "ConnectionRefusedError: [Errno 111] Connection "
                          "refused"})
        for listener in listeners:
            with pytest.raises(socket.timeout):
                listener.accept()
    finally:
        for listener in listeners:
            listener.close()
        for path in paths:
            os.unlink(path)


def test_kernel_interfaces_a_call_has_no_use_for_are_denied(sandbox):
    """New namespaces (its own capabilities in a user namespace), io_uring, memfd_secret, ptrace, setns,
    and socket families other than unix and IP (vsock, netlink, packet, AF_ALG)."""
    if not seccomp_in_force(sandbox):
        pytest.skip("no seccomp filter here (describe_isolation says why)")
    code = PROBE + ("for flag in (0x10000000, 0x00020000, 0x08000000, 0x40000000, 0x20000000):\n"
                    "    probe(f'unshare {flag:#x}', libc.unshare(flag))\n"
                    "probe('setns', libc.setns(0, 0))\nprobe('io_uring_setup', libc.syscall(425, 4, "
                    "ctypes.create_string_buffer(120)))\nprobe('memfd_secret', libc.syscall(447, 0))\n"
                    "probe('ptrace', libc.ptrace(0, 0, None, None))\nimport socket\n"
                    "for family in (40, 16, 17, 38):\n    try:\n        socket.socket(family, socket.SOCK_DGRAM)\n"
                    "        print(family, 'ok')\n    except OSError as error:\n        print(family, error.strerror)\n"
                    "print('unix', socket.socket(socket.AF_UNIX).family.name)")
    lines = sandbox.execute(code)["stdout"].splitlines()  # its head: more than max_output_chars
    assert lines == [f"unshare {flag:#x} {DENIED}" for flag in (0x10000000, 0x00020000, 0x08000000, 0x40000000,
                                                                0x20000000)] + \
        [f"{name} {DENIED}" for name in ("setns", "io_uring_setup", "memfd_secret", "ptrace")] + \
        [f"{family} Address family not supported by protocol" for family in (40, 16, 17, 38)] + ["unix AF_UNIX"]
    assert_unharmed(sandbox)
