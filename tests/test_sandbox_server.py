"""The sandbox server (``python -m envs.sandbox_server``, a real process on 127.0.0.1) under hostile
clients: it takes only requests carrying its key (401 otherwise, /health open) and will not listen
beyond loopback without one; it refuses a body without a plain Content-Length, non-JSON numbers and
timeouts that are not finite; 200 requests at once are all answered; a connection that stops sending
is dropped after the read timeout and cannot starve the others. After each, an innocent request is
answered within the call's limit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from envs.sandbox_server import MAX_CONNECTIONS
from envs.service_keys import API_KEY_ENV

ROOT = Path(__file__).resolve().parents[1]
KEY = "mathrl-sandbox-server-key-41c9"
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server():
    """The URL of a server with KEY (from the environment), 2 workers, a 5 s wall clock and a 1 s read timeout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), API_KEY_ENV: KEY}
    process = subprocess.Popen([sys.executable, "-m", "envs.sandbox_server", "--port", "0", "--workers", "2",
                                "--timeout_s", "5", "--read_timeout_s", str(READ_TIMEOUT_S)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = process.stdout.readline()
        assert first.startswith("sandbox serving run_code on http://127.0.0.1:"), first + process.stderr.read()
        yield first.split()[-1]
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0
        process.stdout.close()
        process.stderr.close()


def post(url: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    """(status, JSON answer) of ``POST url`` with ``body``, carrying KEY unless ``headers`` say otherwise."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def run_code(server: str, code: str, **fields) -> tuple[int, dict]:
    return post(f"{server}/run_code", json.dumps({"code": code, **fields}).encode())


def assert_answers(server: str, within_s: float = 10.0) -> None:
    """An innocent request gets its right answer within ``within_s`` seconds."""
    start = time.monotonic()
    status, answer = run_code(server, "print(6 * 7)")
    assert status == 200 and answer["run_result"]["stdout"] == "42\n", answer
    assert time.monotonic() - start < within_s


def raw_request(server: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Everything the server sends back on a connection given ``data`` (until it closes)."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as connection:
        connection.sendall(data)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    return received


def test_only_its_key_runs_code(server):
    marker = "print('ran')"
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer not-the-key"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        status, answer = post(f"{server}/run_code", json.dumps({"code": marker}).encode(), headers)
        assert status == 401 and "API key" in answer["error"] and KEY not in answer["error"], (headers, answer)
    with urllib.request.urlopen(f"{server}/health", timeout=10) as answer:  # a load balancer's probe: no key
        assert json.loads(answer.read())["status"] == "ok"
    refused = urllib.request.Request(f"{server}/anything", headers={"Authorization": "Bearer nope"})
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(refused, timeout=10)
    assert_answers(server)


def test_an_open_host_needs_a_key():
    env = {key: value for key, value in os.environ.items() if key != API_KEY_ENV}
    refused = subprocess.run([sys.executable, "-m", "envs.sandbox_server", "--host", "0.0.0.0", "--port", "0"],
                             cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--host=0.0.0.0 without a key" in refused.stderr


@pytest.mark.parametrize("length", ["-1", "+5", "5 ", "0x10", "1e3", "²", ""])
def test_a_length_that_is_not_plain_digits_is_refused(server, length):
    body = json.dumps({"code": "print('ran')"}).encode()
    header = f"Content-Length: {length}\r\n".encode() if length else b""
    answer = raw_request(server, b"POST /run_code HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                         b"\r\n" + header + b"\r\n" + body)
    assert answer.startswith(b"HTTP/1.0 411 ") and b"ran" not in answer, answer
    assert_answers(server)


def test_a_body_over_the_cap_is_refused_unread(server):
    answer = raw_request(server, b"POST /run_code HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                         b"\r\nContent-Length: 999999999999\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.0 413 ")
    assert_answers(server)


@pytest.mark.parametrize("timeout", ["NaN", "Infinity", "-Infinity", "1e999", "0", "-1", "true", '"5"'])
def test_timeouts_that_are_not_finite_seconds_are_refused(server, timeout):
    body = ('{"code": "print(1)", "run_timeout": %s}' % timeout).encode()
    status, answer = post(f"{server}/run_code", body)
    assert status == 400 and ("run_timeout" in answer["error"] or "is not JSON" in answer["error"]), answer
    assert_answers(server)


def test_two_hundred_requests_at_once_are_all_answered(server):
    with ThreadPoolExecutor(200) as pool:
        answers = list(pool.map(lambda i: run_code(server, f"print({i} * 2)"), range(200)))
    assert [(status, answer["run_result"]["stdout"]) for status, answer in answers] == \
        [(200, f"{i * 2}\n") for i in range(200)]


def test_half_sent_requests_are_dropped_and_starve_no_one(server):
    """More silent connections than the server serves at once, each having sent half a body: each is
    closed after the read timeout, and an innocent request is answered meanwhile within a few timeouts."""
    host, port = server.removeprefix("http://").split(":")
    stalled = []
    for _ in range(MAX_CONNECTIONS + 8):
        connection = socket.create_connection((host, int(port)), timeout=30)
        connection.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                           b"\r\nContent-Length: 100\r\n\r\n{\"code\": ")
        stalled.append(connection)
    try:
        assert_answers(server, within_s=3 * READ_TIMEOUT_S + 10)
        start = time.monotonic()
        for connection in stalled:
            assert connection.recv(65536) == b""  # closed by the server, nothing answered
        assert time.monotonic() - start < 3 * READ_TIMEOUT_S + 10
    finally:
        for connection in stalled:
            connection.close()
    assert_answers(server)


def test_a_call_that_closes_its_output_stalls_no_worker(server):
    """Stopped by its own wall clock, not held until the worker is declared dead; both workers serve on."""
    status, answer = run_code(server, "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", run_timeout=1.0)
    assert status == 200 and answer["run_result"]["status"] == "TimeLimitExceeded", answer
    assert answer["run_result"]["execution_time"] < 5
    for _ in range(4):
        assert_answers(server)
