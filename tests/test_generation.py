"""HFGenerator: behaviour log-probs equal the policy's, stop strings, finish reasons, order, seeds."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from envs.prompts import STEP_DELIMITER, format_prompt
from train.generation import HFGenerator, VLLMGenerator, filter_logits, make_generator
from train.policy import LanguagePolicy, LoraSettings

PROMPTS = [format_prompt("Compute 3 + 4."), format_prompt("Compute 12 - 5 + 40 - 7."), "Step"]
SOLUTION = f"Step 1: 3 + 4 = 7{STEP_DELIMITER}The answer is \\boxed{{7}}"
# Starts with "\n" after a prompt ending in "\n": only a stop string inside the generated text may count.
NEWLINE_FIRST = f"\nStep 1: 12 - 5 = 7{STEP_DELIMITER}Step 2: 7 + 40 = 47"
LESSONS = {PROMPTS[0]: SOLUTION, PROMPTS[1]: NEWLINE_FIRST}


def teach(policy: LanguagePolicy, lessons: dict[str, str], steps: int = 80) -> None:
    """Fits each completion (then eos) after its prompt with Adam, so greedy decoding reproduces it."""
    tokenizer = policy.tokenizer
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in lessons]
    completion_ids = [tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id] for completion in lessons.values()]
    optimizer = torch.optim.Adam(policy.actor_parameters(), lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        (-policy.evaluate(prompt_ids, completion_ids, with_entropy=False).logprobs.sum()).backward()
        optimizer.step()
    policy.eval()


def padded(rows: list[list[float]]) -> torch.Tensor:
    """``[B, L]`` right-padded with zeros, like ``ActionScores`` tensors."""
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(row) for row in rows], batch_first=True)


@pytest.fixture(scope="module")
def policy(untrained_policy_dir):
    return LanguagePolicy(untrained_policy_dir, device="cpu").eval()


@pytest.fixture(scope="module")
def taught_policy(untrained_policy_dir):
    policy = LanguagePolicy(untrained_policy_dir, device="cpu")
    teach(policy, LESSONS)
    return policy


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_policy_recomputation(policy, temperature, padding_side):
    out = HFGenerator(policy).generate(PROMPTS, n=2, max_new_tokens=12, temperature=temperature, seed=0)
    with torch.no_grad():
        scores = policy.evaluate(out.prompt_token_ids, out.token_ids, temperature, padding_side=padding_side)
    behaviour = padded(out.logprobs)
    assert behaviour.shape == scores.logprobs.shape
    assert (behaviour - scores.logprobs).abs().max() <= 1e-4


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.8), (20, 0.9)])
def test_filtered_sampling_logprobs_are_those_of_the_filtered_distribution(policy, top_k, top_p):
    temperature = 0.8
    out = HFGenerator(policy).generate(PROMPTS[:2], n=2, max_new_tokens=6, temperature=temperature,
                                       top_k=top_k, top_p=top_p, seed=1)
    for prompt, tokens, logprobs in zip(out.prompt_token_ids, out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = policy.causal_lm(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        filtered = filter_logits(logits / temperature, top_k, top_p).log_softmax(-1)
        expected = filtered.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert expected.isfinite().all(), "sampled a token outside the top-k/top-p set"
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_filter_logits_keeps_top_k_and_the_nucleus():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])  # probabilities ~ .03 .09 .24 .64
    assert filter_logits(logits, 2, 1.0).isfinite().tolist() == [[False, False, True, True]]
    assert filter_logits(logits, -1, 0.7).isfinite().tolist() == [[False, False, True, True]]
    assert filter_logits(logits, -1, 0.5).isfinite().tolist() == [[False, False, False, True]]


def test_stop_string_eos_and_length_finish_reasons(taught_policy):
    generator = HFGenerator(taught_policy)
    tokenizer = taught_policy.tokenizer
    stopped = generator.generate(PROMPTS[:1], max_new_tokens=40, temperature=0.0, stop=[STEP_DELIMITER])
    assert stopped.finish_reasons == ["stop"]
    assert stopped.texts == ["Step 1: 3 + 4 = 7" + STEP_DELIMITER]
    assert tokenizer.decode(stopped.token_ids[0]) == stopped.texts[0]  # stop tokens included
    ended = generator.generate(PROMPTS[:1], max_new_tokens=40, temperature=0.0)
    assert ended.finish_reasons == ["eos"]
    assert ended.texts == [SOLUTION] and ended.token_ids[0][-1] == tokenizer.eos_token_id
    assert len(ended.logprobs[0]) == len(ended.token_ids[0])
    newline_first = generator.generate(PROMPTS[1:2], max_new_tokens=40, temperature=0.0, stop=[STEP_DELIMITER])
    assert newline_first.texts == [NEWLINE_FIRST.split(STEP_DELIMITER)[0] + STEP_DELIMITER]
    cut = generator.generate(PROMPTS[:1], max_new_tokens=3, temperature=0.0, stop=[STEP_DELIMITER])
    assert cut.finish_reasons == ["length"] and len(cut.token_ids[0]) == 3


def test_samples_are_prompt_major_and_batching_does_not_change_greedy_outputs(taught_policy):
    generator = HFGenerator(taught_policy)
    n = 3
    together = generator.generate(PROMPTS, n=n, max_new_tokens=10, temperature=0.0, stop=[STEP_DELIMITER])
    prompt_ids = [taught_policy.tokenizer(p)["input_ids"] for p in PROMPTS]
    assert together.prompt_token_ids == [ids for ids in prompt_ids for _ in range(n)]
    for i, prompt in enumerate(PROMPTS):
        alone = generator.generate([prompt], n=1, max_new_tokens=10, temperature=0.0, stop=[STEP_DELIMITER])
        assert together.token_ids[i * n: (i + 1) * n] == alone.token_ids * n
    chunked = HFGenerator(taught_policy, batch_size=2).generate(PROMPTS, n=n, max_new_tokens=10, temperature=0.0,
                                                               stop=[STEP_DELIMITER])
    assert chunked.token_ids == together.token_ids and chunked.finish_reasons == together.finish_reasons


def test_seeds_reproduce_samples_without_touching_the_global_rng(policy):
    generator = HFGenerator(policy)
    global_state = torch.get_rng_state()
    first, again, other = (generator.generate(PROMPTS, n=2, max_new_tokens=8, seed=seed).token_ids
                           for seed in (7, 7, 8))
    assert first == again and first != other
    assert torch.equal(torch.get_rng_state(), global_state)


def test_generation_leaves_training_mode_and_generation_config_alone(untrained_policy_dir):
    policy = LanguagePolicy(untrained_policy_dir, device="cpu").train()
    saved_config = policy.causal_lm.generation_config
    generator = make_generator("hf", policy)
    assert isinstance(generator, HFGenerator) and generator.sync(policy) == 0.0
    generator.generate(PROMPTS[:1], max_new_tokens=2)
    assert policy.training and policy.causal_lm.generation_config is saved_config


@pytest.mark.parametrize("precision", [dict(dtype="bfloat16"), dict(dtype="bfloat16", low_precision_weights=True),
                                       dict(dtype="bfloat16", lora=LoraSettings(rank=4))],
                         ids=["autocast", "bf16-weights", "lora-bf16-base"])
def test_bfloat16_policies_generate_score_and_train(untrained_policy_dir, policy, precision):
    low = LanguagePolicy(untrained_policy_dir, device="cpu", **precision)
    out = HFGenerator(low).generate(PROMPTS, n=2, max_new_tokens=8, seed=0)
    with torch.no_grad():
        scores = low.evaluate(out.prompt_token_ids, out.token_ids).logprobs
        full_precision = policy.evaluate(out.prompt_token_ids, out.token_ids).logprobs
    assert (padded(out.logprobs) - scores).abs().max() < 2e-2
    assert (scores - full_precision).abs().max() < 5e-2
    low.evaluate(out.prompt_token_ids, out.token_ids).logprobs.sum().backward()
    grads = [p.grad for p in low.actor_parameters()]
    assert all(g is not None and g.isfinite().all() for g in grads)
    stored = torch.bfloat16 if "low_precision_weights" in precision else torch.float32
    assert low.actor_parameters()[0].dtype == stored


def test_bad_arguments_fail_clearly(policy):
    with pytest.raises(ValueError, match="not one of 'hf', 'vllm'"):
        make_generator("sglang", policy)
    with pytest.raises(ValueError, match="top_p"):
        HFGenerator(policy).generate(PROMPTS, top_p=0.0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vllm is installed here, so the missing-vllm message cannot be shown")
def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # undone after the test
    with pytest.raises(ImportError, match=r"mathrl\[vllm\]"):
        VLLMGenerator("unused")
