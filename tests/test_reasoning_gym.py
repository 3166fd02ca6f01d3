"""The reasoning-gym problem source (envs.reasoning_gym_source) on two of its datasets, chain_sum and
basic_arithmetic: the split by seed, its problems through the env's plain and chat prompts, each answer scored
by the dataset's own scorer in the grading workers (partial credit included), and a training run on it."""

import json

import gymnasium
import pytest

import envs  # noqa: F401  (registers ReasoningGym-v0)
from envs.grader import extract_answer, reasoning_gym_scores, warm_up
from envs.math_env import build_problems
from envs.prompts import chatml_template
from envs.reasoning_gym_source import SYSTEM_PROMPT
from tests.event_files import read_scalars
from tests.test_trainer import run_train_math

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra: pip install 'mathrl[rg]'")

CHAIN_SUM = {"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 3, "max_digits": 2}, "num_train": 300,
             "num_test": 40, "seed": 7}
BASIC_ARITHMETIC = {"name": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
                    "num_train": 200, "num_test": 30}


@pytest.fixture(scope="module", autouse=True)
def workers():
    """The grading workers with reasoning-gym imported, started once (the import takes seconds)."""
    warm_up(scorers=("reasoning_gym",))


@pytest.mark.parametrize("source", [CHAIN_SUM, BASIC_ARITHMETIC], ids=["chain_sum", "basic_arithmetic"])
def test_the_split_follows_the_seed_and_holds_no_question_out_twice(source):
    train, test = build_problems(reasoning_gym=source, split="train"), build_problems(reasoning_gym=source,
                                                                                    split="test")
    assert len(test) == source["num_test"] and 0.9 * source["num_train"] <= len(train) <= source["num_train"]
    assert not {p.problem for p in train} & {p.problem for p in test}
    dataset = reasoning_gym.create_dataset(source["name"], seed=source.get("seed", 0),
                                           size=source["num_train"] + source["num_test"], **source["config"])
    first_test = dataset[source["num_train"]]
    assert (test[0].problem, test[0].answer) == (first_test["question"], str(first_test["answer"]))
    reseeded = build_problems(reasoning_gym={**source, "seed": 99}, split="test")
    assert [p.problem for p in reseeded] != [p.problem for p in test]


@pytest.mark.parametrize("source", [CHAIN_SUM, BASIC_ARITHMETIC], ids=["chain_sum", "basic_arithmetic"])
def test_the_datasets_own_scorer_pays_the_outcome(source):
    env = gymnasium.make("ReasoningGym-v0", reasoning_gym=source, split="test")
    prompt, info = env.reset(seed=0)
    problem = env.unwrapped.task.sampler.get(info["problem_id"])
    assert prompt == f"Problem: {problem.problem}\nSolution:\n" and problem.answer not in prompt.split("=")[-1]
    paid = {}
    for name, solution in {"tags": f"Adding up.\n<answer>{problem.answer}</answer>",
                           "boxed": f"The answer is $\\boxed{{{problem.answer}}}$.",
                           "wrong": f"<answer>{int(problem.answer) + 1}</answer>"}.items():
        env.reset(options={"problem_id": problem.id})
        _, paid[name], terminated, _, step_info = env.step(solution)
        assert terminated and step_info["correct"] == (paid[name] == 1.0)
    assert paid == {"tags": 1.0, "boxed": 1.0, "wrong": 0.0}


def test_partial_credit_is_the_scorers_own():
    """basic_arithmetic's scorer gives an answer with a trailing period part of the credit; the env pays it and
    counts the answer wrong."""
    problem = build_problems(reasoning_gym=BASIC_ARITHMETIC, split="test")[0]
    spec = json.loads(problem.scorer)
    dataset = reasoning_gym.create_dataset("basic_arithmetic", **spec["config"])
    expected = dataset.score_answer(problem.answer + ".", dataset[spec["index"]])
    assert 0.0 < expected < 1.0
    assert reasoning_gym_scores([problem.answer + ".", problem.answer, None], [problem.scorer] * 3) == [
        pytest.approx(expected), 1.0, 0.0]
    env = gymnasium.make("ReasoningGym-v0", reasoning_gym=BASIC_ARITHMETIC, split="test")
    env.reset(options={"problem_id": problem.id})
    _, reward, _, _, info = env.step(f"<answer>{problem.answer}.</answer>")
    assert reward == pytest.approx(expected) and info["correct"] is False


def test_the_chat_path_puts_the_question_in_the_user_turn_with_reasoning_gyms_system_prompt():
    env = gymnasium.make("ReasoningGym-v0", reasoning_gym=CHAIN_SUM, template=chatml_template(SYSTEM_PROMPT))
    prompt, info = env.reset(seed=1)
    problem = env.unwrapped.task.sampler.get(info["problem_id"])
    assert prompt == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{problem.problem}"
                      "<|im_end|>\n<|im_start|>assistant\n")
    assert extract_answer("<answer>answer here</answer>") == "answer here"  # the format the prompt asks for
    assert SYSTEM_PROMPT == reasoning_gym.utils.SYSTEM_PROMPTS["default"].strip()


@pytest.mark.parametrize("source, message", [
    ({"name": "no_such_dataset"}, "not a reasoning-gym dataset"),
    ({"name": "chain_sum", "sizes": 3}, "takes no key ['sizes']"),
    ({"name": "chain_sum", "num_train": 0}, "num_train=0 must be an integer >= 1"),
    ({"name": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}, "reasoning_gym chain_sum config"),
])
def test_a_bad_source_fails_naming_it(source, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_problems(reasoning_gym=source, split="train")


def test_train_math_trains_on_a_reasoning_gym_dataset(untrained_policy_dir, tmp_path):
    """The flags a user gives: the env id and its dataset in --env_kwargs; the held-out accuracy is the
    dataset's scorer's."""
    source = {"reasoning_gym": {"name": "chain_sum", "config": {"max_terms": 2, "max_digits": 1}, "num_train": 64,
                                "num_test": 8}}
    run_dir = run_train_math(["--env_id", "ReasoningGym-v0", "--env_kwargs", json.dumps(source),
                              "--model_name_or_path", str(untrained_policy_dir), "--num_env_steps", "16",
                              "--n_rollout_threads", "8", "--group_size", "4", "--max_new_tokens", "6",
                              "--eval_interval", "2", "--eval_limit", "8", "--eval_batch_size", "8",
                              "--logdir", str(tmp_path)])
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["eval/accuracy"]] == [0, 2] and len(scalars["train/reward"]) == 2
