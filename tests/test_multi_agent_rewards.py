"""Reward sources beside the outcome, per role, in the multi-agent env: each answering role's message is
scored as one whole solution by the real reward models (the tiny PRM, Arith's exact ``steps`` reward), all
of a step's solutions in one call, on top of the verified-outcome credit; verdicts get none."""

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from envs.contract import FACTS
from envs.datasets import Arith, Problem
from envs.multi_agent import MultiAgentMathVectorEnv
from envs.rewards import OutcomeReward, RewardMixture
from envs.vector import MathVectorEnv
from envs.workflows import ACCEPT, REJECT, chain
from reward_models.reference_steps import ReferenceStepsReward

DISABLED = AutoresetMode.DISABLED
THREE = Problem("three", "Compute 56 + 77 + 95.", "228",
                "56 + 77 = 133\n\n133 + 95 = 228\n\nThe answer is \\boxed{228}.")
TWO = Problem("two", "Compute 46 - 67.", "-21", "46 - 67 = -21\n\nThe answer is \\boxed{-21}.")
WRONG = "The answer is \\boxed{-1000}."


class CountedCalls:
    """The real reward model, with the batch size of every ``score`` call it answered recorded."""

    def __init__(self, model):
        self.model, self.name, self.batches = model, model.name, []

    def score(self, contexts):
        self.batches.append(len(contexts))
        return self.model.score(contexts)


def steps_reward(weight: float, outcome: float = 1.0) -> RewardMixture:
    """--reward outcome:<outcome>,steps:<weight>."""
    return RewardMixture({"outcome": OutcomeReward(), "steps": ReferenceStepsReward()},
                         {"outcome": outcome, "steps": weight})


