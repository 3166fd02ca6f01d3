"""A team of models that learn together: the policy, which speaks for the roles that share it (each with its
prompt, or its LoRA adapter), and members, roles on base models of their own (PettingLLMs' ``base_models``).

A row of a batch is scored by its voice (``voices`` [B]): a member's role name sends it to that member's model,
anything else (a role adapter of the policy, or None) to the policy. Each model scores its own rows in passes of
its own, with its own tokenizer's ids (what its generator recorded), and the rows come back in batch order as one
``ActionScores``: one loss over the whole batch, whose gradient reaches each model through its own rows only.
Without members the team is the policy. Under DDP the team is the wrapped module, so the rows a rank holds may
leave a member unused there (DDP's ``find_unused_parameters`` counts it in).

Shapes: ``B`` rows, ``L`` action tokens (the longest action of the batch).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from models.packing import TokenBatch, take, token_lengths
from models.policy import LanguagePolicy
from models.scoring import ActionScores, interleave_rows


class Team(nn.Module):
    """``policy`` and ``members`` ({role: its own LanguagePolicy}); see the module docstring."""

    def __init__(self, policy: LanguagePolicy, members: Mapping[str, LanguagePolicy] | None = None) -> None:
        super().__init__()
        clash = sorted(set(members or {}) & set(policy.role_adapters))
        if clash:
            raise ValueError(f"roles {clash} have a role adapter on the policy and a model of their own; give each "
                             "role one of the two")
        self.policy = policy
        self.members = nn.ModuleDict(dict(members or {}))
        self.train(policy.training)  # the policy's mode, which module_mode restores after the update

    @property
    def tokenizer(self):
        """The policy's tokenizer (a member's own is ``members[role].tokenizer``)."""
        return self.policy.tokenizer

    @property
    def sharded(self) -> bool:
        return self.policy.sharded

    def gathered(self) -> contextlib.AbstractContextManager:
        """The policy's whole weights in the enclosed code (``LanguagePolicy.gathered``; members are never
        sharded)."""
        return self.policy.gathered()

    def passes(self, voices: Sequence[str | None] | None, size: int
               ) -> Iterator[tuple[nn.Module, list[int], list[str | None] | None]]:
        """(the model, its rows, their policy adapters or None) for each model that scores some of ``size`` rows."""
        voices = list(voices) if voices is not None else [None] * size
        models = [voice if voice in self.members else None for voice in voices]  # None: the policy
        for model_name in dict.fromkeys(models):
            rows = [row for row, model in enumerate(models) if model == model_name]
            if model_name is not None:
                yield self.members[model_name], rows, None
            else:
                adapters = [voices[row] for row in rows]
                yield self.policy, rows, adapters if any(adapters) else None

    def forward(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0, *,
                with_entropy: bool = True, with_values: bool = False,
                adapters: Sequence[str | None] | None = None, critic_prompts: TokenBatch | None = None,
                value_heads: Sequence[int] | None = None) -> ActionScores:
        """``LanguagePolicy.forward``'s scores of every row, each by its voice (``adapters`` [B]: a member's role,
        a role adapter of the policy, or None). Members have no critic: values come from the policy alone."""
        if not self.members:
            return self.policy(prompts, actions, temperature, with_entropy=with_entropy, with_values=with_values,
                               adapters=adapters, critic_prompts=critic_prompts, value_heads=value_heads)
        if with_values:
            raise ValueError("a team with members has no critic: train it with a critic-free algorithm")
        size = len(token_lengths(prompts))
        parts = [(rows, model(take(prompts, rows), take(actions, rows), temperature, with_entropy=with_entropy,
                              adapters=row_adapters))
                 for model, rows, row_adapters in self.passes(adapters, size)]
        return ActionScores.interleave(parts, size)

    def score_actions(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0, *,
                      with_entropy: bool = True, adapters: Sequence[str | None] | None = None) -> ActionScores:
        """``forward``'s scores of the actions (no values)."""
        return self(prompts, actions, temperature, with_entropy=with_entropy, adapters=adapters)

    @torch.no_grad()
    def ref_log_probs(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0,
                      adapters: Sequence[str | None] | None = None) -> torch.Tensor:
        """``[B, L]`` log-probs under each row's reference: its model's starting weights (the policy's base for
        every role adapter of the policy); 0 past each action's end."""
        size = len(token_lengths(prompts))
        parts = [(rows, model.ref_log_probs(take(prompts, rows), take(actions, rows), temperature))
                 for model, rows, _ in self.passes(adapters, size)]
        return parts[0][1] if len(parts) == 1 else interleave_rows(parts, size)
