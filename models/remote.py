"""The HTTP client of every service the trainer calls: vLLM's OpenAI-compatible server (the target
solver, generation) and the PRM server (``reward_models.serve``).

Big frozen models run on their own GPUs behind servers, so a slow, restarting or overloaded server
is normal operation, not an exception; a wrong URL or a bad request is a mistake to report at once.
The client therefore:

- checks each server at start-up (``check``: ``/health``, then the served model names) and fails in
  seconds with the URL in the message;
- sends each request to the URL with the fewest requests in flight, at most ``max_in_flight`` per URL;
- separates the connect timeout (is anybody there?) from the read timeout (seconds the server may stay
  silent while it works);
- retries only what a retry can fix: connection errors, timeouts and HTTP 502/503/504, with
  exponential backoff and jitter; a 4xx or 500 is raised at once. Callers put a seed in every payload,
  so a retried request returns what the first attempt would have;
- raises ``ServiceError`` naming the URL and the last failure when the attempts run out, and cancels
  the rest of the batch: a caller gets every answer or an exception, never part of a batch;
- sends ``Authorization: Bearer <api_key>`` with every request when it has a key (what ``vllm serve
  --api-key`` and ``reward_models.serve --api_key`` expect), and turns an HTTP 401 into a
  ``ServiceError`` saying whether no key or a wrong one was sent. The key is never part of a message.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import os
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Sequence

RETRY_STATUSES = (502, 503, 504)
MAX_RESPONSE_BYTES = 256 * 2**20  # a response larger than this is not one of ours
API_KEY_ENV = "MATHRL_SERVICE_API_KEY"
"""The environment variable holding the key of the services (as vLLM's VLLM_API_KEY): a key given there
stays out of the command line, the process list and the run's saved flags."""


def api_key_from(value: str | None) -> str | None:
    """``value`` (a --service_api_key or --api_key flag), else $MATHRL_SERVICE_API_KEY, else None (no key);
    an empty string counts as none."""
    return value or os.environ.get(API_KEY_ENV) or None


class ServiceError(RuntimeError):
    """A service could not answer: unreachable, failing after every retry, or refusing the request."""


class _Retryable(Exception):
    """One attempt failed in a way a later attempt may not (connection, timeout, 502/503/504)."""


@dataclass(frozen=True)
class ClientSettings:
    """How patient a client is, and the key it shows. ``retries``: attempts after the first; the k-th retry
    waits ``backoff * 2**(k-1)`` seconds (capped at ``max_backoff``) times a jitter in [0.5, 1). ``api_key``:
    sent as a bearer token (None: no Authorization header); left out of the repr."""

    connect_timeout: float = 5.0
    read_timeout: float = 120.0
    retries: int = 4
    backoff: float = 0.5
    max_backoff: float = 8.0
    max_in_flight: int = 8
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "max_backoff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.retries < 0 or self.backoff < 0:
            raise ValueError(f"retries={self.retries} and backoff={self.backoff} must be >= 0")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={self.max_in_flight} must be >= 1")


def parse_urls(urls: str | Sequence[str]) -> list[str]:
    """``"http://a:1,http://b:2"`` or a list -> base URLs without a trailing slash; a clear error for
    anything that is not ``http(s)://host:port[/path]``."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    parsed = []
    for url in (item.strip().rstrip("/") for item in items):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"service URL {url!r} is not http(s)://HOST:PORT (e.g. http://127.0.0.1:8000)")
        parsed.append(url)
    if not parsed:
        raise ValueError("no service URL given")
    return parsed


class ServiceClient:
    """JSON over HTTP to one or more replicas of a service (see the module docstring).

    Args:
        urls: base URLs of the replicas (``parse_urls``).
        settings: timeouts, retries and concurrency.
        seed: seeds the retry jitter (the payloads carry their own sampling seeds).
    """

    def __init__(self, urls: str | Sequence[str], settings: ClientSettings = ClientSettings(), seed: int = 0):
        self.urls, self.settings = parse_urls(urls), settings
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.lock = threading.Lock()
        self.slot_freed = threading.Condition(self.lock)
        self.jitter = random.Random(seed)
        self.retried = 0  # attempts that were retries, for logging and tests

    def check(self, model: str | None = None) -> dict[str, dict[str, str | None]]:
        """Each URL answers ``/health`` and, when ``model`` is given, serves it (``/v1/models``); returns
        {url: {served model id: the base model of a LoRA adapter, or None}}. Raises ``ServiceError``
        naming the URL within about the connect timeout (a server restarting that fast is waited for;
        one that is not running is reported)."""
        served = {}
        for url in self.urls:
            deadline = time.monotonic() + self.settings.connect_timeout
            self._until(deadline, url, "GET", "/health", None, raw=True)  # vLLM's answers 200 with no body
            listing = self._until(deadline, url, "GET", "/v1/models", None)
            entries = listing.get("data", []) if isinstance(listing, dict) else []
            served[url] = {entry.get("id"): entry.get("parent") for entry in entries if isinstance(entry, dict)}
            if model is not None and model not in served[url]:
                raise ServiceError(f"{url} serves {sorted(served[url])}, not {model!r}: point the URL at the server "
                                   f"of {model!r} or pass the name it serves")
        return served

    def served_model(self, model: str | None, flag: str) -> str:
        """``model`` after checking every URL serves it, or the one base model the servers serve (LoRA
        adapters aside); raises ``ServiceError`` when it is missing or the choice is ambiguous (``flag``
        says what to set)."""
        served = self.check(model)
        names = sorted({name for models in served.values() for name, parent in models.items() if parent is None})
        if model is not None:
            return model
        if len(names) != 1:
            raise ServiceError(f"{', '.join(self.urls)} serve {names}: name the model to use with {flag}")
        return names[0]

    def _until(self, deadline: float, url: str, method: str, path: str, payload: Any, raw: bool = False) -> Any:
        """One request retried on retryable failures until ``deadline`` (start-up checks)."""
        while True:
            try:
                return self._attempt(url, method, path, payload, raw)
            except _Retryable as error:
                if time.monotonic() + 0.5 > deadline:
                    raise ServiceError(f"{method} {url}{path}: {error} (is the server running and healthy at "
                                       f"{url}?)") from error
                time.sleep(0.5)

    def post(self, path: str, payload: dict[str, Any], raw: bool = False) -> Any:
        """POST one JSON payload to the least busy URL, with retries; returns the decoded JSON answer
        (``raw``: the answer's text, for the control routes that answer in plain text or not at all)."""
        return self.post_many(path, [payload], raw)[0]

    def post_many(self, path: str, payloads: Sequence[dict[str, Any]], raw: bool = False) -> list[Any]:
        """POST every payload (at most ``max_in_flight`` per URL at a time); answers in payload order.
        The first request that fails for good cancels those not yet sent and raises its error."""
        workers = min(len(payloads), self.settings.max_in_flight * len(self.urls))
        if workers <= 1:
            return [self._request(path, payload, raw) for payload in payloads]
        pool = ThreadPoolExecutor(workers)
        futures = [pool.submit(self._request, path, payload, raw) for payload in payloads]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        # On a failure, do not wait for requests still in flight (they may sit out a read timeout).
        pool.shutdown(wait=False, cancel_futures=True)
        for future in futures:
            if future in done and future.exception() is not None:
                raise future.exception()
        return [future.result() for future in futures]

    def _request(self, path: str, payload: dict[str, Any], raw: bool) -> Any:
        """One request with retries, on the URL with the fewest requests in flight."""
        failures = []
        for attempt in range(self.settings.retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(self._backoff(attempt))
            url = self._acquire()
            try:
                return self._attempt(url, "POST", path, payload, raw)
            except _Retryable as error:
                failures.append(f"{url}: {error}")
            finally:
                with self.slot_freed:
                    self.in_flight[url] -= 1
                    self.slot_freed.notify()
        raise ServiceError(f"POST {path} failed {len(failures)} times; last: {failures[-1]}")

    def _backoff(self, attempt: int) -> float:
        with self.lock:
            jitter = 0.5 + 0.5 * self.jitter.random()
        return min(self.settings.max_backoff, self.settings.backoff * 2 ** (attempt - 1)) * jitter

    def _acquire(self) -> str:
        """The URL with the fewest requests in flight (waits while every URL is at ``max_in_flight``)."""
        with self.slot_freed:
            self.slot_freed.wait_for(lambda: min(self.in_flight.values()) < self.settings.max_in_flight)
            url = min(self.urls, key=self.in_flight.__getitem__)
            self.in_flight[url] += 1
            return url

    def _attempt(self, url: str, method: str, path: str, payload: Any, raw: bool = False) -> Any:
        """One HTTP exchange. Raises ``_Retryable`` (connection, timeout, 502/503/504) or ``ServiceError``."""
        parts = urllib.parse.urlsplit(url)
        connection_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_type(parts.hostname, parts.port, timeout=self.settings.connect_timeout)
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key is not None:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        try:
            connection.connect()
            connection.sock.settimeout(self.settings.read_timeout)
            connection.request(method, parts.path + path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read(MAX_RESPONSE_BYTES + 1)
        except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out, cut short
            raise _Retryable(f"{type(error).__name__}: {error}") from error
        finally:
            connection.close()
        if response.status in RETRY_STATUSES:
            raise _Retryable(f"HTTP {response.status} {_excerpt(data)}")
        if response.status == 401:
            raise ServiceError(f"{method} {url}{path} answered HTTP 401: {_excerpt(data)}; {self._key_advice()}")
        if response.status != 200:
            raise ServiceError(f"{method} {url}{path} answered HTTP {response.status}: {_excerpt(data)}")
        if len(data) > MAX_RESPONSE_BYTES:
            raise ServiceError(f"{method} {url}{path} answered more than {MAX_RESPONSE_BYTES} bytes")
        if raw:
            return data.decode("utf-8", errors="replace")
        try:
            return json.loads(data)
        except ValueError as error:
            raise ServiceError(f"{method} {url}{path} answered with invalid JSON: {_excerpt(data)}") from error

    def _key_advice(self) -> str:
        """What to do about a 401, by whether a key was sent (never the key itself)."""
        if self.settings.api_key is None:
            return f"no API key was sent: give the server's key with --service_api_key or ${API_KEY_ENV}"
        return (f"the API key sent (--service_api_key or ${API_KEY_ENV}) is not the server's: give the key it was "
                "started with (--api_key, or vllm serve --api-key)")


def _excerpt(data: bytes, limit: int = 300) -> str:
    """The first ``limit`` characters of a response body, on one line."""
    text = data.decode("utf-8", errors="replace").replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."
