"""The one episode loop (``play``): at each step the (env, agent) pairs that act get one action each, generated in one
call per speaker, the vector env takes them, and its ``envs.contract.StepFacts`` say what came of them.
Training collection (``train.collector.Collector``) and held-out evaluation (``train.evaluation``) both run it:
collection draws every action from a seed of its own and writes what it yields into its buffer; evaluation plays
greedily (or from its own seeds) and keeps the verdicts. Both read the env only through ``envs.contract``.

``Sampling`` says how an action is generated and what the env takes of it; ``RoleModels`` who speaks for each
agent slot of a multi-agent env.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from envs.contract import FACTS, Agents, StepFacts
from envs.modes import FinishReason
from models.generation import GenerationOutput, Generator


@dataclass(frozen=True)
class Sampling:
    """How actions are generated. ``stop``: strings that end an action (the step delimiter when an
    action is one step; None when it is a whole solution). ``eos_text``: appended to a step that
    ended on EOS, so the env (whose end marker it is) ends the episode even without an answer.
    ``token_actions``: an action is the one generated token id (the env's token mode)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] | None = None
    eos_text: str = ""
    token_actions: bool = False

    def generate_kwargs(self, greedy: bool = False) -> dict[str, Any]:
        """``Generator.generate``'s keywords for one sample per prompt; ``greedy`` for evaluation (temperature 0:
        top-p and the seed do not matter)."""
        return dict(n=1, max_new_tokens=self.max_new_tokens, temperature=0.0 if greedy else self.temperature,
                    top_p=self.top_p, stop=list(self.stop) if self.stop is not None else None)

    def actions(self, out: GenerationOutput) -> list[str] | list[int]:
        """The env actions of ``out``'s samples: texts, or token ids in token mode."""
        if self.token_actions:
            return [ids[0] for ids in out.token_ids]
        if self.stop is None:
            return list(out.texts)
        return [text + self.eos_text if reason == FinishReason.EOS else text
                for text, reason in zip(out.texts, out.finish_reasons)]

    def env_actions(self, out: GenerationOutput, acting: np.ndarray, num_envs: int) -> list[str] | np.ndarray:
        """Actions for all ``num_envs`` envs: ``out``'s for the envs ``acting``, a placeholder (ignored by an env
        that is not acting) for the others."""
        actions = self.actions(out)
        if self.token_actions:
            every = np.zeros(num_envs, dtype=np.int64)
            every[acting] = actions
            return every
        every = [""] * num_envs
        for k, i in enumerate(acting):
            every[i] = actions[k]
        return every


def acting_pairs(facts: StepFacts, in_play: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(envs, agents) [B]: the (env, agent) pairs that act now (``facts.acting``), among the envs ``in_play`` [N]."""
    return np.nonzero(facts.acting & in_play[:, None])


def pair_prompts(agents: Agents, obs: Sequence, envs: np.ndarray, slots: np.ndarray) -> list[str]:
    """The observations of the pairs ``envs[b], slots[b]`` (one per env, or [N][A] with several agents)."""
    if not agents.multi:
        return [obs[i] for i in envs]
    return [obs[i][a] for i, a in zip(envs, slots)]


def pair_actions(env, sampling: Sampling, out: GenerationOutput, envs: np.ndarray,
                 slots: np.ndarray) -> list | np.ndarray:
    """The env's actions from ``out``'s samples of the pairs ``envs[b], slots[b]``: one per env, or (several
    agents) one message per agent slot of each env, with placeholders where nobody acts."""
    if not env.agents.multi:
        return sampling.env_actions(out, envs, env.num_envs)
    actions = [[""] * env.agents.count for _ in range(env.num_envs)]
    for i, a, action in zip(envs, slots, sampling.actions(out)):
        actions[i][a] = action
    return actions


@dataclass(frozen=True)
class RoleModels:
    """What generates for each agent slot of a multi-agent env: the policy through its generator (by default),
    under the slot's own LoRA adapter (``adapters``: one adapter per role), or a model of the slot's own
    (``generators``: a frozen role's, or a member's, ``members`` naming the member's role), sampled as
    ``samplings`` says for that slot (e.g. a target's longer budget)."""

    adapters: dict[int, str] = field(default_factory=dict)
    generators: dict[int, Generator] = field(default_factory=dict)
    samplings: dict[int, Sampling] = field(default_factory=dict)
    members: dict[int, str] = field(default_factory=dict)

    @property
    def voices(self) -> dict[int, str]:
        """{agent slot: what scores its rows in the update (``models.team.Team``): its member's role or its role
        adapter}; the slots missing are the policy's own."""
        return {**self.adapters, **self.members}

    def generate_calls(self, sampling: Sampling, generator: Generator, prompts: list[str], agents: np.ndarray,
                       seeds: list[int] | None = None,
                       greedy: bool = False) -> list[tuple[list[int], Generator, dict[str, Any]]]:
        """The ``generate`` calls that sample one action per prompt [B] whose agent is ``agents[b]``: one per
        group of pairs with one speaker, in order of first appearance, as (the group's positions, its generator,
        the call's keywords: its prompts, ``seeds`` (None: unseeded) and sampling). The policy's pairs form one
        group, each with its role's adapter; each frozen role's pairs a group of their own."""
        speakers = [a if a in self.generators else None for a in agents.tolist()]  # None: the policy
        calls = []
        for speaker in dict.fromkeys(speakers):
            index = [k for k, s in enumerate(speakers) if s == speaker]
            if speaker is None:
                adapters = [self.adapters.get(int(agents[k])) for k in index]
                kwargs = {**sampling.generate_kwargs(greedy), "adapters": adapters if any(adapters) else None}
            else:
                kwargs = self.samplings.get(speaker, sampling).generate_kwargs(greedy)
            kwargs["prompts"] = [prompts[k] for k in index]
            kwargs["seed"] = None if seeds is None else [seeds[k] for k in index]
            calls.append((index, generator if speaker is None else self.generators[speaker], kwargs))
        return calls

    def generate(self, sampling: Sampling, generator: Generator, prompts: list[str], agents: np.ndarray,
                 seeds: list[int] | None = None, greedy: bool = False) -> GenerationOutput:
        """One action per prompt [B], each from its agent's speaker (``generate_calls``), in prompt order."""
        parts = [(index, speaker.generate(**kwargs))
                 for index, speaker, kwargs in self.generate_calls(sampling, generator, prompts, agents, seeds, greedy)]
        return parts[0][1] if len(parts) == 1 else GenerationOutput.interleave(parts, len(prompts))


@dataclass(frozen=True)
class EnvStep:
    """One step of ``play``. Its actions: ``t`` (the step's index), the (env, agent) pairs ``envs[b], agents[b]``
    [B] that acted, on the facts ``before`` (their group ids, a centralized critic's states), with ``out``, what
    was generated for them. What the env returned: ``obs``, ``facts``, ``terminated`` and ``truncated`` [N].
    ``in_play`` [N]: the envs whose episode was still being played at this step. The seconds generating and the env
    step took."""

    t: int
    envs: np.ndarray
    agents: np.ndarray
    out: GenerationOutput
    before: StepFacts
    obs: Sequence
    facts: StepFacts
    terminated: np.ndarray
    truncated: np.ndarray
    in_play: np.ndarray
    generate_seconds: float
    env_seconds: float

    @property
    def ended(self) -> np.ndarray:
        """[N]: the episodes in play that ended at this step."""
        return (self.terminated | self.truncated) & self.in_play


Seeder = Callable[[int, int, int], int]
"""(step, env, agent slot) -> the seed the action of that pair at that step is drawn from."""


def play(env, obs: Sequence, facts: StepFacts, generator: Generator, sampling: Sampling, role_models: RoleModels,
         seed_of: Seeder | None = None, steps: int | None = None, whole_episodes: bool = True,
         in_play: np.ndarray | None = None) -> Iterator[EnvStep]:
    """Steps ``env`` on from the observations ``obs`` and facts ``facts`` (a reset's or the last step's), yielding
    each step's ``EnvStep``: at most ``steps`` steps (None: no bound), until no pair acts. ``seed_of``: each
    action's seed (None: greedy). ``in_play`` [N]: the envs whose episodes are played (None: all; the others
    only pad a batch, their slots never act). ``whole_episodes``: an env whose episode ends is out of play from
    then on; else episodes run on through the env's autoreset."""
    in_play = np.ones(env.num_envs, dtype=bool) if in_play is None else in_play
    for t in itertools.count() if steps is None else range(steps):
        envs, agents = acting_pairs(facts, in_play)
        if len(envs) == 0:
            return
        started = time.perf_counter()
        seeds = None if seed_of is None else [seed_of(t, i, a) for i, a in zip(envs, agents)]
        prompts = pair_prompts(env.agents, obs, envs, agents)
        out = role_models.generate(sampling, generator, prompts, agents, seeds, greedy=seed_of is None)
        generated = time.perf_counter()
        before = facts
        obs, _, terminated, truncated, info = env.step(pair_actions(env, sampling, out, envs, agents))
        facts = info[FACTS]
        yield EnvStep(t, envs, agents, out, before, obs, facts, terminated, truncated, in_play,
                      generated - started, time.perf_counter() - generated)
        if whole_episodes:
            in_play = in_play & ~(terminated | truncated)
