"""A warm worker of ``envs.sandbox.PythonSandbox``, run as a script (standard library only):

    python -I envs/sandbox_worker.py CONFIG_JSON   # {"limits": {...}, "base_dir": DIR, "preload": [...], "cgroup": DIR}

It answers JSON lines on stdout to JSON lines on stdin: first ``{"isolation": [lines]}`` once ready,
then one record ``{"stdout", "error_line", "error", "return_code", "timed_out"}`` per
``{"code"}``. It exits when stdin closes.

Start-up (once per worker), each step where the kernel allows it:

- the memory cgroup ``"cgroup"`` (made by the caller), bounded to the worker's own memory plus
  ``memory_mb``: every process a call starts is born in it;
- a network namespace of its own (no interface but a loopback that is down: no network at all), inside
  a user namespace when not root;
- a private mount namespace: /tmp, /var/tmp, /run and /dev/shm covered by empty tmpfs (the Python
  installation bound back where it lies below one), ``base_dir`` a tmpfs of 4 x ``max_file_mb``; as
  root, a directory that only root may enter (e.g. ``/root``) covered the same way, so that the calls
  can run under an unprivileged user id of their own and still import from it;
- a PID namespace whose init is the worker itself: everything a call starts, even a process that left
  its process group, is killed with one ``kill(-1, SIGKILL)`` after the call;
- a seccomp filter compiled once (``DENIED_SYSCALLS``), loaded by each call.

Per call, the worker forks; the child makes itself the kernel's first choice at the memory limit,
enters a new IPC namespace and a new session keyring, sets its rlimits, cleans its environment,
closes every inherited descriptor, enters a fresh directory (the only place it may write), restricts
itself with Landlock (file system: read the Python installation and system libraries, write its
directory; TCP bind and connect; signals and abstract sockets outside its domain), drops to its user
id, loads the seccomp filter and runs the code. The worker reads a bounded head of stdout and tail of
stderr until the child exits (its pidfd, whatever the call did with its descriptors) or the wall-clock
timeout, then kills and reaps everything left and deletes the directory (``remove_tree``: any depth).
"""

import builtins
import ctypes
import errno
import io
import json
import os
import resource
import select
import signal
import stat
import struct
import sys
import time
import traceback
from dataclasses import dataclass

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 0x1000, 0x4000, 0x40000, 0x2, 0x4
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/run", "/dev/shm")  # where hosts keep scratch files and unix sockets
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
SECCOMP_MODE_FILTER = 2
SYS_LANDLOCK = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # the same on every architecture
LANDLOCK_FS_FILE = 0b1100000000000111  # execute, write, read, truncate, ioctl: the rights a rule on a file may hold
LANDLOCK_READ = 0b1101  # execute, read file, read directory
CALL_UID_BASE = 0x5A000000  # + the worker's pid: a user id no account and no file on the machine has
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219}.get(os.uname().machine, -1)
KEYCTL_JOIN_SESSION_KEYRING = 1
MASKED_EQ, GT, EQ = 7, 6, 4  # libseccomp's comparisons of an argument
CLONE_NEW_FLAGS = (0x80, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
DENIED_SYSCALLS = (  # (name, errno, argument comparisons): what a call has no use for, each a way past a layer
    *[(name, errno.EPERM) for name in (
        "unshare", "setns", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "ptrace",
        "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "keyctl", "add_key", "request_key",
        "memfd_create", "memfd_secret", "userfaultfd", "perf_event_open", "mount", "umount2", "pivot_root", "chroot",
        "fsopen", "fsmount", "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr", "init_module",
        "finit_module", "delete_module", "kexec_load", "kexec_file_load", "swapon", "swapoff", "reboot", "acct",
        "quotactl", "name_to_handle_at", "open_by_handle_at", "syslog", "shmget", "msgget", "semget", "mq_open")],
    ("clone3", errno.ENOSYS),  # its flags sit in memory a filter cannot read; glibc falls back to clone
    *[("clone", errno.EPERM, (0, MASKED_EQ, flag, flag)) for flag in CLONE_NEW_FLAGS],
    *[(name, errno.EAFNOSUPPORT, (0, compare, family)) for name in ("socket", "socketpair")
      for compare, family in ((EQ, 0), *((EQ, f) for f in range(3, 10)), (GT, 10))],  # all but 1, 2, 10
)
STDERR_TAIL_BYTES = 16384
OUTPUT_LIMIT_BYTES = 2**20
SYSTEM_READ_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/etc/ld.so.cache", "/etc/localtime", "/dev/null",
                     "/dev/zero", "/dev/urandom", "/sys/devices/system/cpu")


