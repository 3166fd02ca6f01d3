"""An HTTP server for one process reward model that batches the requests of many clients into one
model call.

    python -m reward_models.serve --model DIR --port 8001 [--max_batch 64] [--max_wait_ms 5] [--api_key KEY]

Why: a PRM scores many solutions in one call for much less than one call each (on a GPU above all;
on a CPU less, see bench/prm_server.py), but its callers (RL workers, evaluation scripts, search
clients) each hold a few solutions at a time. Here the concurrent small requests of all clients are
scored together: each handler thread queues its request and waits; one worker thread, the only one
that touches the model, takes the first waiting request, keeps taking more until it holds
``max_batch`` solutions or ``max_wait_ms`` has passed since it took the first, calls ``step_scores``
once on all of them and hands each request its own rows. A request larger than ``max_batch`` is
scored alone, whole. Only the standard library serves (``http.server``, ``json``).

Endpoints (JSON in and out):

    GET  /health     -> {"status": "ok", "requests": R, "batches": C, "solutions": S}
                        (score requests answered, model calls, solutions scored, so far)
    GET  /v1/models  -> {"object": "list", "data": [{"id": NAME, "object": "model"}]}   (vLLM's shape)
    POST /v1/score   {"model": NAME (optional), "problems": [str] * B, "steps": [[str, ...]] * B,
                      "finished": [bool] * B (optional: True = not extended later, not kept in the KV cache)}
                     -> {"model": NAME, "step_scores": [[float, ...]] * B}

``step_scores[b]`` is ``ProcessRewardModel.step_scores(problems, steps, finished)[b]``: one score per
step (an action holding several steps gets one per step; left truncation drops the earliest). Bad
input gets 4xx ``{"error": "..."}`` naming the field; a model error gets 500 with its text for every
request of its batch; more than ``max_queue`` solutions waiting gets 503 with ``Retry-After: 1``. The
server keeps serving after each. SIGTERM or SIGINT shut it down cleanly (exit 0).

Keys: with ``--api_key`` (default: $MATHRL_SERVICE_API_KEY) every request but ``GET /health`` (a load
balancer's probe) must carry ``Authorization: Bearer <key>``, as ``vllm serve --api-key`` asks; one
without it, or with another key, gets 401 saying which, and a line on stderr (never the key). Without a
key the server listens on a loopback address only (127.0.0.1, ::1, localhost): anyone who can reach it
could use its GPU.

In-process (tests, benchmarks)::

    server = make_server(prm, "127.0.0.1", 0, "prm")
    threading.Thread(target=server.serve_forever, daemon=True).start()   # server.url: where it listens
    ...
    server.shutdown(); server.server_close()
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol, Sequence

from envs.service_keys import API_KEY_ENV, authorized, check_exposure

MAX_BODY_BYTES = 64 * 2**20
SCORE_FIELDS = ("model", "problems", "steps", "finished")
PRM_OPTIONS = ("prm_type", "step_tag", "good_token", "bad_token", "separator", "device", "dtype", "kv_cache_mb",
               "trust_remote_code", "check_labels")
"""The flags passed through to ``ProcessRewardModel`` (when given; otherwise its own defaults hold)."""


class StepScorer(Protocol):
    """What the server needs of a PRM (``reward_models.prm.ProcessRewardModel``)."""

    def step_scores(self, problems: Sequence[str], steps: Sequence[Sequence[str]],
                    finished: Sequence[bool] | None = None) -> list[Any]: ...


class RequestError(Exception):
    """An HTTP error answer: ``status`` and a one-line message (plus ``Retry-After`` when ``retry``)."""

    def __init__(self, status: int, message: str, retry: bool = False):
        super().__init__(message)
        self.status, self.retry = status, retry


@dataclass
class Pending:
    """One /v1/score request of B solutions, answered through ``future`` (B lists of scores)."""

    problems: list[str]
    steps: list[list[str]]
    finished: list[bool]
    future: Future = field(default_factory=Future)

    def __len__(self) -> int:
        return len(self.problems)


def brief(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(item, kind) for item in value)


def parse_score_request(body: bytes, name: str, max_request_items: int) -> Pending:
    """The ``Pending`` request of a /v1/score body; ``RequestError`` (400, or 404 for another model)
    naming the bad field and how to fix it."""
    try:
        request = json.loads(body)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise RequestError(400, f"the body is not JSON ({error}); send a JSON object with \"problems\" and \"steps\"")
    if not isinstance(request, dict):
        raise RequestError(400, f"the body is {brief(request)}, not a JSON object with \"problems\" and \"steps\"")
    unknown = sorted(set(request) - set(SCORE_FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; /v1/score takes {list(SCORE_FIELDS)}")
    model = request.get("model")
    if model is not None and model != name:
        raise RequestError(404, f"\"model\" is {brief(model)} but this server serves {name!r}; send {name!r} or "
                                "leave it out")
    problems, steps = request.get("problems"), request.get("steps")
    if not is_list_of(problems, str):
        raise RequestError(400, f"\"problems\" is {brief(problems)}; send a list of B problem texts (strings)")
    if not 1 <= len(problems) <= max_request_items:
        raise RequestError(400, f"\"problems\" holds {len(problems)} solutions; send 1 to {max_request_items} per "
                                "request (split larger ones)")
    if not isinstance(steps, list) or len(steps) != len(problems):
        raise RequestError(400, f"\"steps\" is {brief(steps)}; send a list of B={len(problems)} lists of step "
                                "strings, one per problem")
    for b, solution in enumerate(steps):
        if not is_list_of(solution, str) or not solution:
            raise RequestError(400, f"\"steps\"[{b}] is {brief(solution)}; each solution needs a non-empty list of "
                                    "step strings")
    finished = request.get("finished")
    if finished is None:
        finished = [False] * len(problems)
    elif not is_list_of(finished, bool) or len(finished) != len(problems):
        raise RequestError(400, f"\"finished\" is {brief(finished)}; send B={len(problems)} booleans or leave it out")
    return Pending(problems, steps, finished)


class Batcher:
    """Owns the PRM: queues requests (``submit``) and scores them in batches on its one worker thread."""

    def __init__(self, prm: StepScorer, max_batch: int, max_wait_ms: float, max_queue: int):
        self.prm, self.max_batch, self.max_wait, self.max_queue = prm, max_batch, max_wait_ms / 1000, max_queue
        self.waiting: deque[Pending] = deque()
        self.num_waiting = 0  # solutions in self.waiting
        self.counts = {"requests": 0, "batches": 0, "solutions": 0}
        self.closed = False
        self.condition = threading.Condition()
        self.worker = threading.Thread(target=self._run, name="prm-batcher", daemon=True)
        self.worker.start()

    def submit(self, pending: Pending) -> None:
        """Queues ``pending``; ``RequestError`` 503 when the queue is full (retry) or closed."""
        with self.condition:
            if self.closed:
                raise RequestError(503, "the server is shutting down")
            if self.num_waiting + len(pending) > self.max_queue:
                raise RequestError(503, f"{self.num_waiting} solutions are waiting and this request adds {len(pending)}"
                                        f", over max_queue={self.max_queue}; retry after 1 s", retry=True)
            self.waiting.append(pending)
            self.num_waiting += len(pending)
            self.condition.notify()

    def stats(self) -> dict[str, int]:
        with self.condition:
            return dict(self.counts)

    def close(self, timeout: float | None = None) -> None:
        """Stops the worker once it has scored what is waiting."""
        with self.condition:
            self.closed = True
            self.condition.notify_all()
        self.worker.join(timeout)

    def _take(self) -> Pending:
        pending = self.waiting.popleft()
        self.num_waiting -= len(pending)
        return pending

    def _next_batch(self) -> list[Pending]:
        """The first waiting request, then more until they hold ``max_batch`` solutions (the next does
        not fit) or ``max_wait`` has passed since the first was taken; [] once closed and drained."""
        with self.condition:
            while not self.waiting and not self.closed:
                self.condition.wait()
            if not self.waiting:
                return []
            batch = [self._take()]
            size, deadline = len(batch[0]), time.monotonic() + self.max_wait
            while size < self.max_batch:
                if self.waiting:
                    if size + len(self.waiting[0]) > self.max_batch:
                        break
                    batch.append(self._take())
                    size += len(batch[-1])
                elif self.closed or (left := deadline - time.monotonic()) <= 0 or not self.condition.wait(left):
                    break
        return batch

    def _run(self) -> None:
        while batch := self._next_batch():
            self._score(batch)

    def _score(self, batch: list[Pending]) -> None:
        """One ``step_scores`` call on the concatenated batch; each request gets its own rows, or the
        error (the worker lives on)."""
        try:
            scores = self.prm.step_scores([p for r in batch for p in r.problems], [s for r in batch for s in r.steps],
                                          [f for r in batch for f in r.finished])
            if len(scores) != sum(map(len, batch)):
                raise RuntimeError(f"the PRM returned {len(scores)} score lists for {sum(map(len, batch))} solutions")
            answers, start = [], 0
            for request in batch:
                answers.append([[float(x) for x in row] for row in scores[start : start + len(request)]])
                start += len(request)
        except Exception as error:  # noqa: BLE001 - any model error goes back to the callers
            print(f"PRM error on a batch of {len(batch)} requests: {error!r}", file=sys.stderr, flush=True)
            answers = [error] * len(batch)
        with self.condition:
            self.counts["batches"] += 1
            self.counts["requests"] += len(batch)
            self.counts["solutions"] += 0 if isinstance(answers[0], Exception) else sum(map(len, batch))
        for request, answer in zip(batch, answers):
            if isinstance(answer, Exception):
                request.future.set_exception(answer)
            else:
                request.future.set_result(answer)


class PRMServer(ThreadingHTTPServer):
    """A threading HTTP server (one thread per connection) in front of one ``Batcher``."""

    daemon_threads = True
    request_queue_size = 1024  # listen backlog: many clients connect at once (the default 5 drops SYNs)

    def __init__(self, address: tuple[str, int], batcher: Batcher, name: str, max_request_items: int,
                 api_key: str | None = None):
        self.batcher, self.name, self.max_request_items = batcher, name, max_request_items
        self.api_key = api_key
        super().__init__(address, Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def server_close(self) -> None:
        super().server_close()
        self.batcher.close(timeout=60)


class Handler(BaseHTTPRequestHandler):
    server: PRMServer
    protocol_version = "HTTP/1.1"  # keep-alive for clients that reuse their connection
    disable_nagle_algorithm = True  # else a body sent after its headers waits for the client's delayed ACK (40 ms)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?")[0]
        if path == "/health":
            self.reply(200, {"status": "ok", **self.server.batcher.stats()})
        elif not self.authorized():
            return
        elif path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": self.server.name, "object": "model"}]})
        else:
            self.reply_error(unknown_path("GET", path))

    def do_POST(self) -> None:  # noqa: N802
        if not self.authorized():
            return
        try:
            body = self.read_body()
            if self.path.split("?")[0] != "/v1/score":
                raise unknown_path("POST", self.path)
            pending = parse_score_request(body, self.server.name, self.server.max_request_items)
            self.server.batcher.submit(pending)
            try:
                scores = pending.future.result()
            except Exception as error:  # noqa: BLE001
                raise RequestError(500, f"the PRM failed on the batch holding this request: "
                                        f"{type(error).__name__}: {error}") from error
        except RequestError as error:
            self.reply_error(error)
            return
        self.reply(200, {"model": self.server.name, "step_scores": scores})

    def authorized(self) -> bool:
        """Whether the request carries the server's key; if not, it was answered 401 (``envs.service_keys``)."""
        return authorized(self, self.server.api_key, MAX_BODY_BYTES)

    def read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise RequestError(411, f"Content-Length is {length!r}; send the JSON body with its length")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(413, f"the body is {length} bytes, over {MAX_BODY_BYTES}; send fewer solutions per "
                                    "request")
        return self.rfile.read(int(length))

    def reply_error(self, error: RequestError) -> None:
        self.reply(error.status, {"error": str(error)}, {"Retry-After": "1"} if error.retry else {})

    def reply(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per request would cost more than scoring a small one; errors go to stderr


def unknown_path(method: str, path: str) -> RequestError:
    return RequestError(404, f"no endpoint {method} {path!r}; use GET /health, GET /v1/models or POST /v1/score")


def check_limits(max_batch: int, max_wait_ms: float, max_queue: int, max_request_items: int) -> None:
    """A ``ValueError`` naming the first batching or queue limit that cannot work."""
    for key, value, low in (("max_batch", max_batch, 1), ("max_wait_ms", max_wait_ms, 0),
                            ("max_request_items", max_request_items, 1)):
        if value < low:
            raise ValueError(f"{key}={value} must be >= {low}")
    if max_queue < max_request_items:
        raise ValueError(f"max_queue={max_queue} must be >= max_request_items={max_request_items}, or a largest "
                         "request would never fit in the queue")


def make_server(prm: StepScorer, host: str = "127.0.0.1", port: int = 0, name: str = "prm", max_batch: int = 64,
                max_wait_ms: float = 5.0, max_queue: int = 1024, max_request_items: int = 1024,
                api_key: str | None = None) -> PRMServer:
    """A listening (not yet serving) server of ``prm`` under ``name`` on ``host:port`` (0: a free port,
    see ``server.url``); its batching worker is running. Call ``serve_forever()``, then ``shutdown()``
    and ``server_close()``. ``api_key``: the bearer token every request but /health must carry (None:
    none, and only a loopback ``host``). Raises ``ValueError`` for a bad limit or an open host without a
    key, ``OSError`` naming the address when it cannot listen."""
    check_limits(max_batch, max_wait_ms, max_queue, max_request_items)
    check_exposure(host, api_key)
    batcher = Batcher(prm, max_batch, max_wait_ms, max_queue)
    try:
        return PRMServer((host, port), batcher, name, max_request_items, api_key)
    except OSError as error:
        batcher.close()
        raise OSError(error.errno, f"cannot listen on {host}:{port}: {error.strerror}; pick another --port "
                                   "(0: a free one) or --host") from error


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the PRM's model directory")
    parser.add_argument("--port", type=int, required=True, help="0: a free port (printed)")
    parser.add_argument("--host", default="127.0.0.1", help="another address than 127.0.0.1 needs a key")
    parser.add_argument("--api_key", default=None, help=f"the key every request but GET /health must carry as "
                        f"'Authorization: Bearer KEY'. Default: ${API_KEY_ENV} (preferred: a flag shows in the "
                        "process list)")
    parser.add_argument("--served_model_name", default=None, help="default: the model directory's name")
    parser.add_argument("--prm_type", choices=("shepherd", "classifier"), default=None)
    for option in ("step_tag", "good_token", "bad_token", "separator", "device", "dtype"):
        parser.add_argument(f"--{option}", default=None)
    parser.add_argument("--kv_cache_mb", type=float, default=None)
    parser.add_argument("--trust_remote_code", action="store_true", default=None,
                        help="run the model directory's own code (e.g. Qwen2.5-Math-PRM's)")
    parser.add_argument("--nocheck_labels", dest="check_labels", action="store_false", default=None,
                        help="serve a causal LM that does not score its labels as a shepherd PRM (to test the "
                             "scoring itself; see ProcessRewardModel's check_labels)")
    parser.add_argument("--max_batch", type=int, default=64, help="solutions per model call (a larger request: alone)")
    parser.add_argument("--max_wait_ms", type=float, default=5.0, help="how long a batch waits for more requests")
    parser.add_argument("--max_queue", type=int, default=1024, help="solutions waiting before 503")
    parser.add_argument("--max_request_items", type=int, default=1024, help="solutions per request at most")
    parser.epilog = "PRM options left out keep ProcessRewardModel's defaults."
    args = parser.parse_args(argv)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        check_limits(args.max_batch, args.max_wait_ms, args.max_queue, args.max_request_items)
        check_exposure(args.host, args.api_key)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from reward_models.prm import ProcessRewardModel  # after parsing: a bad flag fails before torch loads

    try:
        options = {key: getattr(args, key) for key in PRM_OPTIONS if getattr(args, key) is not None}
        prm = ProcessRewardModel(args.model, **options)
        name = args.served_model_name or Path(args.model).resolve().name
        server = make_server(prm, args.host, args.port, name, args.max_batch, args.max_wait_ms, args.max_queue,
                             args.max_request_items, args.api_key)
    except (OSError, ValueError) as error:  # ModelDirError is a ValueError
        raise SystemExit(f"error: {error}") from error

    def stop(signum: int, frame: Any) -> None:  # shutdown() waits for serve_forever: call it from another thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    access = "needs an API key on every request but GET /health" if args.api_key else "has no key: loopback only"
    print(f"the PRM server {access}", file=sys.stderr, flush=True)
    print(f"serving PRM {name} on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
