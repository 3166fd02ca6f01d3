"""``PythonSandbox`` behind HTTP, speaking Sandbox Fusion's ``run_code`` API (what ``--tool_url`` and
``models.remote_sandbox.RemoteSandbox`` call), for trainers that share one sandbox machine.

    python -m envs.sandbox serve [--host 127.0.0.1] [--port 8080] [--workers N] [--timeout_s 5 ...]

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
Bad input gets 400 ``{"error": ...}`` naming the field. SIGTERM or SIGINT stop it cleanly.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from envs.sandbox import PythonSandbox

MAX_BODY_BYTES = 16 * 2**20


class SandboxServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer holding the sandbox its handlers call (as many calls at once as it has workers)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], sandbox: PythonSandbox):
        super().__init__(address, Handler)
        self.sandbox = sandbox

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def parse_run_code(body: bytes) -> tuple[str, float | None]:
    """(code, run_timeout) of a ``/run_code`` body; ValueError naming the bad field."""
    try:
        request = json.loads(body)
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
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"run_timeout={timeout!r} must be a number of seconds > 0")
    return request["code"], timeout


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

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/health":
            return self.reply(404, {"error": f"no GET {self.path}: GET /health or POST /run_code"})
        self.reply(200, {"status": "ok", "isolation": self.server.sandbox.describe_isolation().splitlines()})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/run_code":
            return self.reply(404, {"error": f"no POST {self.path}: POST /run_code"})
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            return self.reply(413, {"error": f"a body of {length} bytes is over {MAX_BODY_BYTES}"})
        try:
            code, timeout = parse_run_code(self.rfile.read(length))
        except ValueError as error:
            return self.reply(400, {"error": str(error)})
        start = time.monotonic()
        record = self.server.sandbox.execute(code, timeout)
        self.reply(200, run_code_answer(record, round(time.monotonic() - start, 4)))

    def reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - one line per request is noise here
        pass


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m envs.sandbox serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free one)")
    parser.add_argument("--workers", type=int, default=None, help="calls run at once (default: usable cores, <= 8)")
    parser.add_argument("--timeout_s", type=float, default=5.0, help="wall-clock seconds per call (the longest)")
    parser.add_argument("--cpu_seconds", type=int, default=5, help="CPU seconds per process of a call")
    parser.add_argument("--memory_mb", type=int, default=512, help="address space per process of a call (MB)")
    parser.add_argument("--max_output_chars", type=int, default=16384, help="stdout kept per call (characters)")
    parser.add_argument("--max_file_mb", type=int, default=16, help="largest file a call may write (MB)")
    parser.add_argument("--max_processes", type=int, default=32, help="processes a call may have at once")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = vars(parse_args(argv))
    host, port = args.pop("host"), args.pop("port")
    with PythonSandbox(**args) as sandbox:
        server = SandboxServer((host, port), sandbox)

        def stop(signum: int, frame: Any) -> None:  # shutdown() waits for serve_forever: call it from another thread
            threading.Thread(target=server.shutdown).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        print(f"sandbox serving run_code on {server.url}\n{sandbox.describe_isolation()}", flush=True)
        server.serve_forever()
        server.server_close()