@pytest.mark.slow  # the trained PRM: it must tell the slip from the clean solution
def test_the_solver_gets_the_weighted_prm_score_the_single_agent_env_gives_its_solution(tiny_models):
    from reward_models.prm import ProcessRewardModel

    prm = ProcessRewardModel(tiny_models.prm, device="cpu")
    problems = Arith().problems(3, seed=1)
    ids = [p.id for p in problems]
    slip = problems[1].solution.replace("127 + 38 = 165", "127 + 38 = 175")  # a slip, and still the right answer
    solutions = [problems[0].solution, slip, WRONG]
    # the single-agent env, one whole solution per episode, --reward outcome:1.0,prm:0.2
    reward = RewardMixture({"outcome": OutcomeReward(), "prm": prm}, {"outcome": 1.0, "prm": 0.2})
    single = MathVectorEnv(3, problems=problems, autoreset_mode=DISABLED, max_steps=1, shuffle=False,
                           reward_model=reward)
    single.reset(options={"problem_ids": ids})
    _, expected, *_, single_info = single.step(solutions)
    prm_scores = single_info["reward/prm"]
    np.testing.assert_allclose(expected, [1 + 0.2 * prm_scores[0], 1 + 0.2 * prm_scores[1], 0.2 * prm_scores[2]])
    assert prm_scores[0] > 0.9 > 0.1 > prm_scores[1]  # the PRM sees the slip the verified answer does not
    # the chain with the same --reward, individual credit: the solver's reward is its answer's verdict (the
    # outcome source) plus 0.2 x the PRM's score
    env = MultiAgentMathVectorEnv(3, problems=problems, autoreset_mode=DISABLED, reward_assignment="individual",
                                  reward_model=reward, workflow=chain("line"))
    env.reset(options={"problem_ids": ids})
    _, rewards, *_, info = env.step([[text, "", ""] for text in solutions])
    np.testing.assert_allclose(rewards[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(info["reward/prm"][:, 0], prm_scores, rtol=1e-6)
    assert np.isnan(info["reward/prm"][:, 1:]).all() and (rewards[:, 1:] == 0).all()
    # verdicts get no solution-scoring reward: the verifier's reward is its verdict against the truth alone
    _, rewards, *_, info = env.step([["", ACCEPT, ""], ["", REJECT, ""], ["", REJECT, ""]])
    assert rewards.tolist() == [[0, 1, 0], [0, 0, 0], [0, 1, 0]] and "reward/prm" not in info
    # the refiner's solution is scored as the solver's was
    _, rewards, terminated, _, info = env.step([["", "", ""], ["", "", slip], ["", "", WRONG]])
    assert terminated.tolist() == [False, True, True]
    np.testing.assert_allclose(rewards[1:, 2], expected[1:], rtol=1e-6)
    np.testing.assert_allclose(info["reward/prm"][1:], [[np.nan, np.nan, prm_scores[1]],
                                                        [np.nan, np.nan, prm_scores[2]]], rtol=1e-6)


def test_the_outcome_source_is_the_credit_and_only_paid_when_named():
    """--reward means the same on every env: without 'outcome' the workflow pays no credit; its weight scales
    the credit; the trainer's facts hold each source's own reward."""
    solved = [[THREE.solution, "", ""], [TWO.solution, "", ""]]
    steps_only = MultiAgentMathVectorEnv(2, problems=[THREE, TWO], autoreset_mode=DISABLED, shuffle=False,
                                         reward_assignment="individual", reward_model=ReferenceStepsReward(),
                                         workflow=chain("line"))
    steps_only.reset(options={"problem_ids": ["three", "two"]})
    _, rewards, *_, info = steps_only.step(solved)
    assert rewards.tolist() == [[1, 0, 0], [1, 0, 0]] and "reward/outcome" not in info  # the steps alone
    both = MultiAgentMathVectorEnv(2, problems=[THREE, TWO], autoreset_mode=DISABLED, shuffle=False,
                                   reward_assignment="individual", reward_model=steps_reward(0.5, outcome=3.0),
                                   workflow=chain("line"))
    both.reset(options={"problem_ids": ["three", "two"]})
    _, rewards, *_, info = both.step(solved)
    facts = info[FACTS]
    assert rewards.tolist() == [[3.5, 0, 0], [3.5, 0, 0]] and facts.rewards is rewards
    np.testing.assert_array_equal(facts.sources["outcome"], [[1, np.nan, np.nan]] * 2)  # the solvers spoke
    np.testing.assert_array_equal(facts.sources["steps"], info["reward/steps"])
    assert facts.outputs["answer_correct"][:, 0].tolist() == [1.0, 1.0] and facts.acting[:, 1].all()
    assert both.agents.roles == ("solver", "verifier", "refiner") and both.agents.trainable == (True,) * 3
    _, rewards, terminated, _, info = both.step([["", ACCEPT, ""]] * 2)  # right verdicts end both episodes
    assert terminated.all() and rewards.tolist() == [[0, 3, 0]] * 2
    assert info[FACTS].return_so_far.tolist() == [[3.5, 3, 0]] * 2  # each slot's whole episode


def test_steps_reward_per_role_by_hand():
    """'steps' pays the matched share of the reference steps: THREE has 3, TWO has 2."""
    env = MultiAgentMathVectorEnv(2, problems=[THREE, TWO], autoreset_mode=DISABLED, shuffle=False,
                                  reward_assignment="team", reward_model=steps_reward(0.5, outcome=2.0),
                                  workflow=chain("line"))
    env.reset(options={"problem_ids": ["three", "two"]})
    # env 0's solver: the first two steps, then a wrong answer (2/3); env 1's solver: the whole reference (1)
    _, rewards, *_, info = env.step([["56 + 77 = 133\n\n133 + 95 = 228\n\n" + WRONG, "", ""], [TWO.solution, "", ""]])
    np.testing.assert_array_equal(rewards, [[0.5 * 2 / 3, 0, 0], [0.5, 0, 0]])
    np.testing.assert_array_equal(info["reward/steps"], [[2 / 3, np.nan, np.nan], [1, np.nan, np.nan]])
    # env 0's verifier rejects, env 1's accepts: env 1 ends, team credit 2.0 x 1 to the two roles that acted
    _, rewards, terminated, *_ = env.step([["", REJECT, ""], ["", ACCEPT, ""]])
    assert terminated.tolist() == [False, True] and rewards.tolist() == [[0, 0, 0], [2, 2, 0]]
    # env 0's refiner: the first step, then a slip (1/3 of the steps), and the right answer: team credit 2.0
    _, rewards, terminated, _, info = env.step([["", "", "56 + 77 = 133\n\n133 + 95 = 227\n\nThe answer is "
                                                     "\\boxed{228}."], ["", "", ""]])
    assert terminated.tolist() == [True, False]
    np.testing.assert_allclose(rewards, [[2, 2, 2 + 0.5 / 3], [0, 0, 0]])
    np.testing.assert_array_equal(info["reward/steps"], [[np.nan, np.nan, 1 / 3], [np.nan] * 3])


def test_a_continuing_role_is_scored_with_the_prefix_it_continues():
    env = MultiAgentMathVectorEnv(1, problems=[THREE], workflow="prefix", autoreset_mode=DISABLED,
                                  reward_assignment="individual", reward_model=steps_reward(1.0))
    env.reset()
    _, rewards, *_, info = env.step([["56 + 77 = 13", ""]])  # the writer's prefix, cut mid-step: no reward
    assert rewards.tolist() == [[0, 0]] and "reward/steps" not in info
    _, rewards, terminated, _, info = env.step([["", "3\n\n133 + 95 = 228\n\nThe answer is \\boxed{228}."]])
    # the solver's solution is prefix + continuation, the whole reference: steps 1 (+ its answer, 1);
    # the writer, who answers nothing, is paid the team outcome
    assert terminated.tolist() == [True] and rewards.tolist() == [[1, 2]]
    assert info["reward/steps"][0, 1] == 1 and np.isnan(info["reward/steps"][0, 0])


def test_one_batched_score_call_per_env_step():
    problems = Arith().problems(8, seed=3)
    counted = CountedCalls(ReferenceStepsReward())
    env = MultiAgentMathVectorEnv(4, problems=problems, autoreset_mode=DISABLED, reward_model=counted,
                                  workflow=chain("line"))
    _, info = env.reset(seed=0)
    by_id = {p.id: p for p in problems}
    env.step([[by_id[i].solution, "", ""] for i in info["problem_id"]])
    env.step([["", verdict, ""] for verdict in (ACCEPT, REJECT, "unsure", ACCEPT)])  # verdicts only: no call
    env.step([["", "", WRONG]] * 4)  # the two rejected solutions' refiners
    assert counted.batches == [4, 2]
    counted.batches.clear()
    debate = MultiAgentMathVectorEnv(2, problems=problems, workflow="debate", autoreset_mode=DISABLED,
                                     reward_model=counted)
    debate.reset(seed=0)
    for _ in range(2):
        _, rewards, *_, info = debate.step([[WRONG] * 3] * 2)
        assert info["reward/steps"].shape == (2, 3)
    assert counted.batches == [6, 6]  # every debater of every env, each round
