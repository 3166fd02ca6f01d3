"""One writer per run directory: ``<run_dir>/run.lock``, held with ``fcntl.flock`` for the run's life.

A second process that would write the same run (``--resume auto`` while the run is still training: a
scheduler requeueing a job whose old process lingers, a pod restarted beside the old one) stops before
it touches anything, naming the holder's pid, host and start time, which the holder writes into the
file. The kernel releases a flock when its holder dies (exit, crash, SIGKILL), so a dead holder's lock
is simply taken: there is no stale lock to guess about. The file stays after the run; only the flock
means anything. Under torchrun rank 0 holds it. On NFSv4 flock is a lock the server keeps for
every client (Linux maps it onto byte-range locks); Lustre needs the ``flock`` mount option.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"

_held: dict[Path, int] = {}  # run directory -> the open descriptor that holds its lock (for the process's life)


class RunLockedError(RuntimeError):
    """Another live process holds the run directory's lock."""


def acquire(run_dir: Path) -> None:
    """Takes ``run_dir``'s lock for the rest of this process (a second call for the same directory is a
    no-op). Raises ``RunLockedError`` naming the holder when another live process has it."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise in_use(run_dir, describe_holder(run_dir)) from None
    previous = os.pread(fd, 4096, 0)
    if previous:
        log.info("taking over %s from %s, which is gone", run_dir / LOCK_FILE, previous.decode(errors="replace"))
    holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder, 0)
    os.fsync(fd)
    _held[run_dir] = fd


def in_use(run_dir: Path, who: str) -> RunLockedError:
    """The error for a run directory that ``who`` holds."""
    return RunLockedError(f"{run_dir} is in use by {who}: one process writes a run at a time. Wait for it to "
                          "end (or stop it), or start a separate run with another --experiment_name")


def release(run_dir: Path) -> None:
    """Gives up ``run_dir``'s lock (the process's exit does too)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """Gives up every lock this process holds."""
    for run_dir in list(_held):
        release(run_dir)


def holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock now (``describe_holder``), or None when no live process does."""
    path = Path(run_dir) / LOCK_FILE
    if Path(run_dir).resolve() in _held:
        return "this process"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as error:
        if error.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return describe_holder(run_dir)
    finally:
        os.close(fd)


def describe_holder(run_dir: Path) -> str:
    """"pid 123 on host h (since 2026-...)" from the lock file (what the holder wrote there)."""
    try:
        info = json.loads((Path(run_dir) / LOCK_FILE).read_text())
        return f"pid {info['pid']} on host {info['host']} (since {info['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file names none yet)"
