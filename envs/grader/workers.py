"""The grading workers: processes that score requests (``scorers.SCORERS``) under a deadline and a memory
limit, so that no answer can hang or exhaust the caller.

min(2, cpu_count) persistent workers, forked on request by a template process: a fresh interpreter
(started with subprocess, so nothing of the caller, its threads or torch, is forked) that imports sympy
once and runs no threads, so forking it is safe and a replacement is ready in milliseconds. Not
multiprocessing.Process: its atexit hook in a forked child would terminate the parent's workers. A caller
waits for a verdict until its deadline, then has that worker killed, a replacement forked, and returns
False. Workers start lazily (``envs.grader.warm_up`` starts them ahead), are reused, run under a memory limit
and are killed at exit; a forked child of the caller starts its own pool.

The template loads this package's modules by their path, under a package name of its own whose ``__init__`` (the
caller's API) it does not run, and without the ``envs`` package above it (whose gymnasium and numpy the workers do
not need): hence the package's relative imports.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import NoReturn, Sequence

from .comparison import symbolic_verdict
from .scorers import SCORERS, math_verify_equiv

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT = 60.0  # seconds the template process may take to start (it imports sympy)
WORKER_MEMORY_BYTES = 2 << 30  # address-space limit of the template and of each worker

_READY = b"ready"
_TEMPLATE_MAIN = ("import importlib, importlib.util, sys; "  # this package's modules by path, as "mathrl_grader"
                  "spec = importlib.util.spec_from_file_location('mathrl_grader', sys.argv[1], "
                  "submodule_search_locations=[]); "
                  "sys.modules[spec.name] = importlib.util.module_from_spec(spec); "
                  "importlib.import_module('mathrl_grader.workers')._serve_template(int(sys.argv[2]), sys.argv[3:])")
_CHANNEL_TIMEOUT = 10.0  # seconds the template may take to fork or kill a worker


def _serve_template(fd: int, preload: Sequence[str] = ()) -> None:
    """The template process: loads sympy (and the packages ``preload`` names: the external graders') once,
    then forks a worker per b"fork" request (which carries the worker's socket) and kills and reaps one per
    b"kill PID". It runs no threads, so forking it is safe, and a replacement worker is ready in milliseconds."""
    _limit_memory()
    symbolic_verdict("x+1", "1+x")  # import sympy's lazily loaded parts once, for every worker
    for name in preload:
        importlib.import_module(name)
    if "math_verify" in preload:
        math_verify_equiv("x+1", "1+x")  # its LaTeX parser builds itself on a first call
    channel = socket.socket(fileno=fd)
    channel.send(_READY)
    workers: set[int] = set()
    while True:
        message, fds, _, _ = socket.recv_fds(channel, 64, 1)
        if not message:
            return  # the grading process has gone
        if message == b"fork" and fds:
            pid = os.fork()
            if pid == 0:
                channel.close()
                _serve_worker(fds[0])
            os.close(fds[0])
            workers.add(pid)
            channel.send(str(pid).encode())
        elif message.startswith(b"kill "):
            pid = int(message[len(b"kill "):])
            if pid in workers:  # only our own, unreaped children: their pids cannot have been reused
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                workers.discard(pid)
            channel.send(b"killed")


def _limit_memory() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError) as error:
        log.warning("grading workers run without a memory limit: %s", error)


def _serve_worker(fd: int) -> NoReturn:
    """A forked worker: a score per JSON [scorer, *arguments] request (``SCORERS``), sent back as its JSON
    number, until EOF, then exit."""
    connection = Connection(fd)
    try:
        while True:
            scorer, *arguments = json.loads(connection.recv_bytes())
            connection.send_bytes(json.dumps(_guarded_score(scorer, arguments)).encode())
    except (EOFError, OSError):
        os._exit(0)  # the grading process closed our socket
    except BaseException:  # noqa: BLE001 - never return into the template's loop
        os._exit(1)


def _guarded_score(scorer: str, arguments: list) -> float:
    try:
        return float(SCORERS[scorer](*arguments))
    except Exception:  # noqa: BLE001 - any failure (bounds, sympy, recursion, memory) means "not shown equal"
        return 0.0


class Template:
    """The template subprocess (a fresh interpreter: nothing of this process is forked) and the
    channel on which this process asks it for workers."""

    def __init__(self, preload: Sequence[str] = ()):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _TEMPLATE_MAIN, str(Path(__file__).resolve().with_name("__init__.py")),
                 str(theirs.fileno()), *preload],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        self.channel = ours
        self.lock = threading.Lock()
        try:
            self.channel.settimeout(WORKER_START_TIMEOUT)
            if self.channel.recv(16) != _READY:
                raise OSError(f"grading template pid {self.process.pid} exited with {self.process.poll()}")
            self.channel.settimeout(_CHANNEL_TIMEOUT)
        except OSError:
            self.close()
            raise

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self) -> Worker:
        ours, theirs = socket.socketpair()
        with theirs, self.lock:
            socket.send_fds(self.channel, [b"fork"], [theirs.fileno()])
            reply = self.channel.recv(32)
        if not reply.isdigit():
            ours.close()
            raise OSError(f"grading template pid {self.process.pid} did not fork a worker (reply {reply!r})")
        return Worker(int(reply), Connection(ours.detach()), self)

    def kill(self, pid: int) -> None:
        with self.lock:
            self.channel.send(f"kill {pid}".encode())
            self.channel.recv(16)

    def close(self) -> None:
        self.process.kill()
        self.channel.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            log.warning("grading template pid %d did not exit after SIGKILL", self.process.pid)


@dataclass(eq=False)
class Worker:
    """One forked grading process and this process's end of its socket."""
    pid: int
    connection: Connection
    template: Template

    def kill(self) -> None:
        self.connection.close()
        try:
            self.template.kill(self.pid)
        except OSError as error:  # the template is gone; the worker exits at its next read (EOF)
            log.warning("could not kill grading worker pid %d: %s", self.pid, error)


class Pool:
    """Up to ``size`` workers shared by every thread of the process that created it, their template having
    imported the packages ``preload`` names."""

    def __init__(self, size: int, preload: frozenset[str] = frozenset()):
        self.size = size
        self.preload = preload
        self.owner = os.getpid()
        self.changed = threading.Condition()
        self.idle: list[Worker] = []
        self.workers: set[Worker] = set()
        self.live = 0  # started + starting
        self.started = False  # a first worker has been ready
        self.closed = False
        self.template: Template | None = None
        self.template_lock = threading.Lock()

    def _fill(self) -> None:
        """Start workers in the background until ``size`` are live (call with ``changed`` held)."""
        while self.live < self.size and not self.closed:
            self.live += 1
            threading.Thread(target=self._start_worker, name="grader-worker-start", daemon=True).start()

    def _fork_worker(self) -> Worker:
        with self.template_lock:
            if self.template is None or not self.template.alive():
                self.template = Template(sorted(self.preload))
            return self.template.fork()

    def _start_worker(self) -> None:
        try:
            worker = self._fork_worker()
        except OSError as error:
            log.warning("could not start a grading worker: %s", error)
            with self.changed:
                self.live -= 1
                self.changed.notify_all()
            return
        with self.changed:
            if self.closed:
                worker.kill()
                return
            self.workers.add(worker)
            self.idle.append(worker)
            self.started = True
            self.changed.notify_all()

    def wait_started(self, timeout: float) -> None:
        """Wait (once per pool) until its first worker is ready: the one-time start-up."""
        with self.changed:
            self._fill()
            self.changed.wait_for(lambda: self.started or self.closed, timeout)

    def forget(self) -> None:
        """In a forked child: close our copies of the parent's sockets, so that the parent's
        workers still see EOF when the parent exits; kill nothing."""
        for worker in list(self.workers):
            worker.connection.close()
        if self.template is not None:
            self.template.channel.close()

    def take(self, count: int, deadline: float) -> list[Worker]:
        """Up to ``count`` idle workers, waiting until ``deadline`` for at least one."""
        with self.changed:
            self._fill()
            while not self.idle:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed:
                    return []
                self.changed.wait(remaining)
            taken, self.idle = self.idle[:count], self.idle[count:]
            return taken

    def give_back(self, workers: list[Worker]) -> None:
        with self.changed:
            self.idle.extend(workers)
            self.changed.notify_all()

    def discard(self, worker: Worker) -> None:
        """Kill a worker that overran or broke, and start its replacement."""
        worker.kill()
        with self.changed:
            self.workers.discard(worker)
            self.live -= 1
            self._fill()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            workers, self.workers, self.idle = list(self.workers), set(), []
        for worker in workers:
            worker.kill()
        with self.template_lock:
            if self.template is not None:
                self.template.close()

    def grade(self, items: list[list], timeout: float, deadline: float | None = None) -> list[float]:
        """Scores of ``items`` (each [scorer, *arguments], see ``SCORERS``) spread over the workers; each item
        gets ``timeout`` seconds from when it is sent (and none past ``deadline``); an overrun scores 0 and
        costs its worker."""
        verdicts = [0.0] * len(items)
        todo = deque(range(len(items)))
        running: dict[Connection, tuple[Worker, int, float]] = {}
        held: list[Worker] = []
        try:
            while todo or running:
                now = time.monotonic()
                if todo and not held:
                    wait_until = now + timeout if not running else now
                    held = self.take(min(len(todo), self.size), min(wait_until, deadline or wait_until))
                    if not held and not running:
                        break  # no worker came free in time: the rest stay False
                while todo and held:
                    worker, index = held.pop(), todo.popleft()
                    try:
                        worker.connection.send_bytes(json.dumps(items[index]).encode())
                    except OSError:
                        self.discard(worker)
                        continue
                    running[worker.connection] = (worker, index, min(now + timeout, deadline or math.inf))
                if not running:
                    continue
                first_deadline = min(item_deadline for _, _, item_deadline in running.values())
                for connection in wait(list(running), timeout=max(0.0, first_deadline - time.monotonic())):
                    worker, index, _ = running.pop(connection)
                    try:
                        verdicts[index] = float(json.loads(connection.recv_bytes()))
                        held.append(worker)
                    except (EOFError, OSError):
                        self.discard(worker)
                now = time.monotonic()
                for connection, (worker, index, item_deadline) in list(running.items()):
                    if item_deadline <= now:
                        del running[connection]
                        self.discard(worker)
        finally:
            for worker, _, _ in running.values():
                self.discard(worker)  # its answer would arrive out of turn
            self.give_back(held)
        return verdicts


_pool: Pool | None = None
_pool_lock = threading.Lock()


def get_pool(size: int | None = None, preload: frozenset[str] = frozenset()) -> Pool:
    """This process's pool (a new one after fork, when ``size`` changes or when its template lacks a package
    that ``preload`` names; the new one preloads the old one's too)."""
    global _pool
    with _pool_lock:
        if (_pool is None or _pool.owner != os.getpid() or (size is not None and size != _pool.size)
                or not preload <= _pool.preload):
            kept = frozenset()
            if _pool is not None and _pool.owner == os.getpid():
                kept = _pool.preload
                _pool.close()
            _pool = Pool(size or min(2, os.cpu_count() or 1), preload | kept)
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_lock
    if _pool is not None:
        _pool.forget()
    _pool, _pool_lock = None, threading.Lock()


def _close_pool_at_exit() -> None:
    if _pool is not None and _pool.owner == os.getpid():
        _pool.close()


os.register_at_fork(after_in_child=_forget_pool_after_fork)
atexit.register(_close_pool_at_exit)
