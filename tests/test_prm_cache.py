"""The shepherd PRM's KV cache: scores equal full recomputation, prefixes are checked by ids, the
cache is bounded and empties as episodes end."""

import copy
import warnings

import numpy as np
import pytest
import torch
from absl import flags
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from envs.datasets import Arith
from envs.prompts import split_steps
from envs.rewards import StepContext
from reward_models.kv_cache import Past, PastCache
from reward_models.prm import ProcessRewardModel
from train.flags import config_from_flags

PROBLEMS = Arith().problems(12, seed=5)
SOLUTIONS = [(p.problem, split_steps(p.solution)) for p in PROBLEMS]


@pytest.fixture
def extend_log(monkeypatch) -> list[list[tuple[int, int]]]:
    """Records, for every forward of ``ProcessRewardModel._extend``, each row's (past tokens, new tokens)."""
    log: list[list[tuple[int, int]]] = []
    original = ProcessRewardModel._extend

    def spy(self, pasts, encoded):
        lengths = [0 if past is None else past.length for past in pasts]
        log.append([(p, len(ids) - p) for p, ids in zip(lengths, encoded)])
        return original(self, pasts, encoded)

    monkeypatch.setattr(ProcessRewardModel, "_extend", spy)
    return log


def env_calls(num_envs: int, num_steps: int) -> list[tuple[list[str], list[list[str]], list[bool]]]:
    """``step_scores`` arguments of ``num_steps`` env steps: env i steps through the reference
    solutions of its own problems, starting the next as soon as one ends (so first steps, scored in
    full, share calls with later ones, scored from their cache)."""
    queues = [iter(SOLUTIONS[i::num_envs]) for i in range(num_envs)]
    current = [next(queue) for queue in queues]
    done_steps = [0] * num_envs
    calls = []
    for _ in range(num_steps):
        problems, steps, finished = [], [], []
        for i, (problem, solution) in enumerate(current):
            done_steps[i] += 1
            problems.append(problem)
            steps.append(solution[: done_steps[i]])
            finished.append(done_steps[i] == len(solution))
            if finished[-1]:
                current[i], done_steps[i] = next(queues[i], current[i]), 0
        calls.append((problems, steps, finished))
    return calls


def test_cached_scores_equal_full_recompute_over_episodes(untrained_policy_dir, extend_log):
    full = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=0)
    cached = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=16, batch_size=16)
    assert full.past_cache is None and cached.past_cache is not None
    calls = env_calls(num_envs=4, num_steps=6)
    for problems, steps, finished in calls:
        expected = full.step_scores(problems, steps)
        got = cached.step_scores(problems, steps, finished=finished)
        assert [len(s) for s in got] == [len(s) for s in steps]
        for want, have in zip(expected, got):
            np.testing.assert_allclose(have, want, atol=1e-5)
    # One forward per call; every row past its first step ran only its new step's tokens after a
    # cached past (the tiny tokenizer never merges across the step boundary), first steps in full.
    assert len(extend_log) == len(calls)
    for (_, steps, _), rows in zip(calls, extend_log):
        assert sorted(past > 0 for past, _ in rows) == sorted(len(s) > 1 for s in steps)
    widths = {past for rows in extend_log for past, _ in rows if past}
    assert len(widths) > 1, "the test should combine pasts of different lengths in one forward"
    # Entries of finished episodes are dropped, extended ones replaced: one per live trajectory.
    assert len(cached.past_cache) == sum(not f for f in calls[-1][2])


def test_cached_scoring_passes_the_cache_as_transformers_expects(untrained_policy_dir):
    # transformers 5.24 renamed past_key_values to cache and warns on every forward given the old name
    cached = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for problems, steps, finished in env_calls(num_envs=2, num_steps=3):
            cached.step_scores(problems, steps, finished=finished)


def test_score_pays_the_same_rewards_and_ends_empty(untrained_policy_dir):
    full = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, aggregation="min", kv_cache_mb=0)
    cached = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, aggregation="min")
    episodes = [(problem, split_steps(problem.solution)) for problem in PROBLEMS[:5]]
    for k in range(1, max(len(s) for _, s in episodes) + 1):
        contexts = [StepContext(problem, tuple(s[: k - 1]), s[k - 1], done=k == len(s))
                    for problem, s in episodes if len(s) >= k]
        np.testing.assert_allclose(cached.score(contexts).rewards, full.score(contexts).rewards, atol=1e-5)
    assert len(cached.past_cache) == 0 and cached.past_cache.nbytes == 0  # every episode ended: nothing kept


def test_rescoring_the_same_text_runs_no_forward(untrained_policy_dir, extend_log):
    prm = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False)
    problem, solution = SOLUTIONS[0]
    first = prm.step_scores([problem], [solution])
    again = prm.step_scores([problem], [solution])
    assert len(extend_log) == 1
    np.testing.assert_array_equal(again[0], first[0])


def test_left_truncation_falls_back_to_full_scoring(untrained_policy_dir, extend_log):
    problem, solution = max(SOLUTIONS, key=lambda s: len(s[1]))
    full = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=0)
    lengths = [len(full.tokenizer(full.text(problem, solution[:k]))["input_ids"]) for k in range(1, len(solution) + 1)]
    assert len(lengths) >= 3
    full.max_length = max_length = lengths[1]  # the first two texts fit, the later ones are cut
    cached = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, max_length=max_length)
    for k in range(1, len(solution) + 1):
        np.testing.assert_allclose(cached.step_scores([problem], [solution[:k]])[0],
                                   full.step_scores([problem], [solution[:k]])[0], atol=1e-5)
    # A text cut from the left has every id shifted: never an extension of the previous one.
    expected = [0] + [previous if n <= max_length else 0 for previous, n in zip(lengths, lengths[1:])]
    assert [past for (past, _), in extend_log] == expected
    assert expected[1] > 0 and expected[2] == 0


