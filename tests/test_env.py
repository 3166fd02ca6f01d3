import copy

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers the env ids)
from envs.contract import FACTS
from envs.datasets import Arith, Problem
from envs.math_env import MathEnv, MathTask, Transition, UnicodeText
from envs.modes import ActionLevel, Tool
from envs.prompts import format_prompt, split_steps
from envs.rewards import RewardOutput

PROBLEMS = Arith().problems(50, seed=0)


class StepLengthReward:
    """A user-style reward model: pays len(step) / 100 for every step; records its batch sizes."""

    name = "length"

    def __init__(self):
        self.batch_sizes = []

    def score(self, contexts):
        self.batch_sizes.append(len(contexts))
        rewards = np.array([len(c.new_step) / 100 for c in contexts])
        return RewardOutput(rewards=rewards, sources={self.name: rewards})


def play(env, steps):
    """Steps through ``steps``; returns the list of (reward, terminated, truncated, info)."""
    out = []
    for step in steps:
        _, reward, terminated, truncated, info = env.step(step)
        out.append((reward, terminated, truncated, info))
    return out


def test_check_env_step_mode():
    check_env(MathEnv(problems=PROBLEMS), skip_render_check=True)


def test_check_env_token_mode(tiny_tokenizer):
    check_env(MathEnv(problems=PROBLEMS, mode="token", tokenizer=tiny_tokenizer, max_solution_tokens=16),
              skip_render_check=True)


def test_reference_solution_is_rewarded_and_terminates():
    env = MathEnv(problems=PROBLEMS)
    obs, info = env.reset(seed=0)
    problem = next(p for p in PROBLEMS if p.id == info["problem_id"])
    facts = info.pop(FACTS)
    assert obs == format_prompt(problem.problem) and info == {"problem_id": problem.id, "group_id": 0, "step": 0}
    assert facts.problem_ids.tolist() == [problem.id] and facts.acting.tolist() == [[True]]
    steps = split_steps(problem.solution)
    results = play(env, [s + "\n\n" for s in steps])
    assert [r[0] for r in results] == [0.0] * (len(steps) - 1) + [1.0]
    assert [r[1] for r in results] == [False] * (len(steps) - 1) + [True]
    assert not any(r[2] for r in results)
    assert all("correct" not in r[3] and r[3]["reward/outcome"] == 0.0 for r in results[:-1])
    assert results[-1][3]["correct"] is True and results[-1][3]["reward/outcome"] == 1.0
    # the same step as the one env of the contract: rewards [1, 1], the episode's return, its verdict
    last = results[-1][3][FACTS]
    assert last.rewards.tolist() == [[1.0]] and last.return_so_far.tolist() == [[1.0]]
    assert last.correct.tolist() == [1.0]
    assert last.sources["outcome"].tolist() == [[1.0]] and last.acting.tolist() == [[False]]
    assert last.turns.tolist() == [len(steps)]
    assert env.render() is None


def test_wrong_answer_no_answer_and_truncation():
    env = MathEnv(problems=PROBLEMS, max_steps=3, render_mode="ansi")
    _, info = env.reset(seed=1)
    wrong = play(env, ["The answer is \\boxed{123456}."])
    assert wrong[0][:3] == (0.0, True, False) and wrong[0][3]["correct"] is False
    env.reset()
    rambling = play(env, ["hmm", "let me think", "still thinking"])
    assert [r[1:3] for r in rambling] == [(False, False), (False, False), (False, True)]
    assert rambling[-1][3]["correct"] is False
    assert env.render().endswith("hmm\n\nlet me think\n\nstill thinking\n\n")
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("more")


def test_gold_answer_never_in_observation():
    problem = Problem(id="p", problem="What is six times seven?", answer="42")
    env = MathEnv(problems=[problem])
    obs, _ = env.reset(seed=0)
    obs, *_ = env.step("Six sevens.")
    assert "42" not in obs


