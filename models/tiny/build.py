"""The tiny build end to end: train the five models, measure them, and cache the result.

A build takes minutes on a CPU, so it is kept and reused, in two stages: the base models (policy,
target, PRM) in a directory named by ``config_hash``, and the team model, fine-tuned from that policy
on a data stream of its own, in ``team-<team_hash>`` inside it, so that a change to the team stage
rebuilds the team alone; the tool model likewise in ``tool-<tool_hash>``. Each stage is written to a
temporary sibling and renamed into place, so a killed build never leaves a partial directory that would
later be taken for a finished one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from envs.datasets import Problem
from envs.prompts import SHEPHERD_STEP_TAG
from models.tiny.config import (TinyConfig, base_knobs, cache_dir, config_hash, team_hash, team_knobs, tool_hash,
                                tool_knobs)
from models.tiny.data import BAD_TOKEN, GOOD_TOKEN, arith_batches, heldout_problems
from models.tiny.evaluation import arith_accuracy, prefix_metrics, prm_last_step_auc, prm_metrics
from models.tiny.model import new_model, num_parameters
from models.tiny.roles import team_metrics, train_team
from models.tiny.tokenizer import build_tokenizer
from models.tiny.tool import tool_metrics, train_tool
from models.tiny.training import build_prm, train_policy_and_target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyModels:
    """Paths of a finished build and the metrics measured on held-out Arith problems."""

    root: Path
    policy: Path
    prm: Path
    target: Path
    team: Path
    tool: Path
    metrics: dict


def team_dir(root: Path, config: TinyConfig) -> Path:
    """Where the team stage of ``config`` lives in the build ``root``."""
    return root / f"team-{team_hash(config)}"


def tool_dir(root: Path, config: TinyConfig) -> Path:
    """Where the tool stage of ``config`` lives in the build ``root``."""
    return root / f"tool-{tool_hash(config)}"


def read_build(root: Path, config: TinyConfig) -> TinyModels:
    """The finished build in ``root``: its paths and metrics; ``metrics["team"]`` and ``metrics["tool"]`` come
    from the team and tool stages' own metrics.json, when those stages have been built."""
    team, tool = team_dir(root, config), tool_dir(root, config)
    metrics = json.loads((root / "metrics.json").read_text())
    for name, stage in (("team", team), ("tool", tool)):
        if (stage / "metrics.json").is_file():
            metrics[name] = json.loads((stage / "metrics.json").read_text())
    return TinyModels(root=root, policy=root / "policy", prm=root / "prm", target=root / "target", team=team,
                      tool=tool, metrics=metrics)


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _problem_draws(config: TinyConfig) -> tuple[list[Problem], list[Problem]]:
    """The held-out evaluation problems and the validation problems that pick the policy checkpoint:
    never trained on."""
    evaluation = heldout_problems(config)
    select = config.arith().problems(config.num_select, seed=config.seed + 2_000_003,
                                     exclude=(p.id for p in evaluation))
    return evaluation, select


def _build_team(root: Path, out_dir: Path, config: TinyConfig, device: str) -> None:
    """The team model (``models.tiny.roles``), fine-tuned from ``root``'s policy on a stream of Arith problems
    of its own, saved to ``out_dir`` with its metrics.json."""
    started = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(root / "policy").to(device)
    tokenizer = AutoTokenizer.from_pretrained(root / "policy")
    evaluation, select = _problem_draws(config)
    batches = arith_batches(config.arith(), config.batch_size, config.seed + 5, {p.id for p in evaluation + select})
    model = train_team(model, tokenizer, config, batches, config.seed + 3, device)
    _save(model, tokenizer, out_dir)
    metrics = {"team_hash": team_hash(config), "config": team_knobs(config),
               **team_metrics(model, tokenizer, evaluation, config.seed + 4),
               "seconds": round(time.perf_counter() - started, 1)}
    log.info("team model: %s", metrics)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))


