"""The implicit-PRM probe: where an answer's extracted result ends, token by token, and a probe of a real PRIME
run's checkpoint (min-form credit: its PRM restored as it trained) whose log-ratios are the PRM's own."""

from __future__ import annotations

import glob
import math

import pytest
import torch

from envs.modes import ImplicitPrmGranularity, ProcessBaseline, ProcessCredit
from bench.implicit_prm_probe import answer_ends, log_ratios, probe, restored_runner, stream_figures
from test_trainer import run_train_math


def test_answer_ends_count_the_tokens_through_the_first_place_the_answer_appears():
    texts = ["7 + 9 = 16. The answer is 16. The answer is 16.", "no result here", "The answer is 4"]
    pieces = [["7 + 9", " = 1", "6.", " The answer is", " 16", ".", " The answer is", " 16", "."],
              ["no", " result", " here"], ["The answer", " is", " 4"]]
    assert [sum(map(len, p)) for p in pieces] == [len(t) for t in texts]
    # "16" first appears in the sum, ending inside its third token; none extracted; the last token
    assert answer_ends(texts, pieces) == [3, None, 3]


def test_stream_figures_compare_the_two_streams_per_token_returns_by_hand():
    # group 0: a right answer of 2 tokens (process rewards 0.2, 0.0) and a wrong one of 1 (-0.2); group 1: a right
    # and a wrong answer of 1 token each (-0.1, 0.1). Pairs: the outcome's leave-one-out returns are +-1; the
    # process stream's a_t = 2 r_t - (m_i + m_j), then summed to go: group 0 [0.5, 0.1] -> [0.6, 0.1] and -0.3,
    # group 1 -0.2 and 0.2
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0])
    process = torch.tensor([[0.2, 0.0], [-0.2, 0.0], [-0.1, 0.0], [0.1, 0.0]])
    mask = torch.tensor([[True, True], [True, False], [True, False], [True, False]])
    figures = stream_figures(outcome, process, mask, torch.tensor([0, 0, 1, 1]))
    returns_o = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    returns_p = torch.tensor([0.6, 0.1, -0.3, -0.2, 0.2], dtype=torch.float64)
    assert figures["responses"] == 4
    assert figures["outcome_std"] == pytest.approx(float(returns_o.std(correction=0)))
    assert figures["process_std"] == pytest.approx(float(returns_p.std(correction=0)))
    var_o, var_p = returns_o.var(correction=0), returns_p.var(correction=0)
    assert figures["process_variance_share"] == pytest.approx(float(var_p / (var_o + var_p)))
    assert figures["correlation"] == pytest.approx(float(torch.corrcoef(torch.stack([returns_o, returns_p]))[0, 1]))
    assert figures["sign_agreement"] == pytest.approx(3 / 5)  # group 1's two tokens disagree
    # first-token returns against the length beyond the group's mean (group 0: +0.5 and -0.5; group 1: 0 and 0)
    longer = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64)
    for stream, first in (("outcome", [1.0, -1.0, 1.0, -1.0]), ("process", [0.6, -0.3, -0.2, 0.2])):
        expected = torch.corrcoef(torch.stack([torch.tensor(first, dtype=torch.float64), longer]))[0, 1]
        assert figures[f"{stream}_length_correlation"] == pytest.approx(float(expected))


