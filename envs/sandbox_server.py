"""``PythonSandbox`` behind HTTP, speaking Sandbox Fusion's ``run_code`` API (what ``--tool_url`` and
``models.remote_sandbox.RemoteSandbox`` call), for trainers that share one sandbox machine.

    python -m envs.sandbox_server [--host 127.0.0.1] [--port 8080] [--api_key KEY] [--workers N] [--timeout_s 5 ...]

Endpoints (JSON in and out; only the standard library serves):

    GET  /health    -> {"status": "ok", "isolation": [lines of describe_isolation()]}
    POST /run_code  {"code": str, "language": "python", "run_timeout": seconds (optional)}
                    -> {"status": "Success" | "Failed", "message": "", "compile_result": null,
                        "run_result": {"status": "Finished" | "TimeLimitExceeded", "execution_time": s,
                                       "return_code": int (-1: killed), "stdout": str, "stderr": str},
                        "files": {}}

``run_timeout`` may shorten the server's ``--timeout_s``, never lengthen it; the other limits are the
server's own (Sandbox Fusion's ``memory_limit_MB`` is ignored; a request with ``stdin``, ``files`` or
``fetch_files`` gets 400). ``stderr`` holds one line: the code's own error's last line, or why
it was stopped (``timeout after 5.0 s``, ``memory limit (512 MB)``, ``killed by signal 11 (SIGSEGV)``).
Bad input gets 400 ``{"error": ...}`` naming the field: a body that is not strict JSON (``NaN`` and
``Infinity`` included), a ``run_timeout`` that is not a finite number of seconds > 0; a request without
a ``Content-Length`` of plain digits gets 411, one over 16 MB 413. SIGTERM or SIGINT stop it cleanly.

Keys: with ``--api_key`` (default: $MATHRL_SERVICE_API_KEY) every request but ``GET /health`` must carry
``Authorization: Bearer <key>`` (``--tool_url`` clients send ``--service_api_key``); one without it, or
with another key, gets 401 (``envs.service_keys``). Without a key the server listens on a loopback
address only: anyone who can reach it runs code on this machine.

Load: connections wait in a listen backlog of 1024; at most 64 are served at once, each by its own
thread, and their calls wait for a free worker; a connection that sends nothing for ``--read_timeout_s``
(10 s) is dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from envs.sandbox import PythonSandbox
from envs.service_keys import API_KEY_ENV, authorized, check_exposure

MAX_BODY_BYTES = 16 * 2**20
MAX_CONNECTIONS = 64  # served at once; more wait in the listen backlog


class SandboxServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer holding the sandbox its handlers call (as many calls at once as it has workers)."""

    daemon_threads = True
    request_queue_size = 1024  # listen backlog: many clients connect at once (the default 5 resets them)

    def __init__(self, address: tuple[str, int], sandbox: PythonSandbox, api_key: str | None = None,
                 read_timeout_s: float = 10.0):
        super().__init__(address, Handler)
        self.sandbox, self.api_key, self.read_timeout_s = sandbox, api_key, read_timeout_s
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection in a thread of its own once one of ``MAX_CONNECTIONS`` slots is free (until
        then it waits in the backlog)."""
        self.slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def parse_run_code(body: bytes) -> tuple[str, float | None]:
    """(code, run_timeout) of a ``/run_code`` body; ValueError naming the bad field."""
    try:
        request = json.loads(body, parse_constant=reject_constant)
    except ValueError as error:
        raise ValueError(f"the body is not JSON: {error}") from error
    if not isinstance(request, dict) or not isinstance(request.get("code"), str):
        raise ValueError("'code' must be a string")
    if request.get("language", "python") != "python":
        raise ValueError(f"language={request.get('language')!r}: this sandbox runs only 'python'")
    for name in ("stdin", "files", "fetch_files"):
        if request.get(name):
            raise ValueError(f"{name} is not supported by this sandbox (send it empty or not at all)")
    timeout = request.get("run_timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):
        raise ValueError(f"run_timeout={timeout!r} must be a finite number of seconds > 0")
    return request["code"], timeout


def reject_constant(name: str) -> float:
    """``json.loads``'s hook for ``NaN``, ``Infinity`` and ``-Infinity``, which strict JSON has not."""
    raise ValueError(f"{name} is not JSON (send a finite number)")


