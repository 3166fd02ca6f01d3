"""The one episode loop, ``train.episodes.play``, that collection and evaluation both run: which pairs act at each
step, which rows are in play, when it stops, and the seeds (or greedy sampling) each generate call gets."""

from __future__ import annotations

import numpy as np
from gymnasium.vector import AutoresetMode

from envs.contract import FACTS
from envs.datasets import Problem
from envs.modes import FinishReason
from envs.vector import MathVectorEnv
from models.sampling import GenerationOutput
from train.episodes import RoleModels, Sampling, play

PROBLEM = Problem(id="p0", problem="What is 6*7?", answer="42")


class TwoStepGenerator:
    """A step without an answer, then ``\\boxed{42}``, for every prompt; keeps each call's keywords."""

    def __init__(self):
        self.calls: list[dict] = []

    def generate(self, prompts, **kwargs) -> GenerationOutput:
        self.calls.append({"prompts": list(prompts), **kwargs})
        text = "6*7 is 42." if len(self.calls) == 1 else "So \\boxed{42}."
        return GenerationOutput([text] * len(prompts), [[1, 2]] * len(prompts), [[-0.5, -0.5]] * len(prompts),
                                [FinishReason.STOP] * len(prompts), [[3]] * len(prompts))


def test_play_steps_the_rows_in_play_until_their_episodes_end():
    env = MathVectorEnv(3, problems=[PROBLEM], max_steps=4, autoreset_mode=AutoresetMode.DISABLED)
    obs, info = env.reset(seed=0)
    generator = TwoStepGenerator()
    seeded = list(play(env, obs, info[FACTS], generator, Sampling(max_new_tokens=8), RoleModels(),
                       seed_of=lambda t, i, a: 100 * t + 10 * i + a, in_play=np.array([True, True, False])))
    assert [s.t for s in seeded] == [0, 1]  # every played episode answered at step 1: nothing acts after it
    assert all(s.envs.tolist() == [0, 1] and s.agents.tolist() == [0, 0] for s in seeded)  # row 2 only pads
    assert [s.ended.tolist() for s in seeded] == [[False, False, False], [True, True, False]]
    assert seeded[1].facts.correct[:2].tolist() == [1.0, 1.0] and seeded[1].before is seeded[0].facts
    assert [call["seed"] for call in generator.calls] == [[0, 10], [100, 110]]
    assert {call["temperature"] for call in generator.calls} == {1.0}

    obs, info = env.reset(seed=0)
    greedy = TwoStepGenerator()
    assert len(list(play(env, obs, info[FACTS], greedy, Sampling(max_new_tokens=8), RoleModels(), steps=1))) == 1
    assert greedy.calls[0]["seed"] is None and greedy.calls[0]["temperature"] == 0.0  # no seeds: greedy
    assert len(greedy.calls[0]["prompts"]) == 3  # every row in play by default
