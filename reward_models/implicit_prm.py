"""PRIME's implicit PRM: token rewards r_t = beta * (log pi_psi(y_t | y_<t) - log pi_ref(y_t | y_<t)),
learned online from outcome labels alone (Cui et al., arXiv 2502.01456).

The PRM is a causal LM (the SFT policy by default) trained as an outcome model: the sequence score
sigmoid(beta * sum_t log(pi_psi / pi_ref)) is fitted to the verified labels with cross-entropy after
each rollout batch (``update``); its token log-ratios are then dense process rewards. pi_ref is the
PRM's own starting weights, frozen.

Granularity: ``token`` (a reward per token) or ``step`` (the sum over a step, paid at its last
token). ``normalize=True`` divides the batch's token rewards by the std of the per-response totals
(a scale-free process stream whatever beta is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from models.packing import TokenBatch
from models.policy import LanguagePolicy, LoraSettings

GRANULARITIES = ("token", "step")


class ImplicitPRM:
    """The implicit PRM of the module docstring. The trainer decides when it learns (it calls
    ``update``); the checkpoint saves ``model`` and ``optimizer``.

    Args:
        model_dir: the Hugging Face causal LM it starts from (psi and the frozen reference).
        beta: the scale of the log-ratio, in the rewards and in the outcome loss.
        granularity, normalize: see the module docstring.
        lr: AdamW learning rate of ``update``.
        device, dtype, lora: as for ``LanguagePolicy``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        beta: float = 0.05,
        granularity: str = "token",
        lr: float = 1e-6,
        normalize: bool = False,
        device: str = "auto",
        dtype: str = "float32",
        lora: LoraSettings | None = None,
    ):
        if granularity not in GRANULARITIES:
            raise ValueError(f"implicit PRM granularity={granularity!r} must be one of {GRANULARITIES}")
        if beta <= 0:
            raise ValueError(f"implicit PRM beta={beta} must be > 0")
        self.beta, self.granularity, self.normalize = beta, granularity, normalize
        self.model = LanguagePolicy(model_dir, device=device, dtype=dtype, lora=lora)
        self.optimizer = torch.optim.AdamW(self.model.actor_parameters(), lr=lr, fused=True)  # no temporaries

    def log_ratios(self, prompts: TokenBatch, actions: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi_psi - log pi_ref [B, L] with grad through psi, action mask [B, L])."""
        scores = self.model.score_actions(prompts, actions, with_entropy=False)
        ref_logprobs = self.model.ref_log_probs(prompts, actions)
        mask = scores.mask.to(scores.logprobs.dtype)
        return (scores.logprobs - ref_logprobs.to(scores.logprobs.device)) * mask, scores.mask

    @torch.no_grad()
    def token_rewards(self, prompts: TokenBatch, actions: TokenBatch,
                      step_ends: torch.Tensor | None = None) -> torch.Tensor:
        """Process rewards [B, L]: beta * log-ratio per token, or per step (summed over each step and
        paid at the step's last token; ``step_ends`` [B, L] marks those tokens, default: each
        action is one step)."""
        log_ratio, mask = self.log_ratios(prompts, actions)
        rewards = self.beta * log_ratio
        if self.granularity == "step":
            if step_ends is None:
                step_ends = mask & ~torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
            rewards = _sum_per_step(rewards, step_ends.to(mask.device))
        if self.normalize:
            totals = rewards.sum(-1)
            rewards = rewards / (totals.std() + 1e-8) if len(totals) > 1 else rewards
        return rewards

    def update(self, prompts: TokenBatch, actions: TokenBatch, labels: torch.Tensor, total: int | None = None,
               sum_gradients: Callable[[list[torch.Tensor]], None] | None = None) -> float:
        """One optimizer step of BCE(sigmoid(beta * sum_t log-ratio), labels [B] in {0, 1}); returns this
        batch's summed loss divided by ``total``.

        Data parallelism: ``total`` is the number of samples over every process (default B), so each
        process's loss is its share of the mean, and ``sum_gradients`` adds the gradients (in place)
        over the processes before the step; a process with no samples joins with zero gradients."""
        total = len(labels) if total is None else total
        loss = torch.zeros(())
        if len(labels):
            log_ratio, _ = self.log_ratios(prompts, actions)
            logits = self.beta * log_ratio.sum(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits),
                                                                        reduction="sum") / total
            loss.backward()
        if sum_gradients is not None:
            for param in self.model.actor_parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            sum_gradients([param.grad for param in self.model.actor_parameters()])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # a model's worth, not held between updates
        return float(loss.detach())


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
