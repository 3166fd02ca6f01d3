"""HFGenerator: rollout log-probs equal the policy's, greedy tokens equal transformers' generate, stop
strings, finish reasons, order, seeds, shared prompts, length-bucketed batches, the inverse-CDF sampler."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from envs.datasets import MATH500, load_problems
from envs.prompts import STEP_DELIMITER, format_prompt
from models.batching import compacts, length_batches
from models.generation import HFGenerator, VLLMGenerator, make_generator
from models.hf_generation import eos_token_ids, inverse_cdf_sample, preallocated_cache
from models.sampling import filter_logits
from models.policy import LanguagePolicy, LoraSettings

PROMPTS = [format_prompt("Compute 3 + 4."), format_prompt("Compute 12 - 5 + 40 - 7."), "Step"]
SOLUTION = f"Step 1: 3 + 4 = 7{STEP_DELIMITER}The answer is \\boxed{{7}}"
# Starts with "\n" after a prompt ending in "\n": only a stop string inside the generated text may count.
NEWLINE_FIRST = f"\nStep 1: 12 - 5 = 7{STEP_DELIMITER}Step 2: 7 + 40 = 47"
LESSONS = {PROMPTS[0]: SOLUTION, PROMPTS[1]: NEWLINE_FIRST}
# 187 tokens each against PROMPTS' 3-17: a spread worth decoding in two batches.
LONG_PROMPTS = [format_prompt("Compute " + " + ".join(str(i) for i in range(start, start + 60)) + ".")
                for start in (10, 40)]


def teach(policy: LanguagePolicy, lessons: dict[str, str], steps: int = 80, lr: float = 1e-3,
          adapter: str | None = None) -> None:
    """Fits each completion (then eos) after its prompt with Adam, so greedy decoding reproduces it; with
    ``adapter`` (a role adapter) only that adapter is trained."""
    tokenizer = policy.tokenizer
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in lessons]
    completion_ids = [tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id] for completion in lessons.values()]
    adapters = None if adapter is None else [adapter] * len(prompt_ids)
    optimizer = torch.optim.Adam(policy.actor_parameters(), lr=lr)  # only the adapter used gets gradients
    for _ in range(steps):
        optimizer.zero_grad()
        scores = policy.score_actions(prompt_ids, completion_ids, with_entropy=False, adapters=adapters)
        (-scores.log_probs.sum()).backward()
        optimizer.step()
    policy.eval()


def role_adapter_policy(model_dir: Path, roles: tuple[str, ...] = ("solver", "verifier")) -> LanguagePolicy:
    """A policy with one LoRA adapter per role, each given random weights of its own (peft starts B at 0,
    where every adapter would speak as the base)."""
    torch.manual_seed(0)
    policy = LanguagePolicy(model_dir, device="cpu", lora=LoraSettings(rank=4, alpha=8.0), role_adapters=roles)
    for name, param in policy.named_parameters():
        if ".lora_B." in name and param.requires_grad:
            torch.nn.init.normal_(param, std=0.3)
    return policy.eval()


def generate_with(policy: LanguagePolicy, generator, adapter: str | None, prompts: list[str], **sampling):
    """``generator``'s samples of ``prompts`` with ``adapter`` made active around the call (None: the default actor)."""
    with policy.using_adapter(adapter) if adapter is not None else contextlib.nullcontext():
        return generator.generate(prompts, **sampling)


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
def test_rollout_log_probs_equal_policy_recomputation(policy, temperature, padding_side):
    out = HFGenerator(policy).generate(PROMPTS, n=2, max_new_tokens=12, temperature=temperature, seed=0)
    with torch.no_grad():
        scores = policy.score_actions(out.prompt_token_ids, out.token_ids, temperature, padding_side=padding_side)
    behaviour = padded(out.rollout_log_probs)
    assert behaviour.shape == scores.log_probs.shape
    assert (behaviour - scores.log_probs).abs().max() <= 1e-5


