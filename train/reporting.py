"""What a run shows while it trains: rank 0's TensorBoard scalars, histograms and sampled solutions, the
evaluation lines of the log, and the progress bar's short summary. Every other rank reports nothing."""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import torch
from tqdm import tqdm

from algorithms.buffer import RolloutBuffer
from train.distributed import Ranks

log = logging.getLogger(__name__)

EXTRA_EVAL_METRICS = (("readable", "readable"), ("prm_score", "PRM score"))
"""Evaluation metrics an evaluation's log line adds where present: (key after the set's prefix, label); the
sampled ones (pass_at_k, maj_at_k, mean_at_n) follow."""


class Reporter:
    """Rank 0's writer (a tensorboardX SummaryWriter; None on the other ranks) and what it is shown.
    ``roles``: the agent slots' role names of a multi-agent env (None: one agent); ``tokenizer`` decodes the
    prompts, ``slot_tokenizers`` {agent slot: tokenizer} those of slots whose model has a tokenizer of its own."""

    def __init__(self, writer, ranks: Ranks, tokenizer, roles: Sequence[str] | None, num_text_samples: int,
                 slot_tokenizers: Mapping[int, Any] | None = None):
        self.writer, self.ranks, self.tokenizer, self.roles = writer, ranks, tokenizer, roles
        self.slot_tokenizers = dict(slot_tokenizers or {})
        self.num_text_samples = num_text_samples
        self.last_buffer: RolloutBuffer | None = None  # for the text panel of sampled solutions

    def progress_bar(self, start: int, total: int, name: str) -> tqdm:
        """The iterations' bar (rank 0 only)."""
        return tqdm(range(start, total), initial=start, total=total, desc=name, dynamic_ncols=True,
                    disable=not self.ranks.is_main)

    def log_iteration(self, iteration: int, buffer: RolloutBuffer, stats: dict[str, Any],
                      counts: dict[str, int]) -> None:
        """TensorBoard scalars and histograms (rank 0's own rollout, for the histograms and samples); ``counts``
        ({name: count so far}, e.g. env_steps) as ``train/<name>``."""
        if not self.ranks.is_main:
            return
        self.last_buffer = buffer
        histograms = stats.pop("histograms", {})
        for key, values in histograms.items():
            values = values.detach().float().cpu()
            if values.numel() > 1:
                self.writer.add_histogram(f"hist/{key}", values.numpy(), iteration)
            if values.numel():
                self.writer.add_scalar(f"train/{key}_mean", float(values.mean()), iteration)
        for key, value in stats.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, iteration)
        for name, count in counts.items():
            self.writer.add_scalar(f"train/{name}", count, iteration)

    def log_evaluation(self, iteration: int, result: dict[str, float], env_steps: int,
                       num_problems: dict[str | None, int]) -> None:
        """An evaluation's scalars, a log line per held-out set (``num_problems``: {set name, None for the
        unnamed one: its problems evaluated}) and the last rollout's sampled solutions."""
        self.log_scalars(iteration, result)
        if not self.ranks.is_main:
            return
        for name, count in num_problems.items():
            prefix = "eval/" if name is None else f"eval/{name}/"
            extras = [(label, result[prefix + key]) for key, label in EXTRA_EVAL_METRICS if prefix + key in result]
            extras += [(key[len(prefix):], value) for key, value in result.items()
                       if key.startswith(prefix) and "_at_" in key and "/" not in key[len(prefix):]]
            extras = "".join(f", {label} {value:.3f}" for label, value in extras)
            log.info("eval iteration %d (%d env steps)%s: greedy accuracy %.3f on %d problems, mean length %.1f "
                     "tokens%s", iteration, env_steps, "" if name is None else f" {name}", result[prefix + "accuracy"],
                     count, result[prefix + "mean_length"], extras)
        if self.last_buffer is not None:
            self.writer.add_text("samples", self.samples_markdown(self.last_buffer), iteration)

    def log_scalars(self, iteration: int, values: dict[str, float]) -> None:
        if self.ranks.is_main:
            for key, value in values.items():
                self.writer.add_scalar(key, value, iteration)

    def samples_markdown(self, buffer: RolloutBuffer) -> str:
        """A few sampled episodes of the last rollout: each action with its reward (and, in a multi-agent
        env, the role that took it: the whole transcript)."""
        lines = []
        for env_index in range(min(self.num_text_samples, buffer.shape[1])):
            acted = buffer.live[:, env_index].nonzero().tolist()  # [(step, agent)] in turn order
            if not acted:
                continue
            first = int(buffer.slot_index(acted[0][0], torch.tensor(env_index), torch.tensor(acted[0][1])))
            tokenizer = self.slot_tokenizers.get(acted[0][1], self.tokenizer)
            prompt = tokenizer.decode(buffer.prompt_ids[first], skip_special_tokens=True)
            lines.append(f"**env {env_index}** (group {int(buffer.group_ids[acted[0][0], env_index, acted[0][1]])})\n\n"
                         f"    {prompt.strip()}\n")
            for t, agent in acted:
                slot = int(buffer.slot_index(t, torch.tensor(env_index), torch.tensor(agent)))
                reward = float(buffer.rewards[t, env_index, agent])
                verdict = buffer.correct[t, env_index, agent]
                end = "" if torch.isnan(verdict) else f" (episode end, correct={bool(verdict)})"
                text = (buffer.texts[slot] or "").strip().replace("\n", " ")
                who = f" {self.roles[agent]}" if self.roles else ""
                lines.append(f"- step {t}{who}: `{text}` → reward {reward:.3f}{end}")
            lines.append("")
        return "\n".join(lines)


def bar_summary(stats: dict[str, Any], roles: Sequence[str] | None) -> dict[str, str]:
    """The progress bar's reward and training accuracy. A multi-agent env's episode return adds every
    role's rewards, so the bar shows each role's own mean return instead (``<role>_reward``)."""
    if not roles:
        rewards = {"reward": stats["train/reward"]}
    else:
        rewards = {f"{role}_reward": stats.get(f"train/{role}/reward", math.nan) for role in roles}
    return {**{key: f"{value:.3f}" for key, value in rewards.items()}, "train_acc": f"{stats['train/accuracy']:.3f}"}


def write_out(writer) -> None:
    """Every event logged to ``writer`` (a tensorboardX SummaryWriter) so far is in its file when this returns.

    tensorboardX's ``flush()`` flushes the file but not the events still queued for its writer thread,
    so a kill just after a checkpoint could lose the points logged just before it. Stopping the thread
    drains the queue in order; ``reopen`` starts a new one on the same queue and file (tensorboardX 2.x
    internals; tests/test_checkpoint.py reads the file back to check)."""
    events = writer.file_writer.event_writer
    events._worker.stop()
    events._closed = True
    events.reopen()
    events.flush()
