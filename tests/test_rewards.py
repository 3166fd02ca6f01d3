import numpy as np
import pytest

from envs.datasets import Problem
from envs.rewards import (OutcomeReward, RewardMixture, RewardModel, RewardModelError, RewardOutput, StepContext,
                          score_batch)
from reward_models.mixture import parse_reward_spec

PROBLEM = Problem(id="p", problem="What is 1/2 + 1/4?", answer="\\frac{3}{4}")


def context(steps: list[str], done: bool) -> StepContext:
    return StepContext(problem=PROBLEM, previous_steps=tuple(steps[:-1]), new_step=steps[-1], done=done)


BATCH = [
    context(["1/2 = 2/4", "The answer is \\boxed{0.75}."], done=True),       # right, other form
    context(["The answer is \\boxed{\\dfrac{3}{4}}."], done=True),           # right
    context(["1/2 + 1/4 = 2/6", "The answer is \\boxed{\\frac{1}{3}}."], done=True),  # wrong
    context(["1/2 + 1/4 is", "hmm"], done=True),                             # truncated, no answer
    context(["1/2 = 2/4"], done=False),                                      # not finished
]


def test_outcome_reward_values():
    reward = OutcomeReward(correct=1.0, wrong=-0.5, no_answer=-1.0)
    assert isinstance(reward, RewardModel)
    output = reward.score(BATCH)
    np.testing.assert_array_equal(output.rewards, [1.0, 1.0, -0.5, -1.0, 0.0])
    np.testing.assert_array_equal(output.correct[:4], [1.0, 1.0, 0.0, 0.0])
    assert np.isnan(output.correct[4])
    np.testing.assert_array_equal(output.sources["outcome"], output.rewards)
    penalised = OutcomeReward(format_penalty=0.25).score(
        BATCH + [context(["So it is 3/4.", "The answer is 3/4"], True)])
    np.testing.assert_array_equal(penalised.rewards, [1.0, 1.0, 0.0, -0.25, 0.0, 0.75])


class ConstantPerStep:
    """A reward source paying a fixed amount for every step; records how often it was called."""

    def __init__(self, name: str, value: float):
        self.name, self.value, self.calls = name, value, 0

    def score(self, contexts):
        self.calls += 1
        rewards = np.full(len(contexts), self.value)
        return RewardOutput(rewards=rewards, sources={self.name: rewards})


def test_mixture_combines_weights_and_keeps_sources():
    prm = ConstantPerStep("prm", 0.5)
    mixture = RewardMixture({"outcome": OutcomeReward(), "prm": prm},
                            parse_reward_spec("outcome:1.0,prm:0.2", ["outcome", "prm"]))
    output = mixture.score(BATCH)
    np.testing.assert_allclose(output.rewards, [1.1, 1.1, 0.1, 0.1, 0.1])
    np.testing.assert_array_equal(output.sources["outcome"], [1.0, 1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(output.sources["prm"], [0.5] * 5)
    np.testing.assert_array_equal(output.correct[:4], [1.0, 1.0, 0.0, 0.0])
    assert prm.calls == 1


class Unreachable(ConstantPerStep):
    def score(self, contexts):
        raise ConnectionError("PRM server at http://127.0.0.1:8001 refused the connection")


def test_a_failing_source_of_a_mixture_is_the_one_named():
    mixture = RewardMixture({"outcome": OutcomeReward(), "prm": Unreachable("prm", 0.0)},
                            parse_reward_spec("outcome:1.0,prm:0.2", ["outcome", "prm"]))
    with pytest.raises(RewardModelError, match=r"^reward model 'prm' \(Unreachable\) raised ConnectionError: "
                                               r"PRM server at http://127.0.0.1:8001 refused the connection while "
                                               r"scoring a batch "
                                               r"of 5 steps of problems \[p\]$"):
        score_batch(mixture, BATCH)


def test_a_mixture_combines_any_shape_and_a_bare_model_is_one_source():
    mixture = RewardMixture({"outcome": OutcomeReward(), "prm": ConstantPerStep("prm", 0.5)},
                            {"outcome": 2.0, "prm": 0.5})
    # [N, A] rewards per source, as the multi-agent env gives them
    combined = mixture.combine({"prm": np.array([[1.0, 0.0]]), "outcome": np.array([[1.0, 1.0]])})
    np.testing.assert_array_equal(combined, [[2.5, 2.0]])
    outcome = OutcomeReward()
    one = RewardMixture.of(outcome)
    assert one.models == {"outcome": outcome} and one.weights == {"outcome": 1.0}
    assert RewardMixture.of(mixture) is mixture
    with pytest.raises(ValueError, match="needs at least one source"):
        RewardMixture({}, {})


@pytest.mark.parametrize(
    "spec, message",
    [
        ("outcome:1.0,critic:0.2", "unknown source 'critic'"),
        ("outcome:abc", "weight 'abc' of 'outcome' is not a number"),
        ("outcome:nan", "must be finite"),
        ("outcome,outcome:2", "names 'outcome' twice"),
        (" , ", "names no source"),
    ],
)
def test_reward_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_reward_spec(spec, ["outcome", "prm"])


def test_reward_spec_defaults_weight_one():
    assert parse_reward_spec("outcome, prm:0.25", ["outcome", "prm"]) == {"outcome": 1.0, "prm": 0.25}


def test_reference_steps_reward_pays_the_matched_share_in_increments():
    from reward_models.reference_steps import ReferenceStepsReward

    problem = Problem("a1", "Compute 57 + 25 - 43.", "39",
                      solution="57 + 25 = 82\n\n82 - 43 = 39\n\nThe answer is \\boxed{39}.")
    reward = ReferenceStepsReward()
    # step mode: right, right, wrong answer -> 1/3, 1/3, 0; a step after a deviation earns nothing
    steps = ["57 + 25 = 82", "82 - 43 = 39", "The answer is \\boxed{40}."]
    contexts = [StepContext(problem, tuple(steps[:k]), steps[k], k == 2) for k in range(3)]
    np.testing.assert_allclose(reward.score(contexts).rewards, [1 / 3, 1 / 3, 0.0])
    after_error = StepContext(problem, ("57 + 25 = 83",), "82 - 43 = 39", False)
    assert reward.score([after_error]).rewards[0] == 0.0
    # solution mode: the whole solution is one action; whitespace around steps does not matter
    whole = StepContext(problem, (), " 57 + 25 = 82 \n\n82 - 43 = 39\n\nThe answer is \\boxed{39}.", True)
    assert reward.score([whole]).rewards[0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no reference solution"):
        reward.score([StepContext(Problem("m1", "Find x.", "2"), (), "x = 2", True)])
