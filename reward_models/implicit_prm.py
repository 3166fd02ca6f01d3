"""PRIME's implicit PRM: token rewards r_t = beta * (log pi_psi(y_t | y_<t) - log pi_ref(y_t | y_<t)),
learned online from outcome labels alone (Cui et al., arXiv 2502.01456).

The PRM is a causal LM (the SFT policy by default) trained as an outcome model: the sequence score
sigmoid(beta * sum_t log(pi_psi / pi_ref)) is fitted to the verified labels with cross-entropy after
each rollout batch (``update``); its token log-ratios are then dense process rewards.

Reference (``reference``): ``freeze`` keeps a frozen copy of the starting weights; ``policy`` uses the
current policy's log-probs, which the caller passes in (the behaviour log-probs of the rollout,
so no extra forward pass). Granularity: ``token`` (a reward per token) or ``step`` (the sum over a
step, paid at its last token). ``normalize=True`` divides the batch's token rewards by the std of
the per-response totals (a scale-free process stream whatever beta is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from envs.prompts import DEFAULT_TEMPLATE, format_prompt, join_steps
from envs.rewards import RewardOutput, StepContext
from train.models.policy import LanguagePolicy, LoraSettings, TokenBatch

REFERENCES = ("freeze", "policy")
GRANULARITIES = ("token", "step")


class ImplicitPRM:
    """See the module docstring. ``update_when`` ("after" or "before" the policy update) is read by
    the trainer, which calls ``update``; this class never decides when it is trained."""

    def __init__(
        self,
        model_dir: str | Path,
        beta: float = 0.05,
        reference: str = "freeze",
        granularity: str = "token",
        lr: float = 1e-6,
        normalize: bool = False,
        update_when: str = "after",
        device: str = "auto",
        dtype: str = "float32",
        lora: LoraSettings | None = None,
        template: str = DEFAULT_TEMPLATE,
        name: str = "implicit_prm",
    ):
        for value, allowed, what in ((reference, REFERENCES, "reference"), (granularity, GRANULARITIES, "granularity"),
                                     (update_when, ("after", "before"), "update_when")):
            if value not in allowed:
                raise ValueError(f"implicit PRM {what}={value!r} must be one of {allowed}")
        if beta <= 0:
            raise ValueError(f"implicit PRM beta={beta} must be > 0")
        self.beta, self.reference, self.granularity, self.normalize = beta, reference, granularity, normalize
        self.update_when, self.template, self.name = update_when, template, name
        self.model = LanguagePolicy(model_dir, device=device, dtype=dtype, lora=lora)
        self.optimizer = torch.optim.AdamW(self.model.actor_parameters(), lr=lr)

    def log_ratios(self, prompts: TokenBatch, actions: TokenBatch,
                   ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi_psi - log pi_ref [B, L] with grad through psi, action mask [B, L])."""
        scores = self.model.evaluate(prompts, actions, with_entropy=False)
        if self.reference == "freeze":
            ref_logprobs = self.model.ref_log_probs(prompts, actions)
        elif ref_logprobs is None:
            raise ValueError("reference='policy' needs ref_logprobs= (the policy's log-probs of the actions)")
        mask = scores.mask.to(scores.logprobs.dtype)
        return (scores.logprobs - ref_logprobs.to(scores.logprobs.device)) * mask, scores.mask

    @torch.no_grad()
    def token_rewards(self, prompts: TokenBatch, actions: TokenBatch, ref_logprobs: torch.Tensor | None = None,
                      step_ends: torch.Tensor | None = None) -> torch.Tensor:
        """Process rewards [B, L]: beta * log-ratio per token, or per step (summed over each step and
        paid at the step's last token; ``step_ends`` [B, L] marks those tokens, default: each
        action is one step)."""
        log_ratio, mask = self.log_ratios(prompts, actions, ref_logprobs)
        rewards = self.beta * log_ratio
        if self.granularity == "step":
            if step_ends is None:
                step_ends = mask & ~torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
            rewards = _sum_per_step(rewards, step_ends.to(mask.device))
        if self.normalize:
            totals = rewards.sum(-1)
            rewards = rewards / (totals.std() + 1e-8) if len(totals) > 1 else rewards
        return rewards

    def update(self, prompts: TokenBatch, actions: TokenBatch, labels: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None) -> float:
        """One optimizer step of BCE(sigmoid(beta * sum_t log-ratio), labels [B] in {0, 1}); returns the loss."""
        log_ratio, _ = self.log_ratios(prompts, actions, ref_logprobs)
        logits = self.beta * log_ratio.sum(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Env protocol: the new step (re-tokenized with the PRM's tokenizer) scored given the
        problem and the previous steps; reward = the step's summed process reward, token rewards kept."""
        tokenizer = self.model.tokenizer
        prompts = [tokenizer.encode(format_prompt(c.problem.problem, self.template) + join_steps(c.previous_steps))
                   for c in contexts]
        actions = [tokenizer.encode(c.new_step, add_special_tokens=False) for c in contexts]
        rewards = self.token_rewards(prompts, actions).cpu().numpy().astype(np.float64)
        lengths = [len(a) for a in actions]
        per_step = rewards.sum(-1)
        return RewardOutput(rewards=per_step, token_rewards=[rewards[b, :n] for b, n in enumerate(lengths)],
                            components={self.name: per_step})


def _sum_per_step(rewards: torch.Tensor, step_ends: torch.Tensor) -> torch.Tensor:
    """[B, L] token rewards -> each step's sum at its last token (``step_ends`` [B, L] True), 0 elsewhere.

    A step's sum is the running total at its end minus the running total at the previous step's end.
    """
    running = rewards.cumsum(-1)
    positions = torch.arange(rewards.shape[-1], device=rewards.device).expand_as(rewards)
    last_end = torch.cummax(torch.where(step_ends, positions, torch.full_like(positions, -1)), dim=-1).values
    previous_end = torch.cat([torch.full_like(last_end[:, :1], -1), last_end[:, :-1]], dim=-1)
    previous_total = torch.where(previous_end >= 0, running.gather(-1, previous_end.clamp(min=0)),
                                 torch.zeros_like(running))
    return torch.where(step_ends, running - previous_total, torch.zeros_like(running))