def test_reset_options_and_seeding():
    env = MathEnv(problems=PROBLEMS)
    _, info = env.reset(seed=0, options={"problem_id": PROBLEMS[7].id})
    assert info["problem_id"] == PROBLEMS[7].id
    first = [env.reset(seed=3)[1]["problem_id"]] + [env.reset()[1]["problem_id"] for _ in range(49)]
    again = [env.reset(seed=3)[1]["problem_id"]] + [env.reset()[1]["problem_id"] for _ in range(49)]
    assert first == again and sorted(first) == sorted(p.id for p in PROBLEMS)  # one epoch, no repeats
    with pytest.raises(KeyError, match="nope"):
        env.reset(options={"problem_id": "nope"})


def test_custom_reward_model_and_clipping():
    reward = StepLengthReward()
    env = MathEnv(problems=PROBLEMS, reward_model=reward, max_step_chars=10)
    env.reset(seed=0)
    _, r, _, _, info = env.step("x" * 25)
    assert r == pytest.approx(0.10) and info["action_clipped"] and info["reward/length"] == pytest.approx(0.10)
    assert reward.batch_sizes == [1]


def test_task_scores_a_batch_as_arrays():
    """One reward-model call for the completed steps; rewards 0.0 and sources NaN where no step
    was completed, verdicts only where the episode ended."""
    reward = StepLengthReward()
    task = MathTask(problems=PROBLEMS, reward_model=reward)
    episodes = [task.new_episode(problem, group_id=k) for k, problem in enumerate(PROBLEMS[:4])]
    right = f"The answer is \\boxed{{{PROBLEMS[2].answer}}}."
    actions = ["abc", "The answer is \\boxed{123456}.", right]
    transitions = [task.apply(e, a) for e, a in zip(episodes, actions)] + [Transition(None, False, False)]
    scores = task.score(episodes, transitions)
    expected = [0.03, len(actions[1]) / 100, len(right) / 100]
    assert reward.batch_sizes == [3]
    np.testing.assert_allclose(scores.rewards, expected + [0.0])
    np.testing.assert_allclose(scores.sources["length"], expected + [np.nan])
    np.testing.assert_array_equal(scores.correct, [np.nan, 0.0, 1.0, np.nan])
    assert [e.done for e in episodes] == [False, True, True, False]


def test_token_mode_matches_step_mode(tiny_tokenizer):
    problem = PROBLEMS[0]
    solution = "".join(s + "\n\n" for s in split_steps(problem.solution))
    token_env = MathEnv(problems=[problem], mode="token", tokenizer=tiny_tokenizer)
    token_env.reset(seed=0)
    rewards, step_ends = [], []
    for token_id in tiny_tokenizer(solution, add_special_tokens=False)["input_ids"]:
        obs, reward, terminated, truncated, info = token_env.step(token_id)
        rewards.append(reward)
        step_ends.append(info["step"])
    assert terminated and not truncated and info["correct"] is True
    assert sum(rewards) == 1.0 and rewards[-1] == 1.0
    assert obs == format_prompt(problem.problem) + solution
    assert max(step_ends) == len(split_steps(problem.solution))