def test_tokens_merged_across_the_step_boundary_fall_back_to_full_scoring(untrained_policy_dir, tiny_tokenizer,
                                                                           tmp_path, extend_log):
    # A tokenizer with one token for "\n\nSo": the delimiter ending the previous text merges with
    # the next step's first word, so the old ids are no prefix of the new ones.
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_tokens(["\n\nSo"])
    model = AutoModelForCausalLM.from_pretrained(str(untrained_policy_dir))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    full = ProcessRewardModel(tmp_path, device="cpu", check_labels=False, kv_cache_mb=0)
    cached = ProcessRewardModel(tmp_path, device="cpu", check_labels=False)
    problem, steps = "Compute 1 + 2 + 3.", ["1 + 2 = 3", "So 3 + 3 = 6", "The answer is 6"]
    old, new = (cached.tokenizer(cached.text(problem, steps[:k]))["input_ids"] for k in (1, 2))
    assert new[: len(old)] != old  # the merge really happens
    for k in (1, 2, 3):
        np.testing.assert_allclose(cached.step_scores([problem], [steps[:k]])[0],
                                   full.step_scores([problem], [steps[:k]])[0], atol=1e-5)
    assert [past for (past, _), in extend_log] == [0, 0, len(new)]  # step 2 in full, step 3 from its cache


def test_sliding_window_model_scores_equal_full_recompute(tiny_tokenizer, tmp_path, extend_log):
    # Math-Shepherd's own PRM is a Mistral (4096-token window); here a window of 8 that matters.
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           pad_token_id=tiny_tokenizer.pad_token_id)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    full = ProcessRewardModel(tmp_path, device="cpu", check_labels=False, kv_cache_mb=0)
    cached = ProcessRewardModel(tmp_path, device="cpu", check_labels=False)
    for problems, steps, finished in env_calls(num_envs=4, num_steps=5):
        expected = full.step_scores(problems, steps)
        for want, have in zip(expected, cached.step_scores(problems, steps, finished=finished)):
            np.testing.assert_allclose(have, want, atol=1e-5)
    assert sum(past > 0 for rows in extend_log for past, _ in rows) >= 8
    full.model.config.sliding_window = None  # the window changes the scores: the comparison above means something
    problem, solution = SOLUTIONS[0]
    (without_window,) = full.step_scores([problem], [solution])
    (with_window,) = cached.step_scores([problem], [solution])
    assert np.abs(without_window - with_window).max() > 1e-3


def fake_past(num_tokens: int) -> Past:
    """A past of ``num_tokens`` tokens taking 2 * 2 * 1 * 4 * 4 = 64 bytes each."""
    return Past(tuple(range(num_tokens)), torch.zeros(4, 1, num_tokens, 4), np.zeros(0))


def test_past_cache_evicts_least_recently_used_within_its_cap():
    cache = PastCache(max_bytes=64 * 10)
    cache.put("a", fake_past(4))
    cache.put("b", fake_past(4))
    assert cache.get("a") is not None  # "a" is now the most recent, "b" the least
    cache.put("c", fake_past(4))
    assert list(cache.entries) == ["a", "c"] and cache.nbytes == 64 * 8
    cache.put("d", fake_past(11))  # larger than the whole cap: not kept, nothing evicted for it
    assert list(cache.entries) == ["a", "c"]
    cache.put("a", fake_past(2))  # replacing an entry re-counts its bytes
    assert cache.nbytes == 64 * 6
    cache.pop("c")
    cache.pop("missing")
    assert list(cache.entries) == ["a"] and cache.nbytes == 64 * 2
    with pytest.raises(ValueError, match="max_bytes=0"):
        PastCache(0)


def test_small_cap_evicts_and_scores_stay_exact(untrained_policy_dir):
    full = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=0)
    config = full.model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # fp32
    cap = 100 * per_token  # two or three of these trajectories
    cached = ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=cap / 2**20)
    evicted_live = []
    for problems, steps, finished in env_calls(num_envs=6, num_steps=4):
        expected = full.step_scores(problems, steps)
        for want, have in zip(expected, cached.step_scores(problems, steps, finished=finished)):
            np.testing.assert_allclose(have, want, atol=1e-5)
        assert 0 < cached.past_cache.nbytes <= cap
        assert cached.past_cache.nbytes == sum(p.nbytes for p in cached.past_cache.entries.values())
        evicted_live.append(len(cached.past_cache) < sum(not f for f in finished))
    assert any(evicted_live)


def test_bad_cache_arguments_fail_naming_the_value(untrained_policy_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_mb=-1 must be >= 0"):
        ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False, kv_cache_mb=-1)
    with pytest.raises(ValueError, match="kv_cache_mb=8 .* 0 for prm_type='classifier'"):
        ProcessRewardModel(tmp_path, prm_type="classifier", device="cpu", kv_cache_mb=8)
    FLAGS = flags.FLAGS
    FLAGS.unparse_flags()
    try:
        FLAGS(["train_math", "--prm_type", "qwen", "--prm_kv_cache_mb", "8"])
        with pytest.raises(flags.Error, match="--prm_kv_cache_mb=8.0 needs --prm_type=shepherd"):
            config_from_flags(FLAGS)
        FLAGS.unparse_flags()
        FLAGS(["train_math", "--prm_type", "qwen", "--prm_kv_cache_mb", "0"])
        assert config_from_flags(FLAGS).rewards.prm_type == "classifier"
    finally:
        FLAGS.unparse_flags()
