"""The Python tool's sandbox: runs code a model wrote, each call in its own isolated process.

    with PythonSandbox(timeout_s=5.0) as sandbox:
        print(sandbox.describe_isolation())          # which isolation layers are in force
        result = sandbox.run("import sympy; print(sympy.factor('x**2-1'))")
        result.output, result.ok, result.error       # '(x - 1)*(x + 1)\\n', True, None

Why a pool of warm workers: starting Python and importing sympy takes most of a second, a tool call
should take milliseconds. Each worker (``envs/sandbox_worker.py``, started as a script so that it
imports only the standard library and what it preloads) imports sympy once, then forks one fresh
process per call. The forked process sets its limits (CPU seconds, address space, file size, process
count, no core dumps), cleans its environment, enters a fresh temporary directory, locks itself in
with the kernel's isolation layers (a memory cgroup; network, mount, PID and IPC namespaces; a new
session keyring; an unprivileged user id; Landlock; a seccomp filter) where the machine has them, and
runs the code. The worker enforces the wall-clock timeout, kills everything the call started, reads at
most a bounded part of its output and deletes its directory. ``describe_isolation()`` says which layers
are in force and what they do not cover. A worker that dies is replaced, never handed a call again.

``run_many`` spreads calls over the workers (one call at a time per worker). ``RemoteSandbox``
(``models.remote_sandbox``) gives the same ``run``/``run_many`` for a Sandbox Fusion-style service;
``python -m envs.sandbox_server`` serves this sandbox that way.

Model output is untrusted: this module never runs it in the calling process.
"""

from __future__ import annotations

import json
import math
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, Sequence

from envs.sandbox_worker import make_memory_cgroup, remove_cgroup, remove_tree

WORKER_SCRIPT = Path(__file__).with_name("sandbox_worker.py")
START_TIMEOUT_S = 120.0  # a worker's start-up: Python and the sympy import (seconds on a busy machine)
REPLY_GRACE_S = 60.0  # beyond the call's own timeout, before a silent worker is declared dead (busy machines)


@dataclass(frozen=True)
class ToolResult:
    """What one call gave back.

    Attributes:
        output: the call's stdout and, on failure, the error's last line (e.g. ``ZeroDivisionError:
            division by zero`` or ``timeout after 5.0 s``), cut to ``max_output_chars``.
        ok: the code ran to its end (exit status 0) within every limit.
        error: None when ``ok``; otherwise a one-line reason: ``timeout after 5.0 s``, ``memory limit
            (512 MB)``, ``cpu limit (5 s)``, ``file size limit (16 MB)``, ``output limit (1.0 MB)``
            (stdout and stderr together), ``killed by signal 11 (SIGSEGV)``, or the exception's last line.
    """

    output: str
    ok: bool
    error: str | None = None


def tool_result(stdout: str, error: str | None, error_line: str, max_output_chars: int) -> ToolResult:
    """The ``ToolResult`` of a call's stdout and, on failure, its reason (``error``) and the last line of
    its own error (``error_line``, "" when it has none): the output is stdout and the error's last line
    (or the reason), cut to ``max_output_chars`` so that the error's line always shows."""
    if error is None:
        return ToolResult(stdout[:max_output_chars], True, None)
    note = (error_line or error)[:max_output_chars]
    head = stdout[:max(0, max_output_chars - len(note) - 1)]
    separator = "\n" if head and not head.endswith("\n") else ""
    return ToolResult((head + separator + note)[:max_output_chars], False, error)


