"""The PRM server (reward_models.serve): the CLI in a subprocess serving the trained tiny PRM, and
in-process servers (make_server) for batching, bad input, model errors and a full queue."""

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from envs.datasets import Arith
from envs.prompts import split_steps
from reward_models.prm import ProcessRewardModel
from reward_models.serve import make_server

ROOT = Path(__file__).resolve().parents[1]


def call(url: str, path: str, payload=None, data: bytes | None = None, timeout: float = 60):
    """(status, JSON answer, headers) of GET ``path`` or, with a payload or raw data, POST it."""
    if payload is not None:
        data = json.dumps(payload).encode()
    request = urllib.request.Request(url + path, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def trajectories(count: int, seed: int):
    """(problems, steps, finished) of ``count`` Arith problems at every prefix length of their
    reference solutions in turn (1 step, 2 steps, ...), finished where the prefix is the whole."""
    problems, steps, finished = [], [], []
    for i, problem in enumerate(Arith().problems(count, seed=seed)):
        solution = split_steps(problem.solution)
        k = 1 + i % len(solution)
        problems.append(problem.problem)
        steps.append(solution[:k])
        finished.append(k == len(solution))
    return problems, steps, finished


def assert_scores(remote, local):
    assert [len(r) for r in remote] == [len(s) for s in local]
    for have, want in zip(remote, local):
        np.testing.assert_allclose(have, want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def served(untrained_policy_dir):
    """(process, url, PRM dir) of ``python -m reward_models.serve`` on port 0, serving the untrained tiny
    policy read as a shepherd PRM (``--nocheck_labels``: no build needed, real forwards; the trained
    PRM differs only in its weights). Stopped with SIGTERM at the end, which must exit 0."""
    prm_dir = untrained_policy_dir
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(os.devnull, "wb") as devnull:
        process = subprocess.Popen([sys.executable, "-m", "reward_models.serve", "--model", str(prm_dir), "--port",
                                    "0", "--device", "cpu", "--nocheck_labels", "--served_model_name", "prm"],
                                   stdout=subprocess.PIPE, stderr=devnull, cwd=ROOT, env=env)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 120)
        line = process.stdout.readline().decode() if ready else ""
        assert line.startswith("serving PRM prm on http://127.0.0.1:"), f"server printed {line!r} (rc {process.poll()})"
        yield process, line.split()[-1], prm_dir
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_remote_step_scores_equal_local_ones(served):
    _, url, prm_dir = served
    local = ProcessRewardModel(prm_dir, device="cpu", kv_cache_mb=0, check_labels=False)
    problems, steps, finished = trajectories(12, seed=5)
    assert len({len(s) for s in steps}) >= 3 and any(finished) and not all(finished)
    status, answer, _ = call(url, "/v1/score", {"model": "prm", "problems": problems, "steps": steps,
                                                "finished": finished})
    assert status == 200 and answer["model"] == "prm"
    assert_scores(answer["step_scores"], local.step_scores(problems, steps))
    # the same trajectories one step further, without "finished": the server's KV cache continues them
    longer = [s + ["The answer is \\boxed{1}."] for s in steps]
    status, answer, _ = call(url, "/v1/score", {"problems": problems, "steps": longer})
    assert status == 200
    assert_scores(answer["step_scores"], local.step_scores(problems, longer))
    status, health, _ = call(url, "/health")
    assert status == 200 and health == {"status": "ok", "requests": 2, "batches": 2, "solutions": 24}


def test_cli_serves_its_name_and_refuses_another(served):
    _, url, _ = served
    assert call(url, "/v1/models")[:2] == (200, {"object": "list", "data": [{"id": "prm", "object": "model"}]})
    status, answer, _ = call(url, "/v1/score", {"model": "Qwen/other", "problems": ["x"], "steps": [["y"]]})
    assert status == 404 and "'Qwen/other'" in answer["error"] and "'prm'" in answer["error"]


@pytest.fixture(scope="module")
def untrained_prm(untrained_policy_dir):
    """The untrained tiny policy read as a shepherd PRM: always at hand (no build), real forwards."""
    return ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False)


def serving(prm, **options):
    """An in-process server of ``prm`` (named "tiny"), serving on a thread."""
    server = make_server(prm, "127.0.0.1", 0, "tiny", **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server):
    server.shutdown()
    server.server_close()


def concurrently(function, arguments):
    """``function(*a)`` for each ``a`` of ``arguments`` on its own thread, started together."""
    results = [None] * len(arguments)
    barrier = threading.Barrier(len(arguments))

    def run(i):
        barrier.wait()
        results[i] = function(*arguments[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(arguments))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_concurrent_clients_each_get_their_own_scores_from_shared_batches(untrained_policy_dir, untrained_prm):
    problems, steps, finished = trajectories(32, seed=7)
    want = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=0).step_scores(
        problems, steps)
    # 16 clients x 2 solutions = max_batch: a batch closes as soon as all have arrived (or after 10 s)
    server = serving(untrained_prm, max_batch=32, max_wait_ms=10_000)
    try:
        requests = [{"problems": problems[i : i + 2], "steps": steps[i : i + 2], "finished": finished[i : i + 2]}
                    for i in range(0, 32, 2)]
        answers = concurrently(lambda payload: call(server.url, "/v1/score", payload), [(r,) for r in requests])
        for i, (status, answer, _) in enumerate(answers):
            assert status == 200
            assert_scores(answer["step_scores"], want[2 * i : 2 * i + 2])
        health = call(server.url, "/health")[1]
        assert health["requests"] == 16 and health["solutions"] == 32
        assert 1 <= health["batches"] < health["requests"]
    finally:
        stop(server)