def test_token_mode_eos_ends_and_length_truncates(tiny_tokenizer):
    env = MathEnv(problems=PROBLEMS, mode="token", tokenizer=tiny_tokenizer, max_solution_tokens=5)
    env.reset(seed=0)
    *_, terminated, truncated, info = env.step(tiny_tokenizer.eos_token_id)
    assert terminated and not truncated and info["correct"] is False
    env.reset()
    digit = tiny_tokenizer.convert_tokens_to_ids("1")
    flags = [env.step(digit)[2:4] for _ in range(5)]
    assert flags[-1] == (False, True) and not any(any(f) for f in flags[:-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        env.reset()
        env.step(len(tiny_tokenizer) + 5)


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="exactly one problem source"):
        MathEnv()
    with pytest.raises(ValueError, match="needs tokenizer"):
        MathEnv(problems=PROBLEMS, mode="token")
    with pytest.raises(ValueError, match="mode='chars'"):
        MathEnv(problems=PROBLEMS, mode="chars")
    with pytest.raises(ValueError, match="max_steps=0"):
        MathEnv(problems=PROBLEMS, max_steps=0)
    with pytest.raises(TypeError, match="one reasoning step as str"):
        env = MathEnv(problems=PROBLEMS)
        env.reset(seed=0)
        env.step(5)


def test_modes_given_as_strings_become_the_members_and_a_bad_one_names_the_allowed_values():
    task = MathTask(problems=PROBLEMS, mode="step", tools="python")
    assert task.mode is ActionLevel.STEP and task.tools is Tool.PYTHON
    task.close()
    assert MathTask(problems=PROBLEMS, mode=ActionLevel.STEP, tools="none").tools is Tool.NONE
    assert MathTask(problems=PROBLEMS).tools is Tool.NONE
    with pytest.raises(ValueError, match=r"mode='solution' must be one of 'step', 'token' \(a whole solution per "
                                         r"action is mode='step' with max_steps=1\)"):
        MathTask(problems=PROBLEMS, mode=ActionLevel.SOLUTION)
    with pytest.raises(ValueError, match=r"tools='bash' must be one of 'python', 'none' or None"):
        MathTask(problems=PROBLEMS, tools="bash")


def test_gymnasium_make_arith_and_math500(tmp_path):
    env = gymnasium.make("Arith-v0")
    obs, info = env.reset(seed=0)
    assert obs.startswith("Problem: Compute ") and info["problem_id"].startswith("arith:")
    with pytest.raises(ValueError, match="exactly one problem source"):
        gymnasium.make("MATH-v0", problems=PROBLEMS)  # MATH-v0 reads the bundled MATH-500 by default


def test_handoff_steps_terminates_for_prefix_rl():
    reward = StepLengthReward()
    env = MathEnv(problems=PROBLEMS, handoff_steps=2, reward_model=reward)
    env.reset(seed=0)
    assert env.step("12 + 34 = 46")[2:4] == (False, False)
    _, _, terminated, truncated, info = env.step("46 - 5 = 41")
    assert terminated and not truncated and info["step"] == 2
    with pytest.raises(ValueError, match="handoff_steps=0"):
        MathEnv(problems=PROBLEMS, handoff_steps=0)


def test_env_kwargs_update_the_registered_knobs_and_reach_the_problems():
    overrides = envs.override_kwargs("Arith-v0", {"arith": {"digits": 1, "max_ops": 2, "num_train": 3000,
                                                            "num_test": 200}, "max_steps": 4})
    assert overrides == {"arith": {**envs.DEFAULT_ARITH, "digits": 1, "max_ops": 2, "num_train": 3000,
                                   "num_test": 200}, "max_steps": 4}
    env = gymnasium.make_vec("Arith-v0", num_envs=2, vectorization_mode="vector_entry_point", split="test",
                             **overrides)
    assert len(env.problems) == 200 and env.task.max_steps == 4
    operands = [int(x) for p in env.problems for x in p.problem[len("Compute "):-1].split()[::2]]
    assert max(operands) <= 9 and {p.level for p in env.problems} == {1, 2}
    assert envs.override_kwargs("MATH-v0", {"levels": [1]}) == {"levels": [1]}


def test_a_batched_text_space_holds_copies_with_their_own_rng():
    """gymnasium's batch_space deep-copies the space per env: each copy draws from its own seeded RNG, and
    all accept any Unicode string up to the length."""
    batched = gymnasium.vector.utils.batch_space(UnicodeText(8, seed=0), 3)
    batched.seed(7)
    first = batched.sample()
    assert len(set(first)) == 3 and all(batched.spaces[0].contains(text) for text in first)
    batched.seed(7)
    assert batched.sample() == first
    space = UnicodeText(8, seed=5)
    copied = copy.deepcopy(space)
    assert copied.sample() == space.sample()  # the copy's RNG is a copy in the same state, not the same one
    assert batched.spaces[0].contains("π/2≈1.5") and not batched.spaces[0].contains("x" * 9)