def run_code_answer(record: dict, seconds: float) -> dict[str, Any]:
    """Sandbox Fusion's answer for one ``PythonSandbox.execute`` record."""
    failed = record["error"] is not None
    run_result = {"status": "TimeLimitExceeded" if record["timed_out"] else "Finished", "execution_time": seconds,
                  "return_code": -1 if record["return_code"] is None else record["return_code"],
                  "stdout": record["stdout"], "stderr": (record["error_line"] or record["error"] or "") + "\n" * failed}
    return {"status": "Failed" if failed else "Success", "message": "", "compile_result": None,
            "run_result": run_result, "files": {}}


class Handler(BaseHTTPRequestHandler):
    server: SandboxServer

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s  # on the connection's socket: a silent client cannot hold it
        super().setup()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            return self.reply(200, {"status": "ok", "isolation": self.server.sandbox.describe_isolation().splitlines()})
        if self.authorized():
            self.reply(404, {"error": f"no GET {self.path}: GET /health or POST /run_code"})

    def do_POST(self) -> None:  # noqa: N802
        if not self.authorized():
            return
        length = self.headers.get("Content-Length", "")
        if not (length.isascii() and length.isdigit()):
            self.close_connection = True
            return self.reply(411, {"error": f"Content-Length is {length!r}: send the JSON body with its length"})
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            return self.reply(413, {"error": f"a body of {length} bytes is over {MAX_BODY_BYTES}"})
        body = self.rfile.read(int(length))
        if self.path != "/run_code":
            return self.reply(404, {"error": f"no POST {self.path}: POST /run_code"})
        try:
            code, timeout = parse_run_code(body)
        except ValueError as error:
            return self.reply(400, {"error": str(error)})
        start = time.monotonic()
        try:
            record = self.server.sandbox.execute(code, timeout)
        except RuntimeError as error:  # no worker could be started (a loaded machine)
            return self.reply(503, {"error": f"SandboxError: {error}"}, {"Retry-After": "1"})
        self.reply(200, run_code_answer(record, round(time.monotonic() - start, 4)))

    def authorized(self) -> bool:
        return authorized(self, self.server.api_key, MAX_BODY_BYTES)

    def reply(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - one line per request is noise here
        pass


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m envs.sandbox_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free one)")
    parser.add_argument("--api_key", default=None, help=f"the key every request but GET /health must carry as "
                        f"'Authorization: Bearer KEY'. Default: ${API_KEY_ENV} (preferred: a flag shows in the "
                        "process list). Without one the server listens on loopback only")
    parser.add_argument("--read_timeout_s", type=float, default=10.0, help="a connection silent this long is dropped")
    parser.add_argument("--workers", type=int, default=None, help="calls run at once (default: usable cores, <= 8)")
    parser.add_argument("--timeout_s", type=float, default=5.0, help="wall-clock seconds per call (the longest)")
    parser.add_argument("--cpu_seconds", type=int, default=5, help="CPU seconds per process of a call")
    parser.add_argument("--memory_mb", type=int, default=512, help="address space per process of a call (MB)")
    parser.add_argument("--max_output_chars", type=int, default=16384, help="stdout kept per call (characters)")
    parser.add_argument("--max_file_mb", type=int, default=16, help="largest file a call may write (MB)")
    parser.add_argument("--max_processes", type=int, default=32, help="processes a call may have at once")
    args = parser.parse_args(argv)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        check_exposure(args.host, args.api_key)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m envs.sandbox_server [--host H] [--port P] [limits...]``: serves until SIGTERM or SIGINT."""
    args = vars(parse_args(argv))
    host, port, api_key, read_timeout_s = (args.pop(key) for key in ("host", "port", "api_key", "read_timeout_s"))
    with PythonSandbox(**args) as sandbox:
        server = SandboxServer((host, port), sandbox, api_key, read_timeout_s)

        def stop(signum: int, frame: Any) -> None:  # shutdown() waits for serve_forever: call it from another thread
            threading.Thread(target=server.shutdown).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        access = "needs an API key on every request but GET /health" if api_key else "has no key: loopback only"
        print(f"the sandbox server {access}", file=sys.stderr, flush=True)
        print(f"sandbox serving run_code on {server.url}\n{sandbox.describe_isolation()}", flush=True)
        server.serve_forever()
        server.server_close()


if __name__ == "__main__":
    main()
