"""bench/real_model_methods.py's arithmetic and presets: the comparison line, the standard errors, the rows'
flags as train_math resolves them (the runs themselves are the bench's, and the real_model tests')."""

from __future__ import annotations

import math

import pytest

from bench.real_model_methods import (METHODS, PREFIX_ARITH, PREFIX_KL, PREFIX_TOKENS, ROWS, SAMPLES_PER_ITERATION,
                                      TARGET_TOKENS, comparison, mean_and_error, parse_args, row_flags, weights_digest)


def history(*accuracies: float) -> list[dict[str, float]]:
    return [{"eval/accuracy": a, "iteration": i, "env_steps": 64 * i, "seconds": 60.0 * i, "eval/mean_length": 9.0}
            for i, a in enumerate(accuracies)]


def test_a_mean_of_seeds_takes_the_larger_of_the_binomial_error_and_the_seeds_spread():
    close = {0: history(0.2, 0.5), 1: history(0.2, 0.5)}  # no spread: binomial, sqrt(2 * .25 / 500) / 2
    assert mean_and_error(close, 500) == (0.5, pytest.approx(math.sqrt(2 * 0.25 / 500) / 2))
    apart = {0: history(0.2, 0.3), 1: history(0.2, 0.7)}  # sd 0.283 over sqrt(2): 0.2
    assert mean_and_error(apart, 500) == (pytest.approx(0.5), pytest.approx(0.2))


def test_the_comparison_line_states_both_runs_the_gain_and_its_standard_errors():
    results = {"prefix_rl": {0: history(0.2, 0.6), 1: history(0.2, 0.6)},
               "target_alone": {0: history(0.18)}}  # a frozen model: one run, whatever the seeds
    line = comparison("prefix_rl", "target_alone", results, 500)
    error = math.hypot(math.sqrt(2 * 0.24 / 500) / 2, math.sqrt(0.18 * 0.82 / 500))
    assert line == (f"prefix_rl 0.200 -> 0.600 vs target_alone 0.180 -> 0.180 at equal samples (+42.0 points, "
                    f"{0.42 / error:.1f} standard errors)")


@pytest.mark.parametrize("row", list(ROWS))
def test_every_row_is_a_train_math_command_that_resolves(row, untrained_policy_dir, tmp_path):
    """Parsed and resolved by train_math's own flags; equal generated samples at every evaluation."""
    from test_train_math import parse

    args = parse_args(["--method", "prime", "--model", str(untrained_policy_dir), "--iterations", "16",
                       "--eval_interval", "8", "--out", str(tmp_path)])
    model = str(untrained_policy_dir)
    config = parse(*row_flags(row, 0, args, {"model": model, "target": model, "writer": model}),
                   "--logdir", str(tmp_path))
    assert config.env.prompt_template == "chat" and config.generation.temperature == 0.3
    if ROWS[row].val_only:
        assert config.budget.val_only and config.generation.max_new_tokens == PREFIX_TOKENS + TARGET_TOKENS
        return
    samples = config.env.num_envs * (config.prime.oversample_factor if config.learning.algorithm == "RLOO" else 1)
    assert samples * config.budget.num_iterations == 16 * SAMPLES_PER_ITERATION
    assert samples * config.budget.eval_interval == 8 * SAMPLES_PER_ITERATION
    if row == "prefix_rl":
        assert config.generation.max_new_tokens == PREFIX_TOKENS and config.prefix_rl.target_max_new_tokens == 128
        assert config.learning.kl_coef == PREFIX_KL and config.learning.kl_loss_type == "low_var_kl"
    if row in METHODS["prime"][1]:
        assert config.prime.process_coef == 0


def test_prefix_rl_trains_and_is_tested_on_one_form_of_problem():
    """Its rows take three-number sums; their train and held-out sets are disjoint and of that one form (the
    shared task's held-out set holds every two-number sum, its training set none)."""
    from envs.datasets import Arith

    assert {ROWS[row].arith["min_ops"] for row in ("prefix_rl", *METHODS["prefix_rl"][1])} == {2}
    knobs = {key: PREFIX_ARITH[key] for key in ("digits", "min_ops", "max_ops", "operators")}
    train, test = Arith(**knobs).split(PREFIX_ARITH["num_train"], PREFIX_ARITH["num_test"], 0)
    assert (len(train), len(test)) == (500, 500) and not {p.id for p in train} & {p.id for p in test}
    assert {p.level for p in train} == {p.level for p in test} == {2}
    shared_train, shared_test = Arith(**{**knobs, "min_ops": 1}).split(500, 500, 0)
    assert {p.level for p in shared_train} == {2} and sum(p.level == 1 for p in shared_test) == 100


def test_the_weights_digest_sees_a_changed_weight(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 8)
    before = weights_digest(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 7 + b"\x01")
    assert weights_digest(tmp_path) != before


def test_a_writer_that_is_its_own_target_scores_the_same_alone_and_in_the_team(untrained_policy_dir):
    """bench.prefix_signal on the untrained tiny policy as writer and target: the target's greedy continuation
    of a prefix is the writer's own, so the team and the writer alone are right on the same prefixes."""
    from argparse import Namespace

    from bench.prefix_signal import team_outcomes
    from envs.datasets import Arith
    from envs.prompts import format_prompt
    from models.generation import HFGenerator
    from models.policy import LanguagePolicy

    policy = LanguagePolicy(untrained_policy_dir, device="cpu").eval()
    problems = Arith().problems(3, seed=4)
    args = Namespace(group_size=4, prefix_tokens=4, target_tokens=6, seed=0)
    result = team_outcomes(HFGenerator(policy), HFGenerator(policy), [format_prompt(p.problem) for p in problems],
                           [p.answer for p in problems], args, temperature=1.0)
    assert result["team"] == result["writer_alone"] and 1 <= result["distinct"] <= 4
    assert 0 <= result["mixed_groups"] <= 1 and result["prefix_tokens"] <= 4
