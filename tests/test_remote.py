"""Clients of remote services against real servers on 127.0.0.1: the PRM server (in this process and
as ``python -m reward_models.serve``), behind a fault-injecting proxy (503s, responses slower than
the read timeout, 4xx), a refused port, several replicas, and a server killed while train_math.py
trains with ``--prm_url`` (the run stops naming the URL, saved, and resumes against a new server)."""

from __future__ import annotations

import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from envs.datasets import Arith
from envs.prompts import split_steps
from envs.rewards import StepContext
from fault_proxy import FaultProxy
from reward_models.prm import ProcessRewardModel
from reward_models.remote import RemotePRM
from reward_models.serve import make_server
from test_faults import child_env, wait_for
from train import checkpoint_files
from models.remote import ClientSettings, ServiceClient, ServiceError

ROOT = Path(__file__).resolve().parents[1]
FAST = ClientSettings(connect_timeout=1.0, read_timeout=10.0, retries=3, backoff=0.01, max_backoff=0.05)


def contexts(count: int, seed: int) -> list[StepContext]:
    """Arith trajectories at every prefix length of their reference solutions in turn."""
    out = []
    for i, problem in enumerate(Arith().problems(count, seed=seed)):
        steps = split_steps(problem.solution)
        k = i % len(steps)
        out.append(StepContext(problem, tuple(steps[:k]), steps[k], done=k == len(steps) - 1))
    return out


@pytest.fixture(scope="module")
def prm_server(untrained_policy_dir):
    """(local PRM, server URL): the untrained tiny policy read as a shepherd PRM (no build needed; real
    forwards), served in this process."""
    local = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=0)
    served = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=0)
    server = make_server(served, name="tiny-prm", max_wait_ms=2.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield local, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def assert_same_rewards(remote: RemotePRM, local: ProcessRewardModel, batch: list[StepContext]) -> None:
    np.testing.assert_allclose(remote.score(batch).rewards, local.score(batch).rewards, atol=1e-5, rtol=0)


def test_remote_prm_pays_the_local_prm_rewards(prm_server):
    local, url = prm_server
    batch = contexts(20, seed=1)
    assert_same_rewards(RemotePRM(url, settings=FAST, request_size=6), local, batch)
    for aggregation in ("min", "product"):
        remote = RemotePRM(url, aggregation=aggregation, settings=FAST)
        local.aggregation = aggregation
        assert_same_rewards(remote, local, batch)
    local.aggregation = "step"


def test_503s_and_slow_answers_are_retried_and_the_answer_is_the_same(prm_server):
    local, url = prm_server
    batch = contexts(8, seed=2)
    remote = RemotePRM(url, settings=FAST, request_size=8)
    with FaultProxy(url, fail_first=3) as proxy:
        remote.client = ServiceClient(proxy.url, FAST)
        assert_same_rewards(remote, local, batch)
        assert remote.client.retried == 3 and proxy.seen == 4
    slow = ClientSettings(connect_timeout=1.0, read_timeout=0.5, retries=2, backoff=0.01)
    with FaultProxy(url, slow_first=2, delay=1.5) as proxy:
        remote.client = ServiceClient(proxy.url, slow)
        start = time.monotonic()
        assert_same_rewards(remote, local, batch)
        assert remote.client.retried == 2 and proxy.seen == 3 and time.monotonic() - start < 5


def test_4xx_is_raised_at_once_and_exhausted_retries_name_the_url(prm_server):
    _, url = prm_server
    batch = contexts(4, seed=3)
    remote = RemotePRM(url, settings=FAST)
    with FaultProxy(url, fail_first=100, fail_status=400) as proxy:
        remote.client = ServiceClient(proxy.url, FAST)
        with pytest.raises(ServiceError, match="HTTP 400"):
            remote.score(batch)
        assert proxy.seen == 1
    with FaultProxy(url, fail_first=100, fail_status=503) as proxy:
        remote.client = ServiceClient(proxy.url, FAST)
        start = time.monotonic()
        with pytest.raises(ServiceError) as raised:
            remote.score(batch)
        assert proxy.seen == FAST.retries + 1 and time.monotonic() - start < 5
    assert proxy.url in str(raised.value) and "HTTP 503" in str(raised.value)


def test_a_refused_port_or_a_wrong_model_fails_the_start_in_seconds(prm_server):
    _, url = prm_server
    closed = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ServiceError, match=re.escape(closed) + ".*is the server running"):
        RemotePRM(closed, settings=FAST)
    assert time.monotonic() - start < 5
    with pytest.raises(ServiceError, match=r"serves \['tiny-prm'\], not 'other-prm'"):
        RemotePRM(url, model="other-prm", settings=FAST)