BAD_INPUTS = [  # (body, status, words the error names)
    (b"{not json", 400, ["not JSON"]),
    ([1, 2], 400, ["JSON object"]),
    ({"problems": ["q"], "steps": [["s"]], "step": 1}, 400, ["'step'", "problems", "steps"]),
    ({"problems": "q", "steps": [["s"]]}, 400, ['"problems"', "'q'"]),
    ({"problems": ["q", 3], "steps": [["s"], ["t"]]}, 400, ['"problems"', "strings"]),
    ({"problems": [], "steps": []}, 400, ['"problems"', "holds 0", "1 to 4"]),
    ({"problems": ["q"] * 5, "steps": [["s"]] * 5}, 400, ['"problems"', "holds 5", "1 to 4"]),
    ({"problems": ["q", "r"], "steps": [["s"]]}, 400, ['"steps"', "B=2"]),
    ({"problems": ["q", "r"], "steps": [["s"], []]}, 400, ['"steps"[1]', "non-empty"]),
    ({"problems": ["q"], "steps": [["s", 7]]}, 400, ['"steps"[0]', "7"]),
    ({"problems": ["q"], "steps": [["s"]], "finished": [1]}, 400, ['"finished"', "booleans"]),
    ({"problems": ["q"], "steps": [["s"]], "finished": [True, False]}, 400, ['"finished"', "B=1"]),
    ({"model": "other", "problems": ["q"], "steps": [["s"]]}, 404, ["'other'", "'tiny'"]),
]


def test_bad_inputs_get_a_clear_error_and_the_server_keeps_serving(untrained_prm):
    server = serving(untrained_prm, max_request_items=4, max_queue=8)
    try:
        for body, status, words in BAD_INPUTS:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            have_status, answer, _ = call(server.url, "/v1/score", data=raw)
            assert have_status == status, (body, answer)
            assert all(word in answer["error"] for word in words), (answer["error"], words)
        for method_data, path in [(None, "/v1/nothing"), (b"{}", "/health")]:
            status, answer, _ = call(server.url, path, data=method_data)
            assert status == 404 and path in answer["error"] and "POST /v1/score" in answer["error"]
        status, answer, _ = call(server.url, "/v1/score", {"model": "tiny", "problems": ["Compute 12 + 35."],
                                                           "steps": [["12 + 35 = 47"]]})
        assert status == 200 and len(answer["step_scores"][0]) == 1
        assert call(server.url, "/v1/models")[1]["data"] == [{"id": "tiny", "object": "model"}]
        assert call(server.url, "/health")[1] == {"status": "ok", "requests": 1, "batches": 1, "solutions": 1}
    finally:
        stop(server)


class FakePRM:
    """Scores step i of a solution as len(problem) + i / 10; raises on a problem "boom"; with a
    ``gate``, each call waits for it (``entered`` set meanwhile)."""

    def __init__(self, gate: threading.Event | None = None):
        self.gate, self.entered, self.calls = gate, threading.Event(), []

    def step_scores(self, problems, steps, finished=None):
        self.calls.append(len(problems))
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        if "boom" in problems:
            raise ValueError("cannot score 'boom'")
        return [np.array([len(p) + i / 10 for i in range(len(s))]) for p, s in zip(problems, steps)]


def test_a_model_error_fails_its_whole_batch_and_only_it():
    fake = FakePRM()
    server = serving(fake, max_batch=2, max_wait_ms=10_000)
    try:
        failing = [({"problems": ["boom"], "steps": [["s"]]},), ({"problems": ["ok"], "steps": [["s"]]},)]
        for status, answer, _ in concurrently(lambda payload: call(server.url, "/v1/score", payload), failing):
            assert status == 500 and "ValueError: cannot score 'boom'" in answer["error"]
        status, answer, _ = call(server.url, "/v1/score", {"problems": ["abc", "de"], "steps": [["s", "t"], ["u"]],
                                                           "finished": [True, False]})
        assert status == 200 and answer["step_scores"] == [[3.0, 3.1], [2.0]]
        assert fake.calls == [2, 2]
    finally:
        stop(server)


def test_a_full_queue_answers_503_with_retry_after():
    gate = threading.Event()
    fake = FakePRM(gate)
    server = serving(fake, max_batch=1, max_wait_ms=0, max_queue=2, max_request_items=2)

    def post(problems):
        return call(server.url, "/v1/score", {"problems": problems, "steps": [["s"]] * len(problems)})

    try:
        first = threading.Thread(target=post, args=(["a"],))
        first.start()
        assert fake.entered.wait(10)  # the worker holds the first request: the queue is empty again
        second = threading.Thread(target=post, args=(["b", "c"],))
        second.start()
        deadline = time.monotonic() + 10
        while server.batcher.num_waiting < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, answer, headers = post(["d"])
        assert status == 503 and headers["Retry-After"] == "1"
        assert "max_queue=2" in answer["error"] and "retry" in answer["error"]
        gate.set()
        first.join(10), second.join(10)
        assert post(["e"])[:2] == (200, {"model": "tiny", "step_scores": [[1.0]]})
        assert fake.calls == [1, 2, 1]  # the 2-solution request over max_batch=1 was scored whole
    finally:
        gate.set()
        stop(server)


def test_make_server_and_the_cli_refuse_limits_that_cannot_work():
    with pytest.raises(ValueError, match="max_batch=0 must be >= 1"):
        make_server(FakePRM(), max_batch=0)
    with pytest.raises(ValueError, match="max_queue=8 must be >= max_request_items=16"):
        make_server(FakePRM(), max_queue=8, max_request_items=16)
    result = subprocess.run([sys.executable, "-m", "reward_models.serve", "--model", "unused", "--port", "0",
                             "--max_queue", "8", "--max_request_items", "16"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "max_queue=8 must be >= max_request_items=16" in result.stderr