class Sandbox(Protocol):
    """What the env needs of a sandbox (``PythonSandbox``, ``models.remote_sandbox.RemoteSandbox``)."""

    def run(self, code: str) -> ToolResult: ...

    def run_many(self, codes: Sequence[str]) -> list[ToolResult]: ...

    def describe_isolation(self) -> str: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one call (see ``PythonSandbox``); sent to every worker as JSON."""

    timeout_s: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_output_chars: int = 1024
    max_file_mb: int = 16
    max_processes: int = 32

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"{name}={value} must be > 0")


class _Worker:
    """One warm worker process: a request line in (JSON), a reply line out (JSON)."""

    def __init__(self, limits: SandboxLimits, base_dir: Path, preload: Sequence[str]):
        self.base_dir, self.timeout_s = base_dir, limits.timeout_s
        self.cgroup = make_memory_cgroup(base_dir.name)
        config = json.dumps({"limits": asdict(limits), "base_dir": str(base_dir), "preload": list(preload),
                             "cgroup": self.cgroup})
        self.process = subprocess.Popen([sys.executable, "-I", str(WORKER_SCRIPT), config], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=_worker_environment(), start_new_session=True)
        self.ready = self._reply(START_TIMEOUT_S)
        if self.ready is None or "isolation" not in self.ready:
            self.close()
            reason = self.ready.get("error") if self.ready else "no answer"
            raise RuntimeError(f"the sandbox worker ({WORKER_SCRIPT}) did not start: {reason}; run "
                               f"`{sys.executable} {WORKER_SCRIPT} '{config}'` to see its error")

    def call(self, code: str, timeout_s: float) -> dict | None:
        """The worker's record of one call of at most ``timeout_s`` seconds (the worker holds it to its own
        limit), or None when it died or fell silent. A worker that died, fell silent or was interrupted
        mid-call is closed: its late reply would answer the next call."""
        try:
            self.process.stdin.write(json.dumps({"code": code, "timeout_s": timeout_s}).encode() + b"\n")
            self.process.stdin.flush()
            longest = timeout_s if 0 < timeout_s < self.timeout_s else self.timeout_s  # NaN too, as the worker reads it
            reply = self._reply(longest + REPLY_GRACE_S)
        except OSError:
            reply = None
        except BaseException:
            self.close()
            raise
        if reply is None or "stdout" not in reply:  # silent, dead, or failing in its own code
            self.close()
            return None
        return reply

    @property
    def alive(self) -> bool:
        return not self.process.stdin.closed and self.process.poll() is None

    def _reply(self, timeout_s: float) -> dict | None:
        """One JSON line from the worker within ``timeout_s``; None on EOF, silence or garbage."""
        stdout = self.process.stdout
        ready, _, _ = select.select([stdout], [], [], timeout_s)
        line = stdout.readline() if ready else b""
        try:
            return json.loads(line) if line else None
        except ValueError:
            return None

    def close(self) -> None:
        """Stop the worker (its PID namespace, and every call process in it, goes with it); idempotent."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()
        remove_tree(str(self.base_dir))
        if self.cgroup is not None:
            remove_cgroup(self.cgroup)
            self.cgroup = None


