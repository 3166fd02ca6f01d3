"""Members: the roles of a multi-agent workflow that learn on base models of their own (``--role_base_model``).

Each member has its own LanguagePolicy (LoRA or full fine-tuning), optimizer and learning-rate schedule, and its
own generator; the policy speaks for every other role. The update scores each row with its role's model
(``models.team.Team``), so one loss over the batch trains every model on its own rows; each model's gradient is
clipped on its own and its optimizer stepped. A checkpoint holds each member as a whole run holds its policy
(``members/<role>/policy``, ``members/<role>/train_state``; ``train.checkpoint_files``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.generation import Generator
from models.policy import LanguagePolicy


@dataclass(frozen=True)
class Member:
    """A role on a base model of its own: its ``policy``, ``optimizer`` and lr ``scheduler`` (stepped with the
    policy's), and the ``generator`` that samples its messages."""

    role: str
    policy: LanguagePolicy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    generator: Generator


def memory_line(name: str, policy: LanguagePolicy) -> str:
    """What a model of the team holds in memory: its parameters (trained ones apart), the bytes of its weights
    and of the AdamW moments of its trained parameters (two fp32 tensors each), and how it trains."""
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    trained = [p for p in policy.parameters() if p.requires_grad]
    moments = 2 * 4 * sum(p.numel() for p in trained)
    how = f"LoRA rank {policy.lora.rank}" if policy.lora is not None else "full fine-tuning"
    return (f"{name}: {policy.model_dir} ({how}), {sum(p.numel() for p in policy.parameters()):,} parameters, "
            f"{sum(p.numel() for p in trained):,} trained; weights {weights / 2**20:.1f} MiB, optimizer moments "
            f"{moments / 2**20:.1f} MiB, on {policy.device}")
