"""The Python tool on a remote sandbox: a Sandbox Fusion-style ``run_code`` service (Sandbox Fusion
itself, or ``python -m envs.sandbox_server`` on another machine), behind the same ``run``/``run_many``
as ``envs.sandbox.PythonSandbox``.

It lives in the model layer because it talks through ``models.remote.ServiceClient``, the client of
every service the trainer calls: the same connect and read timeouts, the same retries of connection
errors, timeouts and 502/503/504 with backoff, the same spreading over comma-separated replicas. A
retried call runs its code again, which is harmless: a call starts from nothing. When the service
cannot answer after the retries, or answers ``SandboxError``, ``run_many`` raises ``ServiceError``
naming the URL (nothing of the batch is returned); what the code itself does (an error, a timeout) is
a ``ToolResult``, as locally.
"""

from __future__ import annotations

from typing import Any, Sequence

from envs.sandbox import ToolResult, tool_result
from models.remote import ClientSettings, ServiceClient, ServiceError


class RemoteSandbox:
    """``run``/``run_many`` on a ``run_code`` service.

    Args:
        urls: base URL(s) of the service, e.g. ``http://127.0.0.1:8080`` (comma-separated replicas).
        timeout_s: the wall-clock limit asked of the service per call (``run_timeout``).
        max_output_chars: the output is cut to this many characters.
        settings: the client's timeouts, retries and concurrency; the read timeout must leave the
            service ``timeout_s`` to run the code.
    """

    def __init__(self, urls: str | Sequence[str], *, timeout_s: float = 5.0, max_output_chars: int = 1024,
                 settings: ClientSettings = ClientSettings()):
        if timeout_s <= 0 or max_output_chars < 1:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 and max_output_chars={max_output_chars} >= 1")
        if settings.read_timeout <= timeout_s:
            raise ValueError(f"read_timeout={settings.read_timeout} s must exceed timeout_s={timeout_s} s: the "
                             "client would give up on calls the service is still allowed to run")
        self.client = ServiceClient(urls, settings)
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars

    def describe_isolation(self) -> str:
        return (f"remote sandbox at {', '.join(self.client.urls)}: isolation is the service's own "
                "(python -m envs.sandbox_server reports its layers at GET /health)")

    def run(self, code: str) -> ToolResult:
        """Run one piece of code on the service (see ``run_many``)."""
        return self.run_many([code])[0]

    def run_many(self, codes: Sequence[str]) -> list[ToolResult]:
        """Run each piece of code on the service, concurrently; results in order."""
        payloads = [{"code": code, "language": "python", "run_timeout": self.timeout_s} for code in codes]
        answers = self.client.post_many("/run_code", payloads)
        return [self.result(answer) for answer in answers]

    def result(self, answer: Any) -> ToolResult:
        """The ``ToolResult`` of one ``run_code`` answer; ``ServiceError`` when the service failed."""
        where = ", ".join(self.client.urls)
        if not isinstance(answer, dict) or answer.get("status") == "SandboxError":
            message = answer.get("message") if isinstance(answer, dict) else str(answer)[:300]
            raise ServiceError(f"{where} run_code failed on the service's side: {message}")
        run = answer.get("run_result")
        if not isinstance(run, dict) or run.get("status") not in ("Finished", "TimeLimitExceeded"):
            raise ServiceError(f"{where} run_code answered without a run_result: {str(answer)[:300]}")
        stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
        if run["status"] == "TimeLimitExceeded":
            return tool_result(stdout, f"timeout after {float(self.timeout_s)} s", "", self.max_output_chars)
        if answer.get("status") == "Success" and run.get("return_code") == 0:
            return tool_result(stdout, None, "", self.max_output_chars)
        last_line = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        error = last_line[:200] or f"exit status {run.get('return_code')}"
        return tool_result(stdout, error, last_line, self.max_output_chars)

    def close(self) -> None:
        """Nothing to release (each request opens and closes its own connection)."""