def _worker_environment() -> dict[str, str]:
    """The worker's environment: a minimal PATH and one thread per math library, nothing inherited
    (no keys, no tokens, no HOME)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


class PythonSandbox:
    """Runs Python code in isolated, limited processes forked from warm workers.

    Args:
        timeout_s: wall-clock seconds per call; then every process of the call is killed.
        cpu_seconds: CPU seconds per process of a call (RLIMIT_CPU).
        memory_mb: address space per process of a call, in MB (RLIMIT_AS).
        max_output_chars: the output is cut to this many characters (and read no further than a few
            times that many bytes).
        max_file_mb: the largest file a call may write, in MB (RLIMIT_FSIZE).
        max_processes: processes (and threads) a call may have at once (RLIMIT_NPROC, under a user
            id of its own where the machine allows one).
        workers: warm worker processes, i.e. calls run at once (default: the usable cores, at most 8).
        preload: modules each worker imports once so that calls importing them are fast.
    """

    def __init__(self, *, timeout_s: float = 5.0, cpu_seconds: int = 5, memory_mb: int = 512,
                 max_output_chars: int = 1024, max_file_mb: int = 16, max_processes: int = 32,
                 workers: int | None = None, preload: Sequence[str] = ("sympy",)):
        self.limits = SandboxLimits(timeout_s, cpu_seconds, memory_mb, max_output_chars, max_file_mb, max_processes)
        workers = min(8, len(os.sched_getaffinity(0))) if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.preload, self.workers = tuple(preload), workers
        self.lock = threading.Lock()
        self.idle: queue.Queue[_Worker | None] = queue.Queue()  # None: a slot whose worker must be started
        self.busy: set[_Worker] = set()  # workers running a call now (closed too by close())
        self.closed = False
        with ThreadPoolExecutor(workers) as pool:
            starts = [pool.submit(self._start_worker) for _ in range(workers)]
        failed = [start.exception() for start in starts if start.exception() is not None]
        started = [start.result() for start in starts if start.exception() is None]
        if failed:
            for worker in started:
                worker.close()
            raise failed[0]
        for worker in started:
            self.idle.put(worker)
        self.isolation = started[0].ready["isolation"]
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="sandbox")

    def _start_worker(self) -> _Worker:
        if self.closed:
            raise RuntimeError("this PythonSandbox is closed: make a new one")
        base_dir = Path(tempfile.mkdtemp(prefix="mathrl-sandbox-"))
        base_dir.chmod(0o711)  # a call may enter its own directory below it, under its own user id
        return _Worker(self.limits, base_dir, self.preload)

    def describe_isolation(self) -> str:
        """Which isolation layers are in force on this machine and what they do not cover (one line each)."""
        return "\n".join(self.isolation)

    def run(self, code: str) -> ToolResult:
        """Run one piece of code in a fresh sandboxed process; never raises for what the code does."""
        record = self.execute(code)
        return tool_result(record["stdout"], record["error"], record["error_line"], self.limits.max_output_chars)

    def execute(self, code: str, timeout_s: float | None = None) -> dict:
        """The raw record of one call: ``stdout`` (its head, a few times ``max_output_chars`` bytes),
        ``error`` (None or the one-line reason), ``error_line`` (the last line of the code's own error,
        or ""), ``return_code`` (None when killed) and ``timed_out``. ``run`` is this, made a ToolResult.
        ``timeout_s``: a shorter wall-clock limit for this call (never a longer one); ValueError unless
        it is a finite number of seconds > 0.

        A worker that died or fell silent is never handed out again: it is replaced before its slot
        takes another call (that call gets ``error="sandbox worker died"``); a slot whose replacement
        failed to start tries again at its next call, which raises RuntimeError if it fails again."""
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
        timeout_s = self.limits.timeout_s if timeout_s is None else min(timeout_s, self.limits.timeout_s)
        if self.closed:
            raise RuntimeError("this PythonSandbox is closed: make a new one")
        worker = self.idle.get()
        try:
            if worker is not None and not worker.alive:  # died while idle
                worker.close()
                worker = None
            worker = worker or self._start_worker()
            with self.lock:
                self.busy.add(worker)
            record = worker.call(code, timeout_s)
            with self.lock:
                self.busy.discard(worker)
            if record is None:  # call() closed it
                worker = self._start_worker()
                return {"stdout": "", "error": "sandbox worker died", "error_line": "", "return_code": None,
                        "timed_out": False}
            return record
        finally:
            with self.lock:
                self.busy.discard(worker)
            self.idle.put(worker if worker is not None and worker.alive else None)

    def run_many(self, codes: Sequence[str]) -> list[ToolResult]:
        """Run each piece of code as ``run`` does, as many at once as there are workers; results in order."""
        return list(self.pool.map(self.run, codes))

    def close(self) -> None:
        """Stop every worker, those still running a call from another thread too (that call gets
        "sandbox worker died" or raises), and delete their directories and cgroups (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.pool.shutdown(wait=True)
        with self.lock:
            busy = list(self.busy)
        for worker in busy:
            worker.close()
        while not self.idle.empty():
            worker = self.idle.get()
            if worker is not None:
                worker.close()

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
