"""The tiny build end to end: train the four models, measure them, and cache the result.

A build takes minutes on a CPU, so it is kept in a directory named by ``config_hash`` and reused.
It is written to a temporary sibling and renamed into place, so a killed build never leaves a
partial directory that would later be taken for a finished one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from envs.datasets import Problem
from envs.prompts import SHEPHERD_STEP_TAG
from train.tiny.config import TinyConfig, cache_dir, config_hash
from train.tiny.data import BAD_TOKEN, GOOD_TOKEN, arith_batches, heldout_problems
from train.tiny.evaluation import arith_accuracy, prefix_metrics, prm_last_step_auc, prm_metrics
from train.tiny.model import new_model, num_parameters
from train.tiny.roles import team_metrics, train_team
from train.tiny.tokenizer import build_tokenizer
from train.tiny.training import build_prm, train_policy_and_target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyModels:
    """Paths of a finished build and the metrics measured on held-out Arith problems."""

    root: Path
    policy: Path
    prm: Path
    target: Path
    team: Path
    metrics: dict


def _paths(root: Path) -> TinyModels:
    metrics = json.loads((root / "metrics.json").read_text())
    return TinyModels(root=root, policy=root / "policy", prm=root / "prm", target=root / "target", team=root / "team",
                      metrics=metrics)


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _build_team(policy: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, config: TinyConfig,
                batches: Iterator[list[Problem]], evaluation: list[Problem], out_dir: Path, device: str) -> dict:
    """The team model (``train.tiny.roles``), fine-tuned from ``policy`` in place, saved to ``out_dir``; its metrics."""
    started = time.perf_counter()
    train_team(policy, tokenizer, config, batches, config.seed + 3, device)
    _save(policy, tokenizer, out_dir)
    return {**team_metrics(policy, tokenizer, evaluation, config.seed + 4),
            "seconds": round(time.perf_counter() - started, 1)}


def _build(out_dir: Path, config: TinyConfig, device: str) -> dict:
    """Trains the four models into ``out_dir`` and returns the metrics (also in metrics.json)."""
    started = time.perf_counter()
    arith = config.arith()
    tokenizer = build_tokenizer(config.vocab_size)
    evaluation = heldout_problems(config)
    select = arith.problems(config.num_select, seed=config.seed + 2_000_003, exclude=(p.id for p in evaluation))
    batches = arith_batches(arith, config.batch_size, config.seed, {p.id for p in evaluation + select})
    model = new_model(tokenizer, config.seed, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                      num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
                      intermediate_size=config.intermediate_size).to(device)
    log.info("tiny build: vocab %d, %d parameters, cache key %s", len(tokenizer), num_parameters(model), config_hash(config))

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

    team = _build_team(model, tokenizer, config, batches, evaluation, out_dir / "team", device)
    log.info("team model: %s (%.0f s)", team, time.perf_counter() - started)

    metrics = {
        "config_hash": config_hash(config),
        "config": asdict(config),
        "vocab_size": len(tokenizer),
        "num_parameters": num_parameters(model),
        "num_eval_problems": len(evaluation),
        "policy": {"accuracy": policy_accuracy, **{k: v for k, v in sft_log.items() if k != "history"}},
        "target": target_metrics,
        "team": team,
        "prm": {**prm_quality, **prm_choices, "num_parameters": num_parameters(prm), "good_token": GOOD_TOKEN,
                "bad_token": BAD_TOKEN, "step_tag": SHEPHERD_STEP_TAG},
        "sft_history": sft_log["history"],
        "build_seconds": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


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
                      device: str = "cpu", threads: int | None = None) -> TinyModels:
    """Builds (or finds already built) the tiny policy, PRM and target for ``config``.

    ``threads``: torch CPU threads during a build, by default every core this process may use
    (the build expects the machine to itself). The float sums then differ from machine to machine,
    and the SFT's sudden jump with them, so builds match across runs on one machine, not across machines.

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