def check(result: int, what: str) -> int:
    """``result`` of a libc call, or OSError naming ``what`` and errno."""
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def read_paths() -> list[str]:
    """Directories and files a call may read: the Python installation and the system libraries (real
    paths, existing ones only, none inside another)."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *SYSTEM_READ_PATHS)}
    paths = sorted(p for p in paths if os.path.exists(p))
    return [p for p in paths if not any(p.startswith(q + "/") for q in paths if q != p)]


@dataclass
class Namespaces:
    """What ``enter_namespaces`` set up: its isolation notes, whether the next fork starts a PID namespace,
    and whether calls may run under an unprivileged user id of their own."""

    notes: list[str]
    pid_namespace: bool
    own_uid: bool


def enter_namespaces(base_dir: str, paths: list[str], base_dir_mb: int) -> Namespaces:
    """Network, mount and PID namespaces where the kernel allows them; in the mount namespace, ``base_dir``
    (where the calls' directories are made) is a tmpfs of ``base_dir_mb`` MB."""
    notes, root = [], os.geteuid() == 0
    if not root:
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER) == 0:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    if libc.unshare(CLONE_NEWNET) == 0:
        notes.append("network namespace: no network interface at all (TCP, UDP, DNS, 127.0.0.1 unreachable)")
    else:
        notes.append(f"NO network namespace ({os.strerror(ctypes.get_errno())}): the network is reachable "
                     "unless Landlock below denies TCP")
    mounts = libc.unshare(CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
    if mounts:
        for directory in PRIVATE_DIRS:
            if os.path.isdir(directory) and not os.path.islink(directory):
                cover(directory, [p for p in paths if p.startswith(directory + "/")])
        os.makedirs(base_dir, mode=0o711, exist_ok=True)
        check(libc.mount(b"tmpfs", base_dir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                         f"mode=711,size={base_dir_mb}m,nr_inodes=65536".encode()), f"tmpfs on {base_dir}")
        notes.append(f"private mount namespace: {', '.join(PRIVATE_DIRS)} are empty (the host's files and unix "
                     f"sockets there out of reach); a call's directory is on a tmpfs of {base_dir_mb} MB (65536 "
                     "files), its files and directories all together")
    else:
        notes.append(f"NO mount namespace ({os.strerror(ctypes.get_errno())}): the host's /tmp, /run and /dev/shm "
                     "are visible (unix sockets there may be reached); a call's files are on the host's disk")
    own_uid = root and mounts
    if own_uid:
        expose_python(paths)
        notes.append("own user id per worker (unprivileged, no capabilities): RLIMIT_NPROC holds, root-only "
                     "files and other users' processes are out of reach")
    elif root:
        notes.append("runs as ROOT (no private mount namespace): RLIMIT_NPROC is not enforced, a fork bomb "
                     "is only stopped by the wall-clock timeout")
    pid_namespace = libc.unshare(CLONE_NEWPID) == 0
    if pid_namespace:
        notes.append("PID namespace: the call sees only its own processes; all of them are killed after the call")
    else:
        notes.append("NO PID namespace: processes that leave the call's process group may outlive the call")
    return Namespaces(notes, pid_namespace, own_uid)


def cover(directory: str, keep: list[str]) -> None:
    """In this (private) mount namespace, cover ``directory`` with an empty 1 MB tmpfs and bind each path
    of ``keep`` (inside it) back in place."""
    held = [os.open(path, os.O_PATH | os.O_CLOEXEC) for path in keep]  # reachable while the tmpfs hides them
    try:
        check(libc.mount(b"tmpfs", directory.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=755,size=1m"),
              f"tmpfs on {directory}")
        for path, fd in zip(keep, held):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                open(path, "x").close()
            check(libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None),
                  f"bind {path}")
    finally:
        for fd in held:
            os.close(fd)


def expose_python(paths: list[str]) -> None:
    """In the private mount namespace, cover each directory that blocks an unprivileged user from
    ``paths`` (e.g. ``/root``, mode 700, above a pyenv Python) with an empty tmpfs and bind those paths
    back in place."""
    blocked: dict[str, list[str]] = {}
    for path in paths:
        parts = path.split("/")
        ancestors = ["/".join(parts[:i]) or "/" for i in range(2, len(parts))]
        blocker = next((a for a in ancestors if not os.stat(a).st_mode & stat.S_IXOTH), None)
        if blocker is not None:
            blocked.setdefault(blocker, []).append(path)
    for blocker, inside in blocked.items():
        cover(blocker, inside)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    return max(0, libc.syscall(SYS_LANDLOCK["create_ruleset"], None, 0, 1))


def landlock_restrict(abi: int, reads: list[str], writes: list[str]) -> None:
    """Restrict this process and its children for good: read (and execute) ``reads``, write only below
    ``writes``; from ABI 4 no TCP bind or connect; from ABI 6 no signal or abstract socket outside."""
    fs = {1: 0x1FFF, 2: 0x3FFF, 3: 0x7FFF, 4: 0x7FFF}.get(abi, 0xFFFF)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = struct.pack("QQQ", fs, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)[:size]
    ruleset = check(libc.syscall(SYS_LANDLOCK["create_ruleset"], attr, len(attr), 0), "landlock_create_ruleset")
    try:
        for paths, access in ((reads, LANDLOCK_READ), (writes, fs)):
            for path in paths:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                allowed = access if stat.S_ISDIR(os.fstat(fd).st_mode) else access & LANDLOCK_FS_FILE
                rule = struct.pack("=Qi", allowed & fs, fd)
                check(libc.syscall(SYS_LANDLOCK["add_rule"], ruleset, 1, rule, 0), f"landlock rule on {path}")
                os.close(fd)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        check(libc.syscall(SYS_LANDLOCK["restrict_self"], ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


class Worker:
    """The warm process: forks one child per call (``run_child``) and collects what it gives."""

    def __init__(self, config: dict, namespaces: Namespaces, call_uid: int | None):
        self.limits, self.base_dir = config["limits"], config["base_dir"]
        self.pid_namespace, self.call_uid = namespaces.pid_namespace, call_uid
        self.reads, self.abi, self.calls = read_paths(), landlock_abi(), 0
        self.cgroup, memory_note = config["cgroup"], self.limit_memory(config["cgroup"])
        bpf, filter_note = syscall_filter()
        self.filter = None if bpf is None else ctypes.create_string_buffer(bpf, len(bpf))  # struct sock_filter[]
        self.filter_program = None if bpf is None else struct.pack(  # struct sock_fprog: length, pointer
            "HxxxxxxP", len(bpf) // 8, ctypes.addressof(self.filter))
        self.notes = namespaces.notes + [self.landlock_note(), filter_note, memory_note, self.limits_note()]
        if not self.pid_namespace:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a call come back here to be reaped

    def limit_memory(self, cgroup: str | None) -> str:
        """Bound the memory of the worker's cgroup (which holds every call) to what the worker uses now plus
        ``memory_mb``, swap included; its isolation note."""
        if cgroup is None:
            return ("NO memory cgroup (needs root and a memory controller): a call's memory is bounded only by "
                    "its processes' address spaces, its directory and the kernel's own limits (see rlimits)")
        limit = cgroup_value(cgroup, ("memory.usage_in_bytes", "memory.current")) + self.limits["memory_mb"] * 2**20
        for name, value in (("memory.limit_in_bytes", limit), ("memory.memsw.limit_in_bytes", limit),
                            ("memory.max", limit), ("memory.swap.max", 0)):
            if os.path.exists(os.path.join(cgroup, name)):
                with open(os.path.join(cgroup, name), "w") as f:
                    f.write(str(value))
        return (f"memory cgroup: a call's processes, files, pipes and kernel buffers together get "
                f"{self.limits['memory_mb']} MB beyond the worker's own, no swap; past it the kernel kills the call")

    def oom_kills(self) -> int:
        """Processes the kernel has killed in the worker's memory cgroup for its limit, so far (0 without one)."""
        return 0 if self.cgroup is None else cgroup_value(self.cgroup, ("memory.oom_control", "memory.events"),
                                                          "oom_kill")

    def landlock_note(self) -> str:
        if not self.abi:
            return "NO Landlock: the call may read every file this user may read and write where it may write"
        net = ", no TCP bind/connect" if self.abi >= 4 else " (TCP not covered: ABI < 4)"
        scope = ", no signals or abstract unix sockets outside the call" if self.abi >= 6 else ""
        return (f"Landlock ABI {self.abi}: reads only {', '.join(self.reads)}; writes only its own temporary "
                f"directory{net}{scope}; not covered: named unix sockets outside the private directories that the "
                "user id may open, /proc of its own processes, CPU caches and other side channels")

    def limits_note(self) -> str:
        lim = self.limits
        return (f"rlimits per process: {lim['cpu_seconds']} CPU s, {lim['memory_mb']} MB address space, "
                f"{lim['max_file_mb']} MB per file, {lim['max_processes']} processes, no core dumps; wall clock "
                f"{float(lim['timeout_s'])} s per call, whatever the call does with its descriptors; a new IPC "
                "namespace (System V IPC, POSIX message queues) and session keyring per call; environment emptied "
                "but for a minimal PATH; stdin closed")

    def serve(self) -> None:
        """Answer each request line until stdin closes."""
        out = sys.stdout.buffer
        out.write(json.dumps({"isolation": self.notes}).encode() + b"\n")
        out.flush()
        for line in sys.stdin.buffer:
            request = json.loads(line)
            timeout_s, longest = float(request.get("timeout_s", self.limits["timeout_s"])), self.limits["timeout_s"]
            timeout_s = timeout_s if 0 < timeout_s < longest else longest  # NaN too: the caller checks, never trust
            reply = self.call(request["code"], timeout_s)
            out.write(json.dumps(reply).encode() + b"\n")
            out.flush()

    def call(self, code: str, timeout_s: float) -> dict:
        """Run ``code`` in a fresh child for at most ``timeout_s`` seconds; its record (``reply``)."""
        self.calls += 1
        directory = os.path.join(self.base_dir, f"call-{self.calls}")
        os.mkdir(directory, 0o700)
        if self.call_uid is not None:
            os.chown(directory, self.call_uid, self.call_uid)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                run_child(code, directory, out_w, err_w, self)
            except BaseException:  # noqa: BLE001 - confining the child failed: say why on its stderr
                traceback.print_exc()
            finally:
                os._exit(70)
        os.close(out_w)
        os.close(err_w)
        try:
            oom_kills = self.oom_kills()
            stdout, stderr, stopped = self.collect(pid, out_r, err_r, timeout_s)
            _, status, usage = os.wait4(pid, 0)
            self.kill_rest(pid)
            if self.oom_kills() > oom_kills:
                stopped = stopped or f"memory limit ({self.limits['memory_mb']} MB)"
            stdout, stderr = drain(out_r, stdout, self.head_bytes()), drain(err_r, stderr, -STDERR_TAIL_BYTES)
        finally:
            os.close(out_r)
            os.close(err_r)
            remove_tree(directory)
        return self.reply(stdout, stderr, status, stopped, usage.ru_utime + usage.ru_stime)

    def head_bytes(self) -> int:
        return 4 * self.limits["max_output_chars"] + 4  # enough bytes for max_output_chars UTF-8 characters

    def output_limit(self) -> int:
        """Bytes of stdout and stderr together after which a call is stopped: reading 100 MB only to keep
        its first kilobyte would cost the worker seconds."""
        return max(OUTPUT_LIMIT_BYTES, 4 * self.head_bytes())

    def collect(self, pid: int, out_r: int, err_r: int, timeout_s: float) -> tuple[bytes, bytes, str | None]:
        """Read stdout's head and stderr's tail until the child exits; kill it when the deadline passes or
        its output passes ``output_limit`` bytes. Returns (stdout, stderr, why it was stopped or None).
        The child's exit (its pidfd), not the end of its pipes, ends the wait: a call that closes its
        stdout and stderr still meets the deadline."""
        deadline = time.monotonic() + timeout_s
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        for fd in (out_r, err_r, pidfd):
            poller.register(fd, select.POLLIN)
        stdout, stderr, total = b"", b"", 0
        try:
            while True:
                remaining = deadline - time.monotonic()
                limit = self.output_limit()
                stopped = (f"timeout after {float(timeout_s)} s" if remaining <= 0 else
                           f"output limit ({limit / 2**20:.1f} MB)" if total > limit else None)
                if stopped:
                    os.kill(pid, signal.SIGKILL)
                    return stdout, stderr, stopped
                ready = {fd for fd, _ in poller.poll(remaining * 1000)}
                for fd in ready - {pidfd}:
                    data = os.read(fd, 65536)
                    total += len(data)
                    if not data:
                        poller.unregister(fd)
                    elif fd == out_r:
                        stdout += data[:self.head_bytes() - len(stdout)]
                    else:
                        stderr = (stderr + data)[-STDERR_TAIL_BYTES:]
                if pidfd in ready:
                    return stdout, stderr, None
        finally:
            os.close(pidfd)

    def kill_rest(self, pid: int) -> None:
        """Kill and reap every process the call left (the child itself is reaped already). Without a PID
        namespace only its process group is killed, and only the dead are reaped: a process that left
        the group would block a waiting reaper."""
        while True:
            try:
                if self.pid_namespace:
                    os.kill(-1, signal.SIGKILL)  # as init of the namespace: every process in it but this one
                else:
                    os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                if os.waitpid(-1, 0 if self.pid_namespace else os.WNOHANG)[0] == 0:
                    return
            except ChildProcessError:
                return

    def reply(self, stdout: bytes, stderr: bytes, status: int, stopped: str | None, cpu_s: float) -> dict:
        """The call's record: stdout's head (text), the error's last line when the code exited with an
        error of its own (else ""), the one-line reason it failed (None when it did not), its exit status."""
        lines = stderr.decode("utf-8", "replace").splitlines()
        last_line = next((line for line in reversed(lines) if line.strip()), "")
        error = stopped or failure(status, cpu_s, last_line, self.limits)
        exited = os.WIFEXITED(status) and not stopped
        return {"stdout": stdout.decode("utf-8", "replace"), "error_line": last_line if exited and error else "",
                "error": error, "return_code": os.WEXITSTATUS(status) if exited else None,
                "timed_out": bool(stopped) and stopped.startswith("timeout")}


def failure(status: int, cpu_s: float, last_line: str, lim: dict) -> str | None:
    """The one-line reason a call that ended by itself failed, or None when it ran to its end within its limits."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu_s >= lim["cpu_seconds"]):
            return f"cpu limit ({lim['cpu_seconds']} s)"
        return f"killed by signal {number} ({signal.Signals(number).name})"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return None
    if "MemoryError" in last_line.split(":")[0] or "[Errno 12]" in last_line:  # ENOMEM: out of address space
        return f"memory limit ({lim['memory_mb']} MB)"
    if "File too large" in last_line:
        return f"file size limit ({lim['max_file_mb']} MB)"
    return last_line[:200] or f"exit status {code}"


def make_memory_cgroup(name: str) -> str | None:
    """A new memory cgroup ``name`` below this process's own (cgroup v1's memory hierarchy, or v2 where
    this cgroup delegates the memory controller), or None where none can be made (not root, no memory
    controller). The caller removes it (``remove_cgroup``)."""
    with open("/proc/self/cgroup") as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            parent = f"/sys/fs/cgroup/memory{path}"
        elif controllers == "" and os.path.exists(f"/sys/fs/cgroup{path}/cgroup.subtree_control"):
            with open(f"/sys/fs/cgroup{path}/cgroup.subtree_control") as f:
                if "memory" not in f.read().split():
                    continue
            parent = f"/sys/fs/cgroup{path}"
        else:
            continue
        try:
            os.mkdir(os.path.join(parent, name))
        except OSError:
            return None
        return os.path.join(parent, name)
    return None


def remove_cgroup(path: str, wait_s: float = 10.0) -> None:
    """Remove the cgroup ``path`` once the processes that were in it (killed) have gone."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return os.rmdir(path)
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise OSError(error.errno, f"cannot remove the sandbox's memory cgroup {path}: {error.strerror}")
        time.sleep(0.01)


def cgroup_value(cgroup: str, names: tuple[str, str], key: str | None = None) -> int:
    """The number in the first of ``names`` (cgroup v1's file, v2's) that ``cgroup`` has, or the one after
    ``key`` on its line of that file."""
    name = next(name for name in names if os.path.exists(os.path.join(cgroup, name)))
    with open(os.path.join(cgroup, name)) as f:
        text = f.read()
    return int(text) if key is None else next(int(line.split()[1]) for line in text.splitlines()
                                              if line.startswith(key + " "))


def remove_tree(path: str) -> None:
    """Delete the directory ``path`` and everything below it, at any depth, holding two descriptors and
    no recursion: each subdirectory's entries move up into ``path`` (as ``.up-N``, a name not taken)
    before it is removed, so a tree thousands of levels deep takes as many passes, not stack frames."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        names = os.listdir(top)
        taken, moved = set(names), 0
        while names:
            for name in names:
                if not stat.S_ISDIR(os.stat(name, dir_fd=top, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=top)
                    continue
                os.chmod(name, 0o700, dir_fd=top)  # a call may leave a directory it made unreadable
                inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    for entry in os.listdir(inner):
                        while f".up-{moved}" in taken:
                            moved += 1
                        os.rename(entry, f".up-{moved}", src_dir_fd=inner, dst_dir_fd=top)
                        moved += 1
                finally:
                    os.close(inner)
                os.rmdir(name, dir_fd=top)
            names = os.listdir(top)
    finally:
        os.close(top)
    os.rmdir(path)


def drain(fd: int, kept: bytes, limit: int) -> bytes:
    """Read what is left in a pipe whose writers are all dead; keep the first ``limit`` bytes, or the
    last ``-limit`` bytes when negative."""
    os.set_blocking(fd, False)
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return kept
        if not data:
            return kept
        kept = (kept + data)[limit:] if limit < 0 else (kept + data)[:limit]


def syscall_filter() -> tuple[bytes | None, str]:
    """The seccomp filter every call loads last, as a BPF program compiled once by libseccomp (through its
    own Python binding, else pyseccomp, its ctypes twin), or None where neither loads; and its isolation
    note. Loading the compiled program is one prctl; compiling it costs a call more than a millisecond."""
    try:
        import seccomp
    except ImportError:
        try:
            import pyseccomp as seccomp
        except (ImportError, OSError) as error:
            return None, (f"NO seccomp filter ({type(error).__name__}: {error}; pip install pyseccomp, with "
                          "libseccomp): a call may create user namespaces and use io_uring, bpf, keyctl, memfd, "
                          "System V IPC and every socket family the kernel offers")
    denied = seccomp.SyscallFilter(seccomp.ALLOW)
    unknown = []
    for name, error, *args in DENIED_SYSCALLS:
        try:
            denied.add_rule(seccomp.ERRNO(error), name, *(seccomp.Arg(*arg) for arg in args))
        except (ValueError, OSError, RuntimeError):
            unknown.append(name)  # older than this libseccomp: the kernel has no such call either
    not_known = f" ({', '.join(sorted(set(unknown)))} unknown to this libseccomp)" if unknown else ""
    with open(os.memfd_create("seccomp-bpf"), "w+b") as program:
        denied.export_bpf(program)
        program.seek(0)
        bpf = program.read()
    return bpf, ("seccomp filter: no namespaces (unshare, setns, clone with CLONE_NEW*), io_uring, bpf, "
                    "ptrace, keyctl, memfd, userfaultfd, perf events, mounts, kernel modules, System V IPC or "
                    "POSIX message queues, and sockets only of AF_UNIX, AF_INET, AF_INET6" + not_known)


def run_child(code: str, directory: str, out_w: int, err_w: int, worker: Worker) -> None:
    """In the forked child: confine this process, then run ``code``; exits, never returns normally."""
    lim = worker.limits
    os.setsid()
    os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.chdir(directory)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": directory, "TMPDIR": directory, "LANG": "C.UTF-8",
                       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # at the memory limit the kernel kills a process of the call, never the worker
    check(libc.unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")  # System V IPC and POSIX queues die with the call
    check(libc.syscall(SYS_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING, None), "join a new session keyring")
    for name, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, lim["cpu_seconds"]),
                        (resource.RLIMIT_AS, lim["memory_mb"] * 2**20),
                        (resource.RLIMIT_FSIZE, lim["max_file_mb"] * 2**20),
                        (resource.RLIMIT_NPROC, lim["max_processes"]), (resource.RLIMIT_NOFILE, 256)):
        hard = value + 1 if name == resource.RLIMIT_CPU else value  # SIGXCPU first, SIGKILL a second later
        resource.setrlimit(name, (value, hard))
    if worker.abi:
        landlock_restrict(worker.abi, worker.reads, [directory, "/dev/null"])
    if worker.call_uid is not None:
        os.setgroups([])
        os.setresgid(worker.call_uid, worker.call_uid, worker.call_uid)
        os.setresuid(worker.call_uid, worker.call_uid, worker.call_uid)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if worker.filter_program is not None:
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, worker.filter_program, 0, 0), "seccomp filter")
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    sys.argv = ["<tool>"]
    os._exit(execute(code))


def execute(code: str) -> int:
    """Run ``code`` as a ``__main__`` script; the exit status (1 after an exception, its traceback on stderr)."""
    status = 0
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (stop.code is not None)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the tool's own code failed: its traceback is the answer
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 1
    return status


def warm_sympy() -> None:
    """Run sympy's common paths once in the worker, so that the lazy imports and caches they fill are
    inherited by every call instead of being redone in each (a cold ``solve`` costs a call seconds)."""
    import sympy

    x = sympy.Symbol("x")
    sympy.factor(x**2 - 5 * x + 6), sympy.solve(x**2 - 2, x), sympy.expand((x + 1) ** 3)
    sympy.simplify(sympy.sin(x) ** 2 + sympy.cos(x) ** 2), sympy.integrate(x**2, x), sympy.diff(sympy.exp(x), x)
    sympy.Rational(1, 3) + sympy.sqrt(8), sympy.N(sympy.pi, 20), sympy.sympify("2*x + 1"), sympy.latex(x**2)


def check_memory(memory_mb: int, preload: list[str]) -> None:
    """A call inherits the worker's address space: ``memory_mb`` must leave room above it."""
    with open("/proc/self/status") as f:
        size_mb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) / 1024
    if size_mb + 64 > memory_mb:
        raise ValueError(f"memory_mb={memory_mb} leaves calls no room: the worker itself takes {size_mb:.0f} MB of "
                         f"address space after importing {preload}; raise memory_mb above {size_mb + 64:.0f}")


def main() -> None:
    if sys.path and os.path.dirname(os.path.abspath(__file__)) == os.path.abspath(sys.path[0]):
        sys.path.pop(0)  # the script's own folder (envs/) must not shadow modules for the calls
    config = json.loads(sys.argv[1])
    try:
        start(config)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it with the fix
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
        raise SystemExit(1) from error


def start(config: dict) -> None:
    """Enter the namespaces, fork the namespace's init (when there is one), preload, serve."""
    if config["cgroup"] is not None:
        with open(os.path.join(config["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))  # every process the worker forks is born in it
    paths = read_paths()
    namespaces = enter_namespaces(config["base_dir"], paths, 4 * config["limits"]["max_file_mb"])
    call_uid = CALL_UID_BASE + os.getpid() if namespaces.own_uid else None
    if namespaces.pid_namespace:
        child = os.fork()  # the first process of the new PID namespace: its init
        if child:
            os.close(0)
            os.close(1)
            os._exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) & 0xFF)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # killing the worker kills the namespace
    for module in config["preload"]:
        __import__(module)
    if "sympy" in config["preload"]:
        warm_sympy()
    check_memory(config["limits"]["memory_mb"], config["preload"])
    Worker(config, namespaces, call_uid).serve()


if __name__ == "__main__":
    main()
