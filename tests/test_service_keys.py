"""Keys of the services: the PRM server refuses requests without its key (401 saying whether the key was
missing or wrong, a line on its stderr) and will not listen beyond loopback without one; the client sends
``--service_api_key`` or $MATHRL_SERVICE_API_KEY as a bearer token and reports a 401 in one line; the key
never reaches the run's output, TensorBoard or checkpoints, and a resume takes it from the variable again."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from models.remote import API_KEY_ENV, ClientSettings, ServiceClient, ServiceError
from reward_models.prm import ProcessRewardModel
from reward_models.serve import make_server
from test_faults import child_env
from test_remote import contexts

ROOT = Path(__file__).resolve().parents[1]
KEY = "mathrl-test-key-5f0c"
FAST = ClientSettings(connect_timeout=2.0, read_timeout=30.0, retries=1, backoff=0.01, max_backoff=0.05)


@pytest.fixture(scope="module")
def keyed_server(untrained_policy_dir):
    """The URL of a PRM server in this process (the untrained tiny policy as a shepherd PRM) that needs KEY."""
    prm = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=0)
    server = make_server(prm, name="tiny-prm", api_key=KEY)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.url
    server.shutdown()
    server.server_close()


def client(url: str, api_key: str | None) -> ServiceClient:
    return ServiceClient(url, ClientSettings(**{**FAST.__dict__, "api_key": api_key}))


def test_the_right_key_is_served_and_a_missing_or_wrong_one_is_refused_on_both_sides(keyed_server, capfd):
    from reward_models.remote import RemotePRM

    batch = contexts(3, seed=1)
    served = RemotePRM(keyed_server, settings=ClientSettings(**{**FAST.__dict__, "api_key": KEY})).score(batch)
    assert served.rewards.shape == (3,)
    with pytest.raises(ServiceError, match=r"/v1/models answered HTTP 401: .*no API key was sent: give the server's "
                                           rf"key with --service_api_key or \${API_KEY_ENV}") as missing:
        client(keyed_server, None).served_model(None, "--prm_model_name")
    with pytest.raises(ServiceError, match=r"/v1/score answered HTTP 401: .*carried a wrong API key.* the API key sent "
                                           r"\(--service_api_key or \$MATHRL_SERVICE_API_KEY\) is not the "
                                           "server's") as wrong:
        client(keyed_server, "not-the-key").post("/v1/score", {"problems": ["1+1"], "steps": [["2"]]})
    log = capfd.readouterr().err
    assert "refused GET /v1/models from 127.0.0.1: no API key" in log
    assert "refused POST /v1/score from 127.0.0.1: a wrong API key" in log
    assert KEY not in log + str(missing.value) + str(wrong.value) and "not-the-key" not in log + str(wrong.value)
    assert "api_key" not in repr(ClientSettings(api_key=KEY)) and KEY not in repr(ClientSettings(api_key=KEY))


def test_health_needs_no_key_and_a_refusal_closes_the_connection_after_the_body(keyed_server):
    with urllib.request.urlopen(keyed_server + "/health", timeout=5) as response:
        assert json.loads(response.read())["status"] == "ok"
    request = urllib.request.Request(keyed_server + "/v1/score", data=b"x" * 100_000, method="POST",
                                     headers={"Authorization": "Bearer nope"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
    assert refused.value.headers["Connection"] == "close"


def test_a_server_without_a_key_listens_on_loopback_only(untrained_policy_dir):
    prm = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=0)
    with pytest.raises(ValueError, match=r"--host=0.0.0.0 without a key .* give --api_key"):
        make_server(prm, host="0.0.0.0")
    server = make_server(prm, host="0.0.0.0", api_key=KEY)
    server.server_close()
    env = {key: value for key, value in child_env().items() if key != API_KEY_ENV}
    result = subprocess.run([sys.executable, "-m", "reward_models.serve", "--model", "unused", "--port", "0",
                             "--host", "0.0.0.0"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert result.returncode == 2 and "--host=0.0.0.0 without a key" in result.stderr, result.stderr


def start_keyed_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``python -m reward_models.serve`` taking KEY from $MATHRL_SERVICE_API_KEY; (process, URL)."""
    import select

    process = subprocess.Popen([sys.executable, "-m", "reward_models.serve", "--model", str(model_dir), "--port", "0",
                                "--device", "cpu", "--nocheck_labels"], stdout=subprocess.PIPE, stderr=log.open("w"),
                               cwd=ROOT, env={**child_env(), API_KEY_ENV: KEY})
    ready, _, _ = select.select([process.stdout], [], [], 120)
    line = process.stdout.readline().decode() if ready else ""
    assert line.startswith("serving PRM"), f"the PRM server printed {line!r} (exit code {process.poll()})"
    return process, line.split()[-1]


def test_train_math_sends_the_key_and_never_logs_or_saves_it(untrained_policy_dir, tmp_path):
    logdir = tmp_path / "runs"
    command = [sys.executable, str(ROOT / "train_math.py"), "--model_name_or_path", str(untrained_policy_dir),
               "--logdir", str(logdir), "--experiment_name", "keyed", "--algorithm_name", "GRPO",
               "--noasync_rollouts", "--action_level", "step", "--episode_length", "2", "--n_rollout_threads", "4",
               "--group_size", "2", "--max_new_tokens", "4", "--eval_interval", "0", "--save_interval", "1",
               "--service_retries", "0", "--service_connect_timeout", "2"]
    without = {key: value for key, value in child_env().items() if key != API_KEY_ENV}
    server, url = start_keyed_server(untrained_policy_dir, tmp_path / "server.log")
    try:
        def train(*extra: str, env: dict = without) -> subprocess.CompletedProcess:
            return subprocess.run([*command, "--prm_url", url, *extra], capture_output=True, text=True, env=env,
                                  cwd=ROOT, timeout=600)

        missing, wrong = train("--num_env_steps", "8"), train("--num_env_steps", "8", "--service_api_key", "wrong")
        first = train("--num_env_steps", "8", "--service_api_key", KEY)
        resumed = train("--num_env_steps", "16", "--resume", "auto", env={**without, API_KEY_ENV: KEY})
    finally:
        server.kill()
        server.wait()
    assert missing.returncode == 1 and "no API key was sent" in missing.stderr.splitlines()[-1], missing.stderr[-2000:]
    assert wrong.returncode == 1 and "is not the server's" in wrong.stderr.splitlines()[-1], wrong.stderr[-2000:]
    assert first.returncode == 0 and resumed.returncode == 0, (first.stderr + resumed.stderr)[-3000:]
    # the --service_api_key run
    saved = json.loads(next(logdir.glob("keyed/*/checkpoints/iter_1/flags.json")).read_text())
    assert saved["service_api_key"] == "<hidden>" and "resuming from" in resumed.stderr
    server_log = (tmp_path / "server.log").read_text()
    assert "refused GET /v1/models from 127.0.0.1: no API key" in server_log
    assert "refused GET /v1/models from 127.0.0.1: a wrong API key" in server_log
    outputs = [missing.stdout, missing.stderr, wrong.stderr, first.stdout, first.stderr, resumed.stderr, server_log]
    assert not [text for text in outputs if KEY in text]
    files = [path for path in logdir.rglob("*") if path.is_file()]
    assert any(path.name.startswith("events.out.tfevents") for path in files)
    assert not [path for path in files if KEY.encode() in path.read_bytes()]
