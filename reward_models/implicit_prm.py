"""PRIME's implicit PRM: token rewards r_t = beta * (log pi_psi(y_t | y_<t) - log pi_ref(y_t | y_<t)),
learned online from outcome labels alone (Cui et al., arXiv 2502.01456).

The PRM is a causal LM (the SFT policy by default) trained as an outcome model: the sequence score
sigmoid(beta * sum_t log(pi_psi / pi_ref)) is fitted to the verified labels with cross-entropy after
each rollout batch (``update``); its token log-ratios are then dense process rewards. pi_ref is the
PRM's own starting weights, frozen.

Granularity (PRIME's ``prime_granularity``, PURE's steps): ``token`` pays a reward per token, ``whole`` the response's
sum at its last token, ``step`` each step's sum at the step's last token, where a step ends at a blank line ("\n\n",
the separator PURE prompts for and splits at) and at the response's end.
Credit (PURE, Cheng et al. 2025, arXiv 2504.15275): ``sum_form`` pays each reward as it is, so a response's
process return is their sum and grows with its length wherever its rewards lie above its group's; ``min_form``
weights each response's rewards by softmax(-r / T) over its reward positions, so the return is a weighted mean
near the lowest one, bounded by the rewards' range whatever the length. Norm (PRIME's ``prime_norm``):
``batch_norm`` divides a batch's rewards by the largest |return-to-go| among them, so that the process stream's
returns lie in [-1, 1] like the verified outcome's whatever beta and the PRM's drift are; ``none`` keeps
beta * log-ratio.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from envs.modes import ImplicitPrmGranularity, PrimeNorm, ProcessCredit, member_of
from models.packing import TokenBatch, right_padded, token_lengths
from models.policy import LanguagePolicy


class ImplicitPRM:
    """The implicit PRM of the module docstring. The trainer decides when it learns (it calls
    ``update``, or ``accumulate`` per micro-batch then ``step``); the checkpoint saves ``model`` and ``optimizer``.

    Args:
        model: the causal LM it starts from (psi; its starting weights are the frozen reference), e.g.
            ``LanguagePolicy(model_dir, device="cpu")``.
        beta: the scale of the log-ratio, in the rewards and in the outcome loss.
        granularity, norm: see the module docstring.
        lr: AdamW learning rate of ``update`` (no weight decay, as PRIME's reward-model optimizer: a decay would
            pull psi towards zero, not towards pi_ref, and move every log-ratio with no outcome behind it).
        grad_clip: the gradient norm each step is clipped to (PRIME's run script: 10).
        credit, min_form_temperature: see the module docstring (PURE's T: 0.1).
    """

    def __init__(
        self,
        model: LanguagePolicy,
        beta: float = 0.05,
        granularity: ImplicitPrmGranularity = ImplicitPrmGranularity.TOKEN,
        lr: float = 1e-6,
        grad_clip: float = 10.0,
        norm: PrimeNorm = PrimeNorm.BATCH_NORM,
        credit: ProcessCredit = ProcessCredit.SUM_FORM,
        min_form_temperature: float = 0.1,
    ):
        self.granularity = member_of(tuple(ImplicitPrmGranularity), granularity, "implicit PRM granularity")
        self.norm = member_of(tuple(PrimeNorm), norm, "implicit PRM norm")
        self.credit = member_of(tuple(ProcessCredit), credit, "implicit PRM credit")
        if min_form_temperature <= 0:
            raise ValueError(f"min_form_temperature={min_form_temperature} must be > 0 (PURE's: 0.1)")
        self.min_form_temperature = min_form_temperature
        if beta <= 0:
            raise ValueError(f"implicit PRM beta={beta} must be > 0")
        if grad_clip <= 0:
            raise ValueError(f"implicit PRM grad_clip={grad_clip} must be > 0 (PRIME's run script clips at 10)")
        self.beta, self.grad_clip = beta, grad_clip
        self.model = model
        self.optimizer = torch.optim.AdamW(self.model.actor_parameters(), lr=lr, weight_decay=0.0,
                                           fused=True)  # fused: no temporaries

    @functools.cached_property
    def blank_lines(self) -> BlankLines:
        """Where the model's tokenizer ends blank lines (``step`` granularity's step ends); found on first use."""
        return BlankLines.of(self.model.tokenizer)

    @torch.no_grad()
    def reference_log_probs(self, prompts: TokenBatch, actions: TokenBatch) -> torch.Tensor:
        """[B, L] log pi_ref of the actions, 0 past each one's end. pi_ref is frozen, so a batch's are computed once
        and passed to ``update`` and ``token_rewards`` (each computes them itself when not given)."""
        if not token_lengths(actions):
            return torch.zeros(0, 0)
        return self.model.ref_log_probs(prompts, actions)

    def log_ratios(self, prompts: TokenBatch, actions: TokenBatch,
                   ref_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi_psi - log pi_ref [B, L] with grad through psi, action mask [B, L]); ``ref_log_probs`` [B, L]:
        ``reference_log_probs`` of the same rows, computed here when None."""
        scores = self.model.score_actions(prompts, actions, with_entropy=False)
        if ref_log_probs is None:
            ref_log_probs = self.reference_log_probs(prompts, actions)
        mask = scores.mask.to(scores.log_probs.dtype)
        return (scores.log_probs - ref_log_probs.to(scores.log_probs.device)) * mask, scores.mask

    @torch.no_grad()
    def token_rewards(self, prompts: TokenBatch, actions: TokenBatch, batch_max: Callable[[float], float] = float,
                      ref_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(process rewards [B, L], outcome scores [B]). The rewards: beta * log-ratio per token, or summed over
        the response or each of its steps (``granularity``), weighted by ``credit``, scaled by ``norm``;
        ``batch_max`` takes this process's largest |return-to-go| to the batch's (under data parallelism: the
        maximum over every process, which each process joins, with no rows too). The outcome scores: beta * sum_t
        log-ratio, its prediction of each action's outcome (> 0: right), read off the same pass.
        ``ref_log_probs``: as ``log_ratios``."""
        if not token_lengths(actions):
            rewards, mask = torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.bool)
        else:
            log_ratio, mask = self.log_ratios(prompts, actions, ref_log_probs)
            rewards = self.beta * log_ratio
        scores = rewards.sum(-1)
        if self.granularity is not ImplicitPrmGranularity.TOKEN:
            step_ends = _run_ends(mask)
            if self.granularity is ImplicitPrmGranularity.STEP and mask.numel():
                ids = right_padded(actions, mask.device)[0][:, :mask.shape[1]]
                step_ends |= self.blank_lines.step_ends(ids, mask)
            rewards, mask = _sum_per_step(rewards, step_ends), step_ends
        if self.credit is ProcessCredit.MIN_FORM:
            rewards = min_form(rewards, mask, self.min_form_temperature)
        if self.norm is PrimeNorm.BATCH_NORM:
            returns_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
            largest = float(returns_to_go.abs().max()) if rewards.numel() else 0.0
            rewards = rewards / (batch_max(largest) + 1e-6)
        return rewards, scores

    @torch.no_grad()
    def outcome_scores(self, prompts: TokenBatch, actions: TokenBatch) -> torch.Tensor:
        """[B] its prediction of each action's outcome, beta * sum_t log-ratio (> 0: right)."""
        if not token_lengths(actions):
            return torch.zeros(0)
        return self.beta * self.log_ratios(prompts, actions)[0].sum(-1)

    def update(self, prompts: TokenBatch, actions: TokenBatch, labels: torch.Tensor, total: int | None = None,
               sum_gradients: Callable[[list[torch.Tensor]], None] | None = None,
               ref_log_probs: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
        """One optimizer step on one batch: ``accumulate`` then ``step``. Returns ``accumulate``'s (loss, scores);
        ``total`` defaults to B."""
        loss, scores = self.accumulate(prompts, actions, labels, len(labels) if total is None else total,
                                       ref_log_probs)
        self.step(sum_gradients)
        return loss, scores

    def accumulate(self, prompts: TokenBatch, actions: TokenBatch, labels: torch.Tensor, total: int,
                   ref_log_probs: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
        """Adds to the gradients BCE(sigmoid(beta * sum_t log-ratio), labels [B] in {0, 1}) summed over these
        rows and divided by ``total`` (the samples of the whole step, over every micro-batch and process), so
        that micro-batches add up to the step's mean. Returns (that loss, the outcome scores [B] it was taken
        at: before the step, its predictions of outcomes it has not trained on, as PRIME's code reads its
        accuracy before the update). ``ref_log_probs``: as ``log_ratios``."""
        if not len(labels):
            return 0.0, torch.zeros(0)
        log_ratio, _ = self.log_ratios(prompts, actions, ref_log_probs)
        logits = self.beta * log_ratio.sum(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits), reduction="sum") / total
        loss.backward()
        return float(loss.detach()), logits.detach()

    def step(self, sum_gradients: Callable[[list[torch.Tensor]], None] | None = None) -> float:
        """The optimizer step on the accumulated gradients, their norm clipped to ``grad_clip``; returns that norm
        before the clip.

        Data parallelism: ``sum_gradients`` adds the gradients (in place) over the processes before the step; a
        process with no samples joins with zero gradients."""
        parameters = list(self.model.actor_parameters())
        if sum_gradients is not None:
            for param in parameters:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            sum_gradients([param.grad for param in parameters])
        grad_norm = torch.nn.utils.clip_grad_norm_([param for param in parameters if param.grad is not None],
                                                   self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # a model's worth, not held between updates
        return float(grad_norm)


def min_form(rewards: torch.Tensor, positions: torch.Tensor, temperature: float) -> torch.Tensor:
    """PURE's min-form credit: [B, L] ``rewards`` times w = softmax(-rewards / temperature) over each row's reward
    ``positions`` [B, L] (0 elsewhere), so that a row's sum is a weighted mean of its rewards, near their minimum as
    the temperature falls and their plain mean as it grows."""
    logits = (-rewards / temperature).masked_fill(~positions, -torch.inf)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row without positions: all weights 0
    return weights * rewards


@dataclass(frozen=True)
class BlankLines:
    """Where a tokenizer's tokens end a blank line ("\n\n"): ``ending`` [V1] the ids whose text ends with one
    (PURE's step separators), ``lone`` [V2] those whose text is a lone "\n", which ends one after a token of
    ``ending_line`` [V3] (the ids whose text ends with "\n"): SmolLM2's tokenizer writes ".\n\n" in running text
    as ".", "\n", "\n"."""

    ending: torch.Tensor
    lone: torch.Tensor
    ending_line: torch.Tensor

    @classmethod
    def of(cls, tokenizer) -> BlankLines:
        texts = tokenizer.batch_decode([[token] for token in range(len(tokenizer))])

        def ids(keep: Callable[[str], bool]) -> torch.Tensor:
            return torch.tensor([token for token, text in enumerate(texts) if keep(text)], dtype=torch.long)

        return cls(ids(lambda text: text.endswith("\n\n")), ids(lambda text: text == "\n"),
                   ids(lambda text: text.endswith("\n")))

    def step_ends(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, L] True at each blank line's last token in the ``mask``ed [B, L] action ``ids``: where the text so
        far ends with "\n\n" and the next token does not go on with another line break (a run of them ends one
        step)."""
        previous = torch.cat([torch.full_like(ids[:, :1], -1), ids[:, :-1]], dim=1)
        blank = (torch.isin(ids, self.ending.to(ids.device))
                 | torch.isin(ids, self.lone.to(ids.device)) & torch.isin(previous, self.ending_line.to(ids.device)))
        return _run_ends(blank & mask)


def _run_ends(mask: torch.Tensor) -> torch.Tensor:
    """[B, L] True at the last position of each run of True in the [B, L] ``mask`` (of a right-padded token mask:
    each row's last token)."""
    return mask & ~torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)


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