def test_logprobs_stay_exact_as_rows_leave_the_batch(taught_policy):
    """Rows end at different steps (stop string, EOS, length) and leave the batch; the rows still going
    keep log-probs equal to a teacher-forced forward at the sampling temperature."""
    temperature = 0.8
    out = HFGenerator(taught_policy).generate(PROMPTS, n=4, max_new_tokens=24, temperature=temperature,
                                              stop=[STEP_DELIMITER], seed=3)
    assert len({len(ids) for ids in out.token_ids}) > 2, "rows should end at different steps"
    with torch.no_grad():
        scores = taught_policy.score_actions(out.prompt_token_ids, out.token_ids, temperature)
    assert (padded(out.rollout_log_probs) - scores.log_probs).abs().max() <= 1e-5
    for ids, text, reason in zip(out.token_ids, out.texts, out.finish_reasons):
        assert (reason == "stop") == text.endswith(STEP_DELIMITER)
        assert (reason == "eos") == (ids[-1] == taught_policy.tokenizer.eos_token_id)
        assert (reason == "length") == (len(ids) == 24 and not text.endswith(STEP_DELIMITER))


@pytest.mark.parametrize("policy_name", ["policy", "taught_policy"])
def test_greedy_tokens_equal_transformers_generate(policy_name, request):
    """Token for token against ``model.generate`` on left-padded prompts of different lengths (the taught
    policy ends some rows on EOS early; transformers pads those rows after it)."""
    policy = request.getfixturevalue(policy_name)
    out = HFGenerator(policy).generate(PROMPTS, n=2, max_new_tokens=20, temperature=0.0)
    tokenizer, model = policy.tokenizer, policy.causal_lm
    eos_ids = eos_token_ids(tokenizer, model)
    batch = tokenizer.pad(tokenizer(PROMPTS), padding_side="left", return_tensors="pt")
    config = GenerationConfig(do_sample=False, max_new_tokens=20, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_ids)
    with torch.no_grad():
        reference = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   generation_config=config)[:, batch["input_ids"].shape[1]:].tolist()
    assert out.token_ids == [reference[i // 2][:len(ids)] for i, ids in enumerate(out.token_ids)]
    assert all(len(ids) == 20 or ids[-1] in eos_ids for ids in out.token_ids)


def test_the_lm_head_reads_contiguous_hidden_states(policy):
    """A strided [rows, 1, H] input (the last position sliced off the prompts' states) makes a CPU linear
    expand the [V, H] head per row: GBs and seconds at a real vocabulary."""
    inputs = []
    hook = policy.causal_lm.get_output_embeddings().register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    try:
        HFGenerator(policy).generate(PROMPTS, n=2, max_new_tokens=4, temperature=1.0, seed=0)
    finally:
        hook.remove()
    assert len(inputs) == 4 and all(hidden.is_contiguous() for hidden in inputs), [h.stride() for h in inputs]


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.8), (20, 0.9)])
def test_filtered_sampling_logprobs_are_those_of_the_filtered_distribution(policy, top_k, top_p):
    temperature = 0.8
    out = HFGenerator(policy).generate(PROMPTS[:2], n=2, max_new_tokens=6, temperature=temperature,
                                       top_k=top_k, top_p=top_p, seed=1)
    for prompt, tokens, log_probs in zip(out.prompt_token_ids, out.token_ids, out.rollout_log_probs):
        with torch.no_grad():
            logits = policy.causal_lm(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        filtered = filter_logits(logits / temperature, top_k, top_p).log_softmax(-1)
        expected = filtered.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert expected.isfinite().all(), "sampled a token outside the top-k/top-p set"
        torch.testing.assert_close(torch.tensor(log_probs), expected, atol=1e-4, rtol=0)


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
    assert len(ended.rollout_log_probs[0]) == len(ended.token_ids[0])
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
    for capped in (HFGenerator(taught_policy, batch_size=2), HFGenerator(taught_policy, max_batch_tokens=60)):
        chunked = capped.generate(PROMPTS, n=n, max_new_tokens=10, temperature=0.0, stop=[STEP_DELIMITER])
        assert chunked.token_ids == together.token_ids and chunked.finish_reasons == together.finish_reasons
        assert chunked.prompt_token_ids == together.prompt_token_ids


def test_length_batches_keep_order_when_they_fit_and_group_similar_lengths_otherwise():
    assert length_batches([5, 30, 7], max_new_tokens=10, max_rows=None, max_tokens=120) == [[0, 1, 2]]
    lengths = [50, 400, 60, 390, 55, 45, 700]
    for by_cost in (False, True):
        batches = length_batches(lengths, max_new_tokens=64, max_rows=None, max_tokens=1500, by_cost=by_cost)
        assert batches == [[5, 0, 4, 2], [3, 1], [6]]  # 4 x (60 + 64) <= 1500; 5 x (390 + 64) is not
        assert length_batches(lengths, 64, max_rows=3, max_tokens=None, by_cost=by_cost) == [[5, 0, 4], [2, 3, 1], [6]]
    assert length_batches(lengths, 64, max_rows=None, max_tokens=None, by_cost=False) == [list(range(7))]


def test_length_batches_split_by_cost_only_where_padding_costs_more_than_a_batch():
    arith = [16, 15, 17, 16, 19, 13] * 20
    assert length_batches(arith, 48, None, None) == [list(range(120))]  # in the given order
    math_like = [100] * 60 + [600] * 4  # the long four would pad 60 rows to 600 positions
    assert length_batches(math_like, 48, None, None) == [list(range(60)), [60, 61, 62, 63]]
    assert length_batches([600, 100, 100, 100, 100, 600], 48, None, None) == [[1, 2, 3, 4], [0, 5]]
    assert length_batches([600, 100, 100, 600], 48, None, None) == [[0, 1, 2, 3]]  # 2 short rows: not worth it
    assert length_batches([100, 130], 48, None, None) == [[0, 1]]  # too little padding to pay a batch


def test_ended_rows_leave_the_batch_once_a_quarter_have_ended():
    running = torch.ones(8, dtype=torch.bool)
    assert not compacts(running)
    running[3] = False
    assert not compacts(running)
    running[5] = False
    assert compacts(running)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_length_buckets_change_no_sample(policy, temperature):
    """Short and long prompts decoded in two batches give the greedy tokens, and the seeded samples, of one
    padded batch and of one row at a time; log-probs agree to float rounding."""
    prompts = PROMPTS + LONG_PROMPTS
    lengths = [len(ids) for ids in policy.tokenizer(prompts)["input_ids"] for _ in range(2)]
    assert lengths[::2] == [11, 17, 3, 187, 187]
    assert length_batches(lengths, 8, None, 1 << 17) == [[4, 5, 0, 1, 2, 3], [6, 7, 8, 9]]
    outs = [generator.generate(prompts, n=2, max_new_tokens=8, temperature=temperature, seed=[3, 1, 4, 1, 5])
            for generator in (HFGenerator(policy), HFGenerator(policy, length_buckets=False),
                              HFGenerator(policy, batch_size=1))]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    for other in outs[1:]:
        assert (padded(outs[0].rollout_log_probs) - padded(other.rollout_log_probs)).abs().max() <= 1e-5


@pytest.mark.slow
def test_math500_greedy_tokens_do_not_depend_on_length_buckets(tiny_models):
    """The first 64 MATH-500 prompts (18-631 tokens) on the trained policy: bucketed as the cost model
    chooses or in one padded batch, the same greedy token ids."""
    policy = LanguagePolicy(tiny_models.policy, device="cpu")
    prompts = [format_prompt(problem.problem) for problem in load_problems(MATH500, limit=64)]
    lengths = [len(ids) for ids in policy.tokenizer(prompts)["input_ids"]]
    assert len(length_batches(lengths, 32, None, 1 << 17)) == 4
    bucketed, one_batch = (HFGenerator(policy, length_buckets=buckets).generate(prompts, max_new_tokens=32,
                                                                                  temperature=0.0)
                           for buckets in (True, False))
    assert bucketed.token_ids == one_batch.token_ids


def test_seeds_reproduce_samples_without_touching_the_global_rng(policy):
    generator = HFGenerator(policy)
    global_state = torch.get_rng_state()
    first, again, other = (generator.generate(PROMPTS, n=2, max_new_tokens=8, seed=seed).token_ids
                           for seed in (7, 7, 8))
    assert first == again and first != other
    assert torch.equal(torch.get_rng_state(), global_state)


def test_a_sample_depends_on_its_seed_alone_not_on_the_batch_it_is_decoded_in(policy):
    """What data parallelism needs: a sample split off to another process with its seed is the same."""
    generator = HFGenerator(policy)
    together = generator.generate(PROMPTS, n=2, max_new_tokens=12, seed=[11, 12, 13])
    alone = generator.generate(PROMPTS[1:2], n=2, max_new_tokens=12, seed=[12])
    assert alone.token_ids == together.token_ids[2:4]
    assert together.token_ids[2] != together.token_ids[3] or together.token_ids[0] != together.token_ids[1]
    with pytest.raises(ValueError, match="got 2 seeds for 3 prompts"):
        generator.generate(PROMPTS, seed=[1, 2])


def test_repeated_prompts_sample_exactly_as_n_samples_of_one(policy):
    """The runner passes a GRPO group as n=1 copies of its prompt; each distinct prompt is prefilled once
    either way, and the samples are those of n samples of it."""
    generator = HFGenerator(policy)
    as_n = generator.generate(PROMPTS[:2], n=3, max_new_tokens=8, seed=5)
    as_copies = generator.generate([p for p in PROMPTS[:2] for _ in range(3)], n=1, max_new_tokens=8, seed=5)
    assert as_copies.token_ids == as_n.token_ids and as_copies.rollout_log_probs == as_n.rollout_log_probs
    assert as_copies.prompt_token_ids == as_n.prompt_token_ids


def test_role_adapters_in_one_call_sample_exactly_as_a_call_per_adapter(untrained_policy_dir):
    """Prompts of two role adapters and of the default actor in one call: each prompt's samples (tokens,
    rollout log-probs, texts, finish reasons) are those of a call of its adapter alone, made active around
    the call, with the same per-prompt seeds."""
    policy = role_adapter_policy(untrained_policy_dir)
    generator = HFGenerator(policy)
    prompts = PROMPTS + LONG_PROMPTS
    adapters = ["solver", "verifier", None, "verifier", "solver"]
    seeds = [11, 12, 13, 14, 15]
    greedy = {adapter: generate_with(policy, generator, adapter, prompts, max_new_tokens=12, temperature=0.0).token_ids
              for adapter in ("solver", "verifier", None)}
    assert all(len({str(greedy[a][i]) for a in greedy}) == 3 for i in range(len(prompts)))  # three voices per prompt
    for sampling in (dict(n=2, temperature=1.0), dict(n=1, temperature=0.0)):
        sampling.update(max_new_tokens=12, stop=[STEP_DELIMITER])
        mixed = generator.generate(prompts, seed=seeds, adapters=adapters, **sampling)
        for adapter in ("solver", "verifier", None):
            index = [i for i, a in enumerate(adapters) if a == adapter]
            alone = generate_with(policy, generator, adapter, [prompts[i] for i in index],
                                  seed=[seeds[i] for i in index], **sampling)
            samples = [i * sampling["n"] + j for i in index for j in range(sampling["n"])]
            for field in ("token_ids", "rollout_log_probs", "texts", "finish_reasons", "prompt_token_ids"):
                assert [getattr(mixed, field)[k] for k in samples] == getattr(alone, field), (adapter, field)
    with pytest.raises(ValueError, match=r"adapters \['critic'\] are not role adapters"):
        generator.generate(PROMPTS, adapters=["solver", "critic", None])
    with pytest.raises(ValueError, match="got 2 adapters for 3 prompts"):
        generator.generate(PROMPTS, adapters=["solver", None])


def test_inverse_cdf_sample_draws_the_distribution():
    generator = torch.Generator().manual_seed(0)
    uniforms = lambda count: torch.rand(count, generator=generator, dtype=torch.float64)  # noqa: E731
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]) * 3  # unnormalised on purpose
    draws = inverse_cdf_sample(probs.expand(200_000, -1), uniforms(200_000))
    frequencies = torch.bincount(draws, minlength=4) / len(draws)
    assert frequencies[1] == 0, "a zero-probability token was drawn"
    torch.testing.assert_close(frequencies, probs / probs.sum(), atol=5e-3, rtol=0)
    edges = torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]])
    drawn = inverse_cdf_sample(edges.repeat(1000, 1), uniforms(3000)).view(1000, 3)
    assert (drawn[:, 0] == 3).all() and (drawn[:, 1] == 0).all() and set(drawn[:, 2].tolist()) == {1, 2}
    with pytest.raises(ValueError, match="not finite"):
        inverse_cdf_sample(torch.tensor([[float("nan"), 1.0]]), uniforms(1))