def _build_tool(root: Path, out_dir: Path, config: TinyConfig, device: str) -> None:
    """The tool model (``models.tiny.tool``), fine-tuned from ``root``'s policy on a stream of Arith problems of
    its own, saved to ``out_dir`` in bfloat16 with its metrics.json (measured on the saved weights)."""
    started = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(root / "policy").to(device)
    tokenizer = AutoTokenizer.from_pretrained(root / "policy")
    evaluation, select = _problem_draws(config)
    batches = arith_batches(config.arith(), config.tool_batch_size, config.seed + 6,
                            {p.id for p in evaluation + select})
    model = train_tool(model, tokenizer, config, batches, device).to(torch.bfloat16)
    _save(model, tokenizer, out_dir)  # bfloat16: half the size in the package; measured as loaded back in fp32
    model = model.float()
    metrics = {"tool_hash": tool_hash(config), "config": tool_knobs(config),
               **tool_metrics(model, tokenizer, evaluation), "seconds": round(time.perf_counter() - started, 1)}
    log.info("tool model: %s", metrics)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))


def _build(out_dir: Path, config: TinyConfig, device: str) -> None:
    """Trains the base models (policy, target, PRM) into ``out_dir``, with their metrics.json."""
    started = time.perf_counter()
    tokenizer = build_tokenizer(config.vocab_size)
    evaluation, select = _problem_draws(config)
    batches = arith_batches(config.arith(), config.batch_size, config.seed, {p.id for p in evaluation + select})
    model = new_model(tokenizer, config.seed, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                      num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
                      intermediate_size=config.intermediate_size).to(device)
    log.info("tiny build: vocab %d, %d parameters, cache key %s", len(tokenizer), num_parameters(model),
             config_hash(config))

    policy_state, sft_log = train_policy_and_target(model, tokenizer, config, batches, select, device)
    _save(model, tokenizer, out_dir / "target")
    target_metrics = prefix_metrics(model, tokenizer, evaluation, config.seed)
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
        "config": base_knobs(config),
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


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_tiny_models(out_dir: str | os.PathLike | None = None, config: TinyConfig = TinyConfig(),
                      device: str = "cpu", threads: int | None = None, team: bool = True,
                      tool: bool = False) -> TinyModels:
    """Builds (or finds already built) the tiny policy, PRM, target, tool and team model for ``config``.

    ``team`` False leaves the team stage out (single-agent runs never read the team model, and the stage
    costs more than the other three models together); the returned ``team`` path then holds a model only
    if an earlier build made it. ``tool`` True builds the tool model too (``models.tiny.tool``; the command
    line builds it by default), likewise.

    ``threads``: torch CPU threads during a build, by default every core this process may use
    (the build expects the machine to itself). The float sums then differ from machine to machine,
    and the SFT's sudden jump with them, so builds match across runs on one machine, not across machines.

    ``out_dir`` None means the user cache (``cache_dir(config)``). A finished build there, or in
    ``out_dir`` with the same config hash, is reused, and so is its team stage if its key matches
    (otherwise only the team is built). Each stage goes to a temporary sibling directory renamed into
    place at the end, so a killed build never leaves a partial one; when two processes race, the
    first rename wins and the other's copy is dropped.
    """
    root = Path(out_dir) if out_dir is not None else cache_dir(config)
    if (root / "metrics.json").is_file():
        found = json.loads((root / "metrics.json").read_text()).get("config_hash")
        if found != config_hash(config):
            raise FileExistsError(f"{root} holds a tiny build of another config (hash {found} != "
                                  f"{config_hash(config)}); remove it or pick another --out")
    elif root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} exists, is not empty and holds no finished tiny build; remove it or pick "
                              "another --out")
    with _torch_threads(threads or _usable_cores()):
        if not (root / "metrics.json").is_file():
            _build_into(root, lambda staging: _build(staging, config, device))
        tool_root = tool_dir(root, config)
        if tool and not (tool_root / "metrics.json").is_file():
            _build_into(tool_root, lambda staging: _build_tool(root, staging, config, device))
        team_root = team_dir(root, config)
        if team and not (team_root / "metrics.json").is_file():
            _build_into(team_root, lambda staging: _build_team(root, staging, config, device))
    return read_build(root, config)


def _build_into(final: Path, build: Callable[[Path], None]) -> None:
    """``build(staging)`` into a temporary sibling of ``final``, then renamed to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the built models are read by every user
    try:
        build(staging)
        try:
            os.replace(staging, final)
        except OSError:
            if not (final / "metrics.json").is_file():  # not a lost race: something else is wrong
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
