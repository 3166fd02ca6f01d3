"""The tiny build's training: SFT of the policy and the target, and the likelihood PRM on the target.

The policy is fine-tuned from scratch on Arith reference solutions (loss on solution tokens and
eos). Learning comes as a sudden jump rather than gradually, so greedy validation accuracy is
checked every ``eval_every`` steps once it starts and the checkpoint nearest
``policy_target_accuracy`` is kept, leaving room for RL. The same run continued with a decaying lr
gives the target, Prefix-RL's frozen solver. The PRM is ``models.tiny.likelihood_prm`` written on a
copy of the target whose trunk has learned the Math-Shepherd step format; only its margin and
readout are fitted, on corrupted solutions.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from envs.datasets import Problem
from models.tiny import likelihood_prm
from models.tiny.config import TinyConfig
from models.tiny.data import PRM_ANCHOR, corrupt_solution, departure_tokens, label_token_ids, prm_batch, sft_batch
from models.tiny.evaluation import arith_accuracy, prm_step_scores

log = logging.getLogger(__name__)


def sft_loss(model: LlamaForCausalLM, ids: torch.Tensor,
             target_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy over the solution tokens, and exact [B]: whether every
    solution token was the argmax (free: the batch is fresh problems, so it is a held-out
    estimate of greedy accuracy). Right padding needs no attention mask: causal attention never
    lets a real token see the pads after it."""
    logits = model(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    exact = ((logits.detach().argmax(-1) == targets) | ~target_mask).all(-1)
    return F.cross_entropy(logits[target_mask], targets[target_mask]), exact


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, lr: float) -> None:
    """One clipped optimizer step on ``loss`` at learning rate ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def policy_lr(config: TinyConfig, step: int) -> float:
    """Linear warmup, then a cosine from ``lr`` to ``lr / 10`` at ``lr_decay_steps``: the jump comes
    sooner at a gently falling lr than at a constant one or one that falls early."""
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.lr_decay_steps - config.warmup_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_cosine(peak: float, step: int, steps: int, warmup_steps: int) -> float:
    """The lr at ``step`` (1-based) of ``steps``: linear warmup to ``peak``, then a cosine to 0 at ``steps``
    (a fine-tuning stage that starts from a trained model)."""
    return peak * min(1.0, step / warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / steps))


def train_policy_and_target(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, config: TinyConfig,
                            batches: Iterator[list[Problem]], select: list[Problem], device: str
                            ) -> tuple[dict[str, torch.Tensor], dict]:
    """SFT from scratch. Phase 1 (``policy_lr``) runs until greedy validation accuracy on ``select``
    passes ``policy_target_accuracy``; the checkpoint nearest it within
    [policy_min_accuracy, policy_max_accuracy] becomes the policy. Phase 2 continues for
    ``target_steps`` with the lr decaying from where phase 1 left it to 0 and leaves the target in ``model``.

    Returns (policy state_dict, log of the run)."""
    optimizer = adamw(model, config.lr, config.weight_decay)
    model.train()
    best: tuple[float, int, dict] | None = None  # (validation accuracy, step, state)
    history = []
    recent_exact = []  # per-problem teacher-forced exact match of the last eval_every batches
    step = 0
    for step in range(1, config.max_policy_steps + 1):
        ids, target_mask = sft_batch(tokenizer, next(batches))
        loss, exact = sft_loss(model, ids.to(device), target_mask.to(device))
        train_step(model, optimizer, loss, policy_lr(config, step))
        recent_exact = recent_exact[-(config.eval_every - 1) * config.batch_size:] + exact.tolist()
        if step % config.eval_every:
            continue
        if np.mean(recent_exact) < config.eval_from_exact_match:
            log.info("policy sft step %d loss %.4f teacher-forced exact match %.3f", step, loss.item(),
                     np.mean(recent_exact))
            continue
        accuracy = arith_accuracy(model, tokenizer, select)
        history.append({"step": step, "loss": round(loss.item(), 4), "select_accuracy": accuracy})
        log.info("policy sft step %d loss %.4f validation greedy accuracy %.3f", step, loss.item(), accuracy)
        in_band = config.policy_min_accuracy <= accuracy <= config.policy_max_accuracy
        target = config.policy_target_accuracy
        if in_band and (best is None or abs(accuracy - target) < abs(best[0] - target)):
            best = (accuracy, step, _snapshot(model))
        if accuracy >= config.policy_target_accuracy:
            break
    if best is None:
        raise RuntimeError(
            f"tiny policy SFT found no checkpoint with validation accuracy in [{config.policy_min_accuracy}, "
            f"{config.policy_max_accuracy}] within {step} steps (history: {history[-4:]}); raise "
            f"max_policy_steps={config.max_policy_steps}, lower eval_every={config.eval_every} or try another seed"
        )
    policy_step, last_lr = best[1], policy_lr(config, step)
    for target_step in range(1, config.target_steps + 1):
        ids, target_mask = sft_batch(tokenizer, next(batches))
        loss, _ = sft_loss(model, ids.to(device), target_mask.to(device))
        train_step(model, optimizer, loss, last_lr * 0.5 * (1 + math.cos(math.pi * target_step / config.target_steps)))
        if target_step % (4 * config.eval_every) == 0:
            log.info("target sft step %d loss %.4f", step + target_step, loss.item())
    return best[2], {"policy_step": policy_step, "policy_select_accuracy": best[0], "last_policy_phase_step": step,
                     "target_steps": config.target_steps, "history": history}


def tune_prm_trunk(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, config: TinyConfig,
                   batches: Iterator[list[Problem]], device: str) -> None:
    """Language-model training of ``model`` in place on reference solutions in Math-Shepherd format
    (the step tags put the target's text out of distribution, which blunts its likelihood as a
    verifier), lr ``prm_lr`` with a warmup and a cosine decay."""
    optimizer = adamw(model, config.prm_lr, config.weight_decay)
    model.train()
    for step in range(1, config.prm_trunk_steps + 1):
        ids, target_mask = sft_batch(tokenizer, next(batches), step_tags=True)
        loss, _ = sft_loss(model, ids.to(device), target_mask.to(device))
        lr = warmup_cosine(config.prm_lr, step, config.prm_trunk_steps, config.warmup_steps)
        train_step(model, optimizer, loss, lr)
        if step % (4 * config.eval_every) == 0:
            log.info("prm trunk step %d loss %.4f", step, loss.item())
    model.eval()


def build_prm(target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, config: TinyConfig,
              batches: Iterator[list[Problem]], seed: int, device: str) -> tuple[LlamaForCausalLM, dict]:
    """The tiny PRM (``models.tiny.likelihood_prm``) on a copy of ``target``: the trunk is tuned on
    tagged reference solutions, then on ``prm_fit_problems`` corrupted solutions the margin is
    picked from ``prm_margins`` (best step accuracy of ``running_max_margin``) and the readout's
    threshold and scale are fitted (``likelihood_prm.fit_readout``). Returns (PRM on the CPU, what was chosen)."""
    trunk = copy.deepcopy(target).to(device)
    tune_prm_trunk(trunk, tokenizer, config, batches, device)
    trunk = trunk.cpu()
    rng = np.random.default_rng(seed)
    num_batches = math.ceil(config.prm_fit_problems / config.batch_size)
    problems = [problem for _ in range(num_batches) for problem in next(batches)]
    checked = departure_tokens(tokenizer, problems, rng)
    anchor = tokenizer.convert_tokens_to_ids(PRM_ANCHOR)
    solutions, labels = zip(*(corrupt_solution(p, rng, config.prm_clean_fraction) for p in problems))
    ids, tag_mask, tag_labels, _ = prm_batch(tokenizer, problems, list(solutions), list(labels))
    with torch.no_grad():
        margins = likelihood_prm.running_max_margin(trunk(input_ids=ids).logits, ids, checked, anchor)[tag_mask]
    accuracy = {margin: float(((margins <= margin).long() == tag_labels).float().mean())
                for margin in config.prm_margins}
    margin = max(accuracy, key=accuracy.get)
    good, bad = label_token_ids(tokenizer).tolist()
    prm = likelihood_prm.build_likelihood_prm(trunk, checked, anchor, good, bad, margin)
    weights = likelihood_prm.fit_readout(likelihood_prm.readout_features(prm, ids)[tag_mask], tag_labels)
    likelihood_prm.set_readout(prm, good, bad, *weights)
    fitted = prm_step_scores(prm, tokenizer, problems, list(solutions))
    log.info("prm fit-set step accuracy %.3f", float(((fitted > 0.5) == tag_labels.numpy()).mean()))
    log.info("prm: %d checked tokens, margin %.1f (fit accuracy by margin %s), readout %s", len(checked), margin,
             {k: round(v, 3) for k, v in accuracy.items()}, weights)
    return prm, {"checked_tokens": tokenizer.convert_ids_to_tokens(checked), "margin": margin,
                 "fit_accuracy_by_margin": accuracy, "readout": weights}