def test_models_with_non_attention_layers_are_refused():
    text_config = SimpleNamespace(layer_types=["full_attention", "linear_attention"], model_type="hybrid",
                                  num_hidden_layers=2)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text_config))
    with pytest.raises(ValueError, match="linear_attention"):
        preallocated_cache(model, capacity=8)


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
        scores = low.score_actions(out.prompt_token_ids, out.token_ids).log_probs
        full_precision = policy.score_actions(out.prompt_token_ids, out.token_ids).log_probs
    assert (padded(out.rollout_log_probs) - scores).abs().max() < 2e-2
    assert (scores - full_precision).abs().max() < 5e-2
    low.score_actions(out.prompt_token_ids, out.token_ids).log_probs.sum().backward()
    grads = [p.grad for p in low.actor_parameters()]
    assert all(g is not None and g.isfinite().all() for g in grads)
    stored = torch.bfloat16 if "low_precision_weights" in precision else torch.float32
    assert low.actor_parameters()[0].dtype == stored


def test_a_bfloat16_lora_leaves_its_input_casts_to_autocast(untrained_policy_dir):
    """peft casts each adapter's input to the adapter's fp32, which autocast casts back to bf16 for the matmul: a
    bf16 LoRA policy turns that cast off, with the same scores and gradients and fewer copies."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountCopies.copies += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    low = LanguagePolicy(untrained_policy_dir, device="cpu", dtype="bfloat16", lora=LoraSettings(rank=4))
    torch.manual_seed(0)
    for name, param in low.named_parameters():
        if "lora_B" in name:  # an adapter that adds something
            param.data.normal_(0.0, 0.1)
    prompts, actions = [[5, 6, 7], [8, 9]], [[3, 4], [5]]

    def scores_grads_and_copies(cast_inputs: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        for module in low.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = cast_inputs
        low.zero_grad()
        CountCopies.copies = 0
        with CountCopies():
            scores = low.score_actions(prompts, actions).log_probs
            scores.sum().backward()
        return scores.detach(), [p.grad.clone() for p in low.actor_parameters()], CountCopies.copies

    assert all(not module.cast_input_dtype_enabled for module in low.modules() if isinstance(module, BaseTunerLayer))
    left_to_autocast, cast = scores_grads_and_copies(False), scores_grads_and_copies(True)
    assert torch.equal(left_to_autocast[0], cast[0])
    assert all(torch.equal(a, b) for a, b in zip(left_to_autocast[1], cast[1]))
    assert left_to_autocast[2] < cast[2]


def test_a_fresh_lora_acts_as_full_fine_tuning_with_bfloat16_weights(untrained_policy_dir):
    """A fresh adapter adds exactly zero, so LoRA's greedy outputs and scores are those of its bf16 base, the
    path of ``low_precision_weights``; full fine-tuning's fp32 master weights (autocast) run norms and residual
    adds in fp32, a different path whose greedy outputs may differ."""
    outputs = {}
    for name, precision in {"lora": dict(lora=LoraSettings(rank=4)), "bf16-weights": dict(low_precision_weights=True),
                            "fp32-master": {}}.items():
        low = LanguagePolicy(untrained_policy_dir, device="cpu", dtype="bfloat16", **precision)
        out = HFGenerator(low).generate(PROMPTS, max_new_tokens=12, temperature=0.0)
        with torch.no_grad():
            outputs[name] = out.token_ids, low.score_actions(out.prompt_token_ids, out.token_ids).log_probs
    assert outputs["lora"][0] == outputs["bf16-weights"][0]
    assert torch.equal(outputs["lora"][1], outputs["bf16-weights"][1])
    assert not torch.equal(outputs["lora"][1], outputs["fp32-master"][1])


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