def test_requests_spread_over_replicas(prm_server):
    local, url = prm_server
    with FaultProxy(url) as first, FaultProxy(url) as second:
        settings = ClientSettings(connect_timeout=1.0, read_timeout=10.0, max_in_flight=2)
        remote = RemotePRM(f"{first.url},{second.url}", settings=settings, request_size=2)
        batch = contexts(24, seed=4)
        checks = first.seen
        assert_same_rewards(remote, local, batch)
        assert first.seen - checks >= 3 and second.seen - checks >= 3  # 12 requests over 2 replicas


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_prm_server(model_dir: Path) -> tuple[subprocess.Popen, str]:
    """``python -m reward_models.serve`` on a free port; (process, URL) once it says it serves."""
    process = subprocess.Popen([sys.executable, "-m", "reward_models.serve", "--model", str(model_dir), "--port", "0",
                                "--device", "cpu", "--nocheck_labels"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, cwd=ROOT, env=child_env())
    ready, _, _ = select.select([process.stdout], [], [], 120)
    line = process.stdout.readline().decode() if ready else ""
    assert line.startswith("serving PRM"), f"the PRM server printed {line!r} (exit code {process.poll()})"
    return process, line.split()[-1]


def test_a_prm_server_killed_mid_run_stops_training_saved_and_a_new_one_resumes_it(untrained_policy_dir, tmp_path):
    command = [sys.executable, str(ROOT / "train_math.py"), "--model_name_or_path", str(untrained_policy_dir),
               "--logdir", str(tmp_path), "--algorithm_name", "GRPO", "--noasync_rollouts", "--action_level", "step",
               "--episode_length", "2", "--n_rollout_threads", "8", "--group_size", "4", "--max_new_tokens", "8",
               "--eval_interval", "0", "--save_interval", "0", "--num_env_steps", str(16 * 8),
               "--service_retries", "2", "--service_backoff", "0.05", "--service_connect_timeout", "1"]
    server, url = start_prm_server(untrained_policy_dir)
    try:
        process = subprocess.Popen([*command, "--prm_url", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=child_env(), cwd=ROOT)
        assert wait_for(lambda: served_requests(url) >= 6, process, 120), "training never reached the server"
        server.kill()
        server.wait()
        out, err = process.communicate(timeout=120)
    finally:
        server.kill()
    assert process.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("train_math.py: error: ") and url in last and "of problems [" in last, last
    resume = re.search(r"resume with: .*--resume=(\S+)$", last)
    saved = Path(resume[1])
    assert checkpoint_files.invalid_reason(saved) is None and 0 < int(saved.name.removeprefix("iter_")) < 8
    server, url = start_prm_server(untrained_policy_dir)
    try:
        finished = subprocess.run([*command, "--prm_url", url, f"--resume={saved}"], capture_output=True, text=True,
                                  env=child_env(), cwd=ROOT, timeout=300)
    finally:
        server.kill()
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert (saved.parent / "iter_8").is_dir()


def served_requests(url: str) -> int:
    """Requests the PRM server at ``url`` has answered (its /health)."""
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/health", timeout=5) as response:
        return json.loads(response.read())["requests"]
