"""Held-out evaluation as papers report it: pass@k (the unbiased estimator), maj@k over grader-equal answers,
mean@n, readable answers, and several named held-out sets; hand-computed cases, then end to end."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from absl import flags
from gymnasium.vector import AutoresetMode

from envs.datasets import Problem
from envs.vector import MathVectorEnv
from models.generation import GenerationOutput, HFGenerator, mix_seed
from models.policy import LanguagePolicy
from test_train_math import parse
from train.episodes import Sampling
from train.config import EvalSet
from train.eval_metrics import answer_equality, majority_correct, pass_at_k, sample_sizes, sampled_sums
from train.evaluation import EvalSampling, evaluate_sets


# ---------------------------------------------------------------------------------------------
# The formulas, by hand
# ---------------------------------------------------------------------------------------------

def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2)) == pytest.approx(0.7)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass_at_1: the share right
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # none right; every pair holds a right one
    for n, c, k in ((200, 7, 10), (64, 30, 16), (16, 1, 16)):
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), rel=1e-12)


def test_k_runs_over_powers_of_two_and_n():
    assert sample_sizes(1) == [1] and sample_sizes(5) == [1, 2, 4, 5] and sample_sizes(8) == [1, 2, 4, 8]


def test_answers_the_grader_judges_equal_vote_together():
    answers = ["0.5", "3", "1/2", None, "\\frac{1}{2}", "3"]
    (equal,) = answer_equality([answers])
    assert equal.astype(int).tolist() == [[1, 0, 1, 0, 1, 0], [0, 1, 0, 0, 0, 1], [1, 0, 1, 0, 1, 0],
                                          [0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 0], [0, 1, 0, 0, 0, 1]]
    correct = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    assert majority_correct(equal, correct) == 1.0  # one half: 3 votes, 3: 2


def test_a_tied_vote_goes_to_the_answer_given_first():
    (equal,) = answer_equality([["3", "1/2", "0.5", "3"]])
    correct = np.array([0.0, 1.0, 1.0, 0.0])
    assert majority_correct(equal, correct) == 0.0  # 2 against 2: "3" came first
    assert majority_correct(equal[1:, 1:], correct[1:]) == 1.0  # 2 against 1


def test_unreadable_answers_do_not_vote():
    (equal,) = answer_equality([[None, None, "7"]])
    assert majority_correct(equal, np.array([0.0, 0.0, 1.0])) == 1.0  # the two without an answer are no group
    (none,) = answer_equality([[None, None]])
    assert majority_correct(none, np.zeros(2)) == 0.0


def test_sampled_sums_add_problems():
    correct = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    answers = [["0.5", "3", "1/2", None], ["4", "4", "3", None]]
    sums = sampled_sums(correct, answers)
    expected = {"pass_at_1": 0.5 + 0.25, "pass_at_2": (1 - 1 / 6) + (1 - 3 / 6), "pass_at_4": 2.0,
                "maj_at_2": 1.0 + 0.0, "maj_at_4": 1.0 + 0.0, "mean_at_4": 0.5 + 0.25}
    assert list(sums) == list(expected) and sums == pytest.approx(expected)
    assert "maj_at_2" not in sampled_sums(correct, None)  # no answers (another verdict than the answer's): no vote


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------

def test_eval_dataset_path_names_several_sets(tmp_path):
    data = tmp_path / "held_out.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    assert parse().env.eval_sets == (EvalSet(),)
    assert parse("--eval_dataset_path", str(data)).env.eval_sets == (EvalSet(None, str(data)),)
    config = parse("--eval_dataset_path", f"held_out={data}, arith=", "--eval_samples", "4",
                   "--eval_temperature", "0.6", "--eval_top_p", "0.95")
    assert config.env.eval_sets == (EvalSet("held_out", str(data)), EvalSet("arith", None))
    assert (config.budget.eval_samples, config.budget.eval_temperature, config.budget.eval_top_p) == (4, 0.6, 0.95)


@pytest.mark.parametrize("value, match", [("a=x.jsonl,a=", "names the set 'a' twice"),
                                          ("a/b=", "must be NAME=PATH"), ("a=,=x", "must be NAME=PATH"),
                                          ("a=missing.jsonl", "does not exist")])
def test_bad_eval_sets_fail_naming_the_entry(value, match):
    with pytest.raises(flags.Error, match=match):
        parse("--eval_dataset_path", value)


def test_eval_temperature_without_eval_samples_fails():
    with pytest.raises(flags.Error, match="add --eval_samples"):
        parse("--eval_temperature", "0.6")


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------

HALF = Problem("half", "What is one half?", "\\frac{1}{2}")
SEVEN = Problem("seven", "What is three plus four?", "7")
THREE = Problem("three", "What is one plus two?", "3")
SCRIPT = {  # problem: (greedy answer, sampled answers in sample order); None: a solution without an answer
    HALF.problem: ("0.5", ["0.5", "3", "1/2", None]),
    SEVEN.problem: (None, ["2", "7", "2", "7"]),
    THREE.problem: ("4", ["4", "4", "3", None]),
}


class ScriptedSolver:
    """Answers as ``SCRIPT`` says: the greedy answer at temperature 0, else the j-th sampled answer to the
    j-th row of a problem in the call (a batch's rows are problem-major); records every call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, n=1, seed=None, temperature=1.0, top_p=1.0, **sampling) -> GenerationOutput:
        self.calls.append({"rows": len(prompts), "seed": seed, "temperature": temperature, "top_p": top_p})
        asked, texts = {}, []
        for prompt in prompts:
            problem = next(text for text in SCRIPT if text in prompt)
            greedy, sampled = SCRIPT[problem]
            asked[problem] = asked.get(problem, -1) + 1
            answer = greedy if temperature == 0 else sampled[asked[problem]]
            texts.append("I do not know." if answer is None else f"The answer is \\boxed{{{answer}}}.")
        ids = [self.tokenizer(text)["input_ids"] for text in texts]
        return GenerationOutput(texts=texts, token_ids=ids, rollout_log_probs=[[0.0] * len(i) for i in ids],
                                finish_reasons=["eos"] * len(texts), prompt_token_ids=[[1]] * len(texts))

    def sync(self, policy) -> float:
        return 0.0


def held_out(problems: list[Problem], num_envs: int = 8) -> MathVectorEnv:
    return MathVectorEnv(num_envs, problems=problems, group_size=1, max_steps=1,
                         autoreset_mode=AutoresetMode.DISABLED)


def test_two_named_sets_log_greedy_and_sampled_metrics_each(tiny_tokenizer):
    envs = {"arith": held_out([HALF, SEVEN]), "math": held_out([THREE])}
    solver = ScriptedSolver(tiny_tokenizer)
    sampled = EvalSampling(samples=4, temperature=0.7, top_p=0.9, seed=3)
    result = evaluate_sets(envs, solver, Sampling(max_new_tokens=16), limit=10, sampled=sampled)
    expected = {
        "eval/accuracy": 0.5,  # the first set's greedy accuracy: the headline
        "eval/arith/accuracy": 0.5, "eval/arith/readable": 0.5, "eval/arith/accuracy_readable": 1.0,
        "eval/arith/pass_at_1": 0.5, "eval/arith/pass_at_2": 5 / 6, "eval/arith/pass_at_4": 1.0,
        "eval/arith/maj_at_2": 0.5, "eval/arith/maj_at_4": 0.5, "eval/arith/mean_at_4": 0.5,  # seven: 2 against 7, tied
        "eval/math/accuracy": 0.0, "eval/math/readable": 1.0, "eval/math/accuracy_readable": 0.0,
        "eval/math/pass_at_1": 0.25, "eval/math/pass_at_2": 0.5, "eval/math/pass_at_4": 1.0,
        "eval/math/maj_at_2": 0.0, "eval/math/maj_at_4": 0.0, "eval/math/mean_at_4": 0.25,
    }
    assert {key: result[key] for key in expected} == pytest.approx(expected)
    assert set(result) == {*expected, "eval/arith/mean_length", "eval/math/mean_length", "time/eval"}
    # greedy, then every sample of every problem in one call per env step, seeded per (problem, sample)
    assert [(call["rows"], call["temperature"], call["top_p"]) for call in solver.calls] == \
        [(2, 0.0, 1.0), (8, 0.7, 0.9), (1, 0.0, 1.0), (4, 0.7, 0.9)]
    assert solver.calls[1]["seed"] == [mix_seed(mix_seed(3, i, j), 0, 0) for i in range(2) for j in range(4)]


def test_one_unnamed_set_keeps_the_plain_keys(tiny_tokenizer):
    result = evaluate_sets({None: held_out([HALF, SEVEN])}, ScriptedSolver(tiny_tokenizer),
                           Sampling(max_new_tokens=16), limit=10)
    assert set(result) == {"eval/accuracy", "eval/mean_length", "eval/readable", "eval/accuracy_readable",
                           "time/eval"}
    assert result["eval/accuracy"] == 0.5


def test_a_set_of_several_levels_logs_each_levels_greedy_accuracy(tiny_tokenizer):
    """HALF right at level 1; SEVEN (no answer) and THREE (4) wrong at level 2; the limit leaves out level 3."""
    problems = [replace(HALF, level=1), replace(SEVEN, level=2), replace(THREE, level=2),
                replace(THREE, id="x", level=3)]
    result = evaluate_sets({None: held_out(problems)}, ScriptedSolver(tiny_tokenizer), Sampling(max_new_tokens=16),
                           limit=3)
    assert result["eval/accuracy"] == pytest.approx(1 / 3)
    assert {key: value for key, value in result.items() if "level" in key} == {"eval/accuracy_level_1": 1.0,
                                                                                  "eval/accuracy_level_2": 0.0}


def test_samples_of_the_tiny_policy_are_reproducible_and_batch_independent(untrained_policy_dir):
    generator = HFGenerator(LanguagePolicy(untrained_policy_dir, device="cpu").eval())
    sampled = EvalSampling(samples=3, temperature=1.0, seed=0)
    problems = [HALF, SEVEN, THREE]
    runs = [evaluate_sets({"a": held_out(problems, num_envs), "b": held_out(problems[:1], num_envs)}, generator,
                          Sampling(max_new_tokens=6), limit=10, sampled=sampled)
            for num_envs in (9, 9, 4)]
    for run in runs:
        run.pop("time/eval")
        assert {"eval/a/pass_at_2", "eval/a/maj_at_3", "eval/b/mean_at_3", "eval/b/accuracy"} <= set(run)
    assert runs[0] == runs[1] == pytest.approx(runs[2])
