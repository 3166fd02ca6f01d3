"""Prefix-RL: a frozen target model finishes the policy's solution; reward = it got it right.

The policy (a small model) writes a prefix (the env's action(s)); the target (a bigger frozen
model, HF or vLLM backend) receives the problem and that prefix, writes the rest, and is graded.
Reward = fraction of ``num_samples`` target completions whose final answer verifies (1 sample:
binary). All finished trajectories of a step are completed in one batched ``generate`` call and
graded in one ``grade_batch`` call.

Env configuration: ``handoff_steps=k`` ends an episode (terminated) after k policy steps, handing
the solution over; with ``k=1`` and a generator capped at ``max_new_tokens`` tokens and no stop
string, one action is a prefix of up to that many tokens. See the README's Prefix-RL section.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Sequence

import numpy as np

from envs.grader import extract_answer, grade_batch
from envs.prompts import DEFAULT_TEMPLATE, STEP_DELIMITER, format_prompt, join_steps, resolve_template
from envs.rewards import RewardOutput, StepContext
from models.generation import Generator, mix_seed


class TargetSolver:
    """Reward from a frozen target model's verified completions of each finished trajectory.

    Args:
        generator: a generation backend serving the target model (``HFGenerator`` over a frozen
            ``LanguagePolicy`` of its directory, or a ``VLLMGenerator``).
        num_samples: completions per trajectory (m); reward = fraction verified correct.
        max_new_tokens, temperature: the target's sampling (temperature 0: greedy, m should be 1).
        template: the prompt template the target expects: a key of ``envs.prompts.TEMPLATES`` or a string
            holding ``{problem}``, e.g. ``models.prompting.build_template("chat", target_tokenizer)`` for an
            instruct target (the prefix then continues its assistant turn).
        seed: base of the sampling seeds. A context's completions are seeded from it, the episode's
            ``group_id`` and the prefix (and, for identical prefixes of one group in one call, their
            order), so they do not depend on how contexts are batched into calls or split over ranks.
        timeout: seconds the grader may spend on one answer.
    """

    def __init__(
        self,
        generator: Generator,
        num_samples: int = 1,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        template: str = DEFAULT_TEMPLATE,
        seed: int = 0,
        timeout: float = 1.0,
        name: str = "target",
    ):
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        if temperature == 0.0 and num_samples > 1:
            raise ValueError(f"num_samples={num_samples} greedy completions would all be the same; "
                             "use temperature > 0 or num_samples=1")
        self.generator, self.num_samples = generator, num_samples
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.template, self.seed, self.timeout, self.name = resolve_template(template), seed, timeout, name

    def prompts(self, contexts: Sequence[StepContext]) -> list[str]:
        """The target's input: the problem in its template, then the policy's steps as the prefix, the
        last one as written (no delimiter after it: a prefix cut by its token budget is continued where
        it stops, and a complete step is followed by whatever the target writes next)."""
        return [format_prompt(c.problem.problem, self.template) + STEP_DELIMITER.join(c.steps) for c in contexts]

    def seeds(self, contexts: Sequence[StepContext]) -> list[int]:
        """One sampling seed per context [B]: (seed, group id, prefix, order among identical ones)."""
        seen: Counter[tuple[int, str]] = Counter()
        seeds = []
        for context in contexts:
            prefix = join_steps(context.steps)
            order = seen[context.group_id, prefix]
            seen[context.group_id, prefix] += 1
            digest = int.from_bytes(hashlib.blake2b(prefix.encode(), digest_size=8).digest(), "little")
            seeds.append(mix_seed(self.seed, context.group_id, digest, order))
        return seeds

    def solve_rates(self, contexts: Sequence[StepContext]) -> np.ndarray:
        """Fraction [B] of the target's completions of each context that verify against its gold answer."""
        output = self.generator.generate(
            self.prompts(contexts), n=self.num_samples, max_new_tokens=self.max_new_tokens,
            temperature=self.temperature, seed=self.seeds(contexts),
        )
        m = self.num_samples
        # The answer may sit in the prefix itself (the policy finished) or in the target's completion.
        answers = [extract_answer(STEP_DELIMITER.join(contexts[k // m].steps) + text)
                   for k, text in enumerate(output.texts)]
        verdicts = grade_batch(answers, [contexts[k // m].problem.answer for k in range(len(answers))],
                               timeout=self.timeout)
        return np.asarray(verdicts, dtype=np.float64).reshape(len(contexts), m).mean(axis=1)

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Reward [B]: the solve rate for finished contexts (one batched generate), 0 for the others."""
        rewards = np.zeros(len(contexts), dtype=np.float64)
        finished = [i for i, c in enumerate(contexts) if c.done]
        if finished:
            rewards[finished] = self.solve_rates([contexts[i] for i in finished])
        return RewardOutput(rewards=rewards, sources={self.name: rewards})