@pytest.fixture(scope="module")
def prime_checkpoint(untrained_policy_dir, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("prime_run")
    run_train_math(["--model_name_or_path", str(untrained_policy_dir), "--algorithm_name", "RLOO",
                    "--oversample_factor", "1", "--accuracy_lower_bound", "0", "--num_env_steps", "8",
                    "--n_rollout_threads", "8", "--group_size", "4", "--max_new_tokens", "8", "--eval_interval",
                    "0", "--logdir", str(logdir), "--noasync_rollouts", "--process_credit_assignment", "min_form"])
    return sorted(glob.glob(f"{logdir}/*/run_*/checkpoints/iter_*"))[-1]


def test_a_prime_checkpoint_is_probed_and_its_rewards_add_up(prime_checkpoint, tmp_path):
    figures = probe(prime_checkpoint, rounds=2, seed=3)
    assert figures["answers"] == 16 and 0 <= figures["cut_share"] <= 1 and 0 <= figures["correct_share"] <= 1
    assert figures["right/answers"] + figures["wrong/answers"] <= figures["answers"]
    assert 0 < figures["stream/responses"] <= 16 and figures["stream/process_std"] > 0
    assert figures["stream/credit"] == "min_form"  # the run's
    # the same rollouts re-scored with the other credit: the answers and the outcome stream as they were
    summed = probe(prime_checkpoint, rounds=2, seed=3, credit=ProcessCredit.SUM_FORM)
    assert summed["stream/credit"] == "sum_form" and summed["correct_share"] == figures["correct_share"]
    assert summed["stream/outcome_std"] == pytest.approx(figures["stream/outcome_std"])
    assert summed["stream/process_std"] != pytest.approx(figures["stream/process_std"])
    # and with each response's rewards summed at its last token (the run's granularity: token)
    whole = probe(prime_checkpoint, rounds=2, seed=3, granularity=ImplicitPrmGranularity.WHOLE)
    assert (whole["stream/granularity"], figures["stream/granularity"]) == ("whole", "token")
    assert whole["stream/outcome_std"] == pytest.approx(figures["stream/outcome_std"])
    assert whole["stream/process_std"] != pytest.approx(figures["stream/process_std"])
    # and with the response baseline: every answer here runs to the 8-token cap, and at equal lengths the two
    # baselines take the same (the by-hand test of leave_one_out_centred has unequal ones)
    response = probe(prime_checkpoint, rounds=2, seed=3, baseline=ProcessBaseline.RESPONSE)
    assert (response["stream/baseline"], figures["stream/baseline"]) == ("response", "token")
    assert figures["cut_share"] == 1.0
    assert response["stream/process_std"] == pytest.approx(figures["stream/process_std"])
    for name in ("right", "wrong"):
        if figures[f"{name}/answers"]:
            assert figures[f"{name}/tokens_to_answer"] + figures[f"{name}/tokens_after"] <= 8 + 1e-9
            assert math.isfinite(figures[f"{name}/stop_after_answer_reward"])
    # the probe's log-ratios are the checkpoint's PRM's (not all zero after its step), batched as its own scores
    runner = restored_runner(prime_checkpoint, tmp_path)
    try:
        prm = runner.learner.implicit_prm
        assert prm.credit == ProcessCredit.MIN_FORM and prm.min_form_temperature == 0.1  # the run's, restored
        prompts, actions = [[1, 2, 3], [1, 2], [5]], [[4, 5], [6], [7, 8, 9]]
        ratio = log_ratios(prm, prompts, actions, batch=2)
        scores = prm.outcome_scores(prompts, (torch.tensor([[4, 5, 0], [6, 0, 0], [7, 8, 9]]), torch.tensor([2, 1, 3])))
    finally:
        runner.close()
    assert [len(r) for r in ratio] == [2, 1, 3] and any(bool(r.abs().max() > 0) for r in ratio)
    torch.testing.assert_close(torch.stack([prm.beta * r.sum() for r in ratio]), scores.float().cpu(),
                               rtol=1e-4, atol=1e-6)


def test_a_run_without_an_implicit_prm_is_refused(untrained_policy_dir, tmp_path):
    run_train_math(["--model_name_or_path", str(untrained_policy_dir), "--num_env_steps", "4",
                    "--n_rollout_threads", "4", "--group_size", "4", "--max_new_tokens", "4", "--eval_interval", "0",
                    "--logdir", str(tmp_path), "--noasync_rollouts"])
    checkpoint = sorted(glob.glob(f"{tmp_path}/*/run_*/checkpoints/iter_*"))[-1]
    with pytest.raises(ValueError, match="without an implicit PRM"):
        restored_runner(checkpoint, tmp_path / "probe")
