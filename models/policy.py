"""The trained language model: a causal LM (optionally LoRA), a value head, per-role adapters, its
scores of actions (log-probs, entropies, values); FSDP2 sharding is ``models.sharding``'s, saving
``models.saving``'s.

Shapes: ``B`` rows (prompt, action) pairs, ``T`` packed tokens per row, ``L`` action tokens (the
longest action in the batch), ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel

from models.forward import hidden_at_actions
from models.loading import (load_causal_lm, load_tokenizer, meta_causal_lm, resolve_device,
                            resolve_precision)
from models.packing import (PackedBatch, SharedPromptBatch, TokenBatch, distinct_rows,
                            length_buckets, pack, pack_shared, take, token_lengths, token_rows)
from models.saving import (ACTOR_ADAPTER, ADAPTER_DIR, CRITIC_ADAPTER, POLICY_META, VALUE_HEAD_FILE,
                           PolicyWeights)
from models.scoring import ActionScores, token_scores
from models.sharding import ShardedPolicy, builds_empty

if TYPE_CHECKING:
    from peft import LoraConfig

# peft is imported where LoRA is used, not here: importing it takes seconds (it loads much of
# transformers), which every full fine-tuning run, every worker and every start-up error would pay.


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters; ``target_modules``: name suffixes or peft's ``"all-linear"``."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"

    def peft_config(self) -> LoraConfig:
        from peft import LoraConfig

        if self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank} must be >= 1 (use lora=None for full "
                             "fine-tuning)")
        targets = self.target_modules
        targets = targets if isinstance(targets, str) else list(targets)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=targets, task_type="CAUSAL_LM")


class LanguagePolicy(ShardedPolicy, PolicyWeights, nn.Module):
    """A causal LM policy with optional LoRA and an optional critic.

    Critic design. The value head is a linear layer on the final hidden state, fed by a trunk that
    the value loss trains (never a frozen no-grad trunk):
    - LoRA: the critic has its own LoRA adapter (``"critic"``) on the shared frozen base weights, so
      it learns through every targeted layer of the backbone while the actor adapter never sees the
      value loss. It costs a second forward pass (critic adapter active) but no copy of the base.
    - Full fine-tuning: the critic shares the trunk with the actor, and the value loss' gradient
      flows into the whole trunk (scaled by the trainer's value coefficient); no second model in
      memory, and ``score_actions(..., with_values=True)`` gets log-probs and values from one pass.
    ``param_groups(lr, critic_lr)`` puts the actor's parameters (actor adapter, or the full trunk)
    and the critic's (critic adapter + value head) in separate optimizer groups.

    Reference policy for KL: the base with adapters disabled (LoRA), or a frozen copy of the
    starting weights (full fine-tuning) loaded lazily from ``reference_dir`` on the first
    ``ref_log_probs`` call.

    Precision: ``dtype`` is the compute dtype. float32: plain. bfloat16/float16: fp32 master weights
    and autocast; float16 needs CUDA and serves inference (training it needs a loss scaler, which
    the trainer does not have, so the trainer refuses it); ``low_precision_weights=True`` stores
    bfloat16 weights outright. A frozen LoRA base is stored in the compute dtype.

    The policy starts in eval mode: call ``train()`` for updates (dropout and gradient checkpointing
    act only in training mode) and ``eval()`` when scoring must match the sampler exactly.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "auto",
        dtype: str = "float32",
        low_precision_weights: bool = False,
        lora: LoraSettings | None = None,
        with_critic: bool = False,
        gradient_checkpointing: bool = False,
        reference_dir: str | Path | None = None,
        role_adapters: Sequence[str] = (),
        value_heads: int = 1,
        weights_from_rank0: bool = False,
    ) -> None:
        super().__init__()
        if role_adapters and lora is None:
            raise ValueError(f"role_adapters={list(role_adapters)} are LoRA adapters on a shared "
                             "base: give lora (--lora_rank > 0)")
        if value_heads < 1:
            raise ValueError(f"value_heads={value_heads} must be >= 1 (one per role for per-role "
                             "critics)")
        self.role_adapters = tuple(role_adapters)
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.precision = resolve_precision(dtype, self.device, low_precision_weights)
        self.dtype_name = dtype
        self.lora = lora
        self.reference_dir = Path(reference_dir) if reference_dir is not None else self.model_dir
        self._weights_from_rank0 = weights_from_rank0
        empty = builds_empty(weights_from_rank0, lora)
        causal_lm = self._load_causal_lm(model_dir, empty)
        self.tokenizer = load_tokenizer(model_dir)
        if gradient_checkpointing:
            self._checkpoint_activations(causal_lm)
        self.model = causal_lm if lora is None else self._with_adapters(
            causal_lm, lora, with_critic, self.role_adapters,
            cast_inputs=not self.precision.autocast_enabled)
        hidden_size = causal_lm.config.get_text_config().hidden_size
        head_device = "meta" if empty else self.device
        self.value_head = (nn.Linear(hidden_size, value_heads, device=head_device) if with_critic
                           else None)
        self._trained_parameters = [p for p in self.parameters() if p.requires_grad]
        # with role adapters the shared actor adapter stays frozen (peft's switches unfreeze it)
        self._frozen_adapter = [p for name, p in self.named_parameters()
                                if self.role_adapters and f".{ACTOR_ADAPTER}." in name]
        object.__setattr__(self, "_reference", None)  # not a submodule: no state_dict/optimizer
        self._units: list[nn.Module] | None = None  # FSDP2 units once fully_shard ran, policy last
        self.eval()

    def _load_causal_lm(self, model_dir: str | Path, empty: bool) -> PreTrainedModel:
        """The causal LM, on the meta device when its weights arrive later (``empty``). A frozen
        LoRA base needs no fp32 master copy: it is stored in the compute dtype (peft keeps the
        adapters in fp32)."""
        dtype = self.precision.weights if self.lora is None else self.precision.compute
        if empty:
            return meta_causal_lm(model_dir, dtype)
        return load_causal_lm(model_dir, dtype, self.device)

    def _checkpoint_activations(self, causal_lm: PreTrainedModel) -> None:
        """Recomputes activations in the backward pass; with LoRA the replay runs with the adapter
        that was active in the forward (``_replay_with_active_adapter``)."""
        # transformers 5.24 renamed it activation checkpointing; the old name warns there
        enable = getattr(causal_lm, "activation_checkpointing_enable",
                         causal_lm.gradient_checkpointing_enable)
        enable({"use_reentrant": False} if self.lora is None else
               {"use_reentrant": False, "context_fn": self._replay_with_active_adapter})

    @staticmethod
    def _with_adapters(causal_lm: PreTrainedModel, lora: LoraSettings, with_critic: bool,
                       role_adapters: tuple[str, ...], cast_inputs: bool) -> nn.Module:
        """The actor adapter, the critic's, and one per role (each role then acts and learns through
        its own; the shared actor adapter stays frozen at zero: the base). ``cast_inputs=False``
        where every pass runs under autocast: peft would otherwise copy each adapter's input to the
        adapter's fp32, and autocast copy it back to the compute dtype for the matmul, two copies of
        every activation that give the same result."""
        from peft import get_peft_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        peft_model = get_peft_model(causal_lm, lora.peft_config())
        extra = ((CRITIC_ADAPTER,) if with_critic else ()) + role_adapters
        for adapter in extra:
            peft_model.add_adapter(adapter, lora.peft_config())
        for name, param in peft_model.named_parameters():  # peft creates inactive adapters frozen
            if any(f".{adapter}." in name for adapter in extra):
                param.requires_grad_(True)
            elif role_adapters and f".{ACTOR_ADAPTER}." in name:
                param.requires_grad_(False)
        for module in peft_model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = cast_inputs
        return peft_model

    # ---------------------------------------------------------------------------------------------
    # Views of the model
    # ---------------------------------------------------------------------------------------------

    @property
    def causal_lm(self) -> PreTrainedModel:
        """The HF model (LoRA layers injected when LoRA is on); what generate() and save() use."""
        return self.model if self.lora is None else self.model.get_base_model()

    @property
    def with_critic(self) -> bool:
        return self.value_head is not None

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for forward passes: matmuls in the compute dtype, weights as stored."""
        return torch.autocast(self.device.type, dtype=self.precision.compute,
                              enabled=self.precision.autocast_enabled)

    def actor_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of the policy: the actor adapter (LoRA) or the whole trunk."""
        critic_ids = {id(p) for p in self.critic_parameters()}
        return [p for p in self._trained_parameters if id(p) not in critic_ids]

    def critic_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters only the value loss reaches: the critic adapter, the value head."""
        if self.value_head is None:
            return []
        adapter = [p for name, p in self.model.named_parameters()
                   if f".{CRITIC_ADAPTER}." in name] if self.lora else []
        return adapter + list(self.value_head.parameters())

    def param_groups(self, lr: float, critic_lr: float | None = None) -> list[dict]:
        """Optimizer groups: actor at ``lr``, critic at ``critic_lr`` (default ``lr``)."""
        groups = [{"params": self.actor_parameters(), "lr": lr, "name": "actor"}]
        if self.with_critic:
            groups.append({"params": self.critic_parameters(),
                           "lr": lr if critic_lr is None else critic_lr, "name": "critic"})
        return groups

    @contextlib.contextmanager
    def using_adapter(self, name: str | None) -> Iterator[None]:
        """Runs the enclosed forward with LoRA adapter ``name`` active (None: adapters off).

        peft's switches also set requires_grad=False on inactive adapters, which would silently drop
        their gradients from graphs built earlier (AccumulateGrad skips leaves that no longer
        require grad); every trainable parameter is made trainable again on the way in and out.
        """
        switch = self.model.disable_adapter() if name is None else contextlib.nullcontext()
        try:
            if name is not None:
                self.model.set_adapter(name)
            with switch:
                self._restore_requires_grad()
                yield
        finally:
            self.model.set_adapter(ACTOR_ADAPTER)
            self._restore_requires_grad()

    def _replay_with_active_adapter(self) -> tuple[contextlib.AbstractContextManager,
                                                   contextlib.AbstractContextManager]:
        """(forward, replay) contexts of a checkpointed layer: the backward replays its forward
        after ``using_adapter`` switched back to the actor, so the replay switches to the adapter
        active now (without it a critic's or role's gradients would come from the actor's
        activations)."""
        return contextlib.nullcontext(), self.using_adapter(self.model.active_adapter)

    def _restore_requires_grad(self) -> None:
        """The trained parameters require grad again, the frozen shared actor adapter not."""
        for param in self._trained_parameters:
            param.requires_grad_(True)
        for param in self._frozen_adapter:
            param.requires_grad_(False)

    # ---------------------------------------------------------------------------------------------
    # Forward passes
    # ---------------------------------------------------------------------------------------------

    def _hidden_at_actions(self, causal_lm: PreTrainedModel,
                           batch: PackedBatch | SharedPromptBatch) -> torch.Tensor:
        """``[B, L, H]`` final hidden states at the positions that predict each action token."""
        return hidden_at_actions(causal_lm.get_decoder(), batch, self.autocast)

    def _token_scores(self, causal_lm: PreTrainedModel, hidden: torch.Tensor, batch: PackedBatch,
                      temperature: float, with_entropy: bool) -> ActionScores:
        """Log-probs (and entropies) of the action tokens from their ``[B, L, H]`` hidden states
        (``models.scoring``: the vocabulary projection in row chunks, never on all ``T``
        positions)."""
        return token_scores(causal_lm.get_output_embeddings(), hidden, batch.action_ids,
                            batch.action_mask, temperature, with_entropy, self.autocast)

    @property
    def num_value_heads(self) -> int:
        """Outputs of the value head: 1, or one per role (per-role critics on a shared trunk)."""
        return 0 if self.value_head is None else self.value_head.out_features

    def _values(self, hidden: torch.Tensor, mask: torch.Tensor,
                heads: Sequence[int] | None = None) -> torch.Tensor:
        """``[B, L]`` values from ``[B, L, H]`` hidden states, row b read from value head
        ``heads[b]`` (None: head 0); the head runs in fp32."""
        self._require_critic()
        values = self.value_head(hidden.float())  # [B, L, K]
        if heads is None:
            values = values[..., 0]
        else:
            rows = torch.arange(len(values), device=values.device)
            head_of_row = torch.as_tensor(list(heads), dtype=torch.long, device=values.device)
            values = values[rows, :, head_of_row]
        return torch.where(mask, values, 0.0)

    def _require_critic(self) -> None:
        if self.value_head is None:
            raise ValueError("this policy has no critic; construct it with with_critic=True")

    def _critic_hidden(self, batch: PackedBatch | SharedPromptBatch) -> torch.Tensor:
        self._require_critic()
        if self.lora is None:
            return self._hidden_at_actions(self.causal_lm, batch)
        with self.using_adapter(CRITIC_ADAPTER):
            return self._hidden_at_actions(self.causal_lm, batch)

    def pack(self, prompts: TokenBatch, actions: TokenBatch,
             padding_side: str = "right") -> PackedBatch | SharedPromptBatch:
        """The rows for one pass: a ``SharedPromptBatch`` when prompts repeat (not when sharded,
        where every rank must run the same passes), else one packed batch padded on
        ``padding_side``."""
        pad_id = self.tokenizer.pad_token_id
        if not self.sharded:
            shared = pack_shared(prompts, actions, pad_id, self.device)
            if shared is not None:
                return shared
        return pack(prompts, actions, pad_id, self.device, padding_side)

    def score_actions(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0, *,
                 with_entropy: bool = True, with_values: bool = False,
                 padding_side: str = "right", adapters: Sequence[str] | None = None,
                 critic_prompts: TokenBatch | None = None,
                 value_heads: Sequence[int] | None = None) -> ActionScores:
        """Scores ``actions`` given ``prompts``: one forward pass (two with a LoRA critic) per group
        of rows of similar packed length (``_pass_rows``), so short rows are not padded to the
        longest, and a prompt that several rows continue runs once (``SharedPromptBatch``).

        ``temperature`` divides the logits, so log-probs are those of the distribution the sampler
        drew from (top-p/top-k filtering is not re-applied). Returns ``[B, L]`` tensors, L = longest
        action. ``adapters`` [B]: the role adapter each row acts with (passes of their own per
        adapter; a row's gradient reaches only its own adapter). Values: ``critic_prompts`` [B]
        what the critic reads instead of ``prompts`` (a centralized critic's joint transcript; a
        pass of its own), ``value_heads`` [B] the head each row's value is read from.
        """
        size = len(token_lengths(prompts))
        rows_of: dict[str | None, list[int]] = {}
        for row, adapter in enumerate(adapters if adapters is not None else [None] * size):
            rows_of.setdefault(adapter, []).append(row)
        passes = [(adapter, bucket) for adapter, rows in rows_of.items()
                  for bucket in self._pass_rows(prompts, actions, rows)]
        if len(passes) == 1 and passes[0][0] is None:
            return self._score_pass(prompts, actions, temperature, with_entropy, with_values,
                                       padding_side, critic_prompts, value_heads)
        parts = []
        for adapter, rows in passes:
            with self.using_adapter(adapter) if adapter is not None else contextlib.nullcontext():
                parts.append((rows, self._score_pass(
                    take(prompts, rows), take(actions, rows), temperature, with_entropy,
                    with_values, padding_side,
                    None if critic_prompts is None else take(critic_prompts, rows),
                    None if value_heads is None else [value_heads[row] for row in rows])))
        return ActionScores.interleave(parts, size)

    def _pass_rows(self, prompts: TokenBatch, actions: TokenBatch,
                   rows: list[int]) -> list[list[int]]:
        """``rows`` cut into the passes that cost least (``length_buckets``), the rows that continue
        one prompt kept in one pass so that its prompt runs once there; one pass when sharded."""
        if self.sharded:
            return [rows]
        lengths = [p + a for p, a in zip(token_lengths(prompts), token_lengths(actions))]
        _, prompt_of_row = distinct_rows(token_rows(take(prompts, rows)))
        groups: dict[int, list[int]] = {}
        for row, prompt in zip(rows, prompt_of_row):
            groups.setdefault(prompt, []).append(row)
        members = list(groups.values())
        buckets = length_buckets([max(lengths[row] for row in group) for group in members])
        return [[row for group in bucket for row in members[group]] for bucket in buckets]

    def _score_pass(self, prompts: TokenBatch, actions: TokenBatch, temperature: float,
                       with_entropy: bool, with_values: bool, padding_side: str,
                       critic_prompts: TokenBatch | None,
                       value_heads: Sequence[int] | None) -> ActionScores:
        """``score_actions``'s scores of every row in one packed forward pass, active adapter on."""
        batch = self.pack(prompts, actions, padding_side)
        hidden = self._hidden_at_actions(self.causal_lm, batch)
        scores = self._token_scores(self.causal_lm, hidden, batch, temperature, with_entropy)
        if with_values and critic_prompts is not None:
            scores.values = self.token_values(critic_prompts, actions, padding_side, value_heads)
        elif with_values:
            critic_hidden = hidden if self.lora is None else self._critic_hidden(batch)
            scores.values = self._values(critic_hidden, batch.action_mask, value_heads)
        return scores

    def forward(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0, *,
                with_entropy: bool = True, with_values: bool = False,
                adapters: Sequence[str] | None = None, critic_prompts: TokenBatch | None = None,
                value_heads: Sequence[int] | None = None) -> ActionScores:
        """``score_actions``, as the module's call: what DDP wraps, so data-parallel training reduces the
        gradients of these scores over ranks."""
        return self.score_actions(prompts, actions, temperature, with_entropy=with_entropy,
                             with_values=with_values, adapters=adapters,
                             critic_prompts=critic_prompts, value_heads=value_heads)

    def token_values(self, prompts: TokenBatch, actions: TokenBatch, padding_side: str = "right",
                     heads: Sequence[int] | None = None) -> torch.Tensor:
        """``[B, L]`` token-level values V(prompt, a_<k) (TPPO); 0 past each action's end.
        ``heads`` [B]: the value head of each row (None: head 0)."""
        batch = self.pack(prompts, actions, padding_side)
        return self._values(self._critic_hidden(batch), batch.action_mask, heads)

    def values(self, prompts: TokenBatch, heads: Sequence[int] | None = None) -> torch.Tensor:
        """``[B]`` action-level values V(prompt), read at the last prompt token (``heads`` as
        ``token_values``)."""
        size = len(prompts[1] if isinstance(prompts, tuple) else prompts)
        batch = self.pack(prompts, [[] for _ in range(size)])
        first = torch.ones_like(batch.action_mask[:, :1])
        return self._values(self._critic_hidden(batch)[:, :1], first, heads).squeeze(1)

    @torch.no_grad()
    def ref_log_probs(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0,
                      padding_side: str = "right") -> torch.Tensor:
        """``[B, L]`` log-probs under the reference policy (for KL), 0 where the action mask is
        False."""
        batch = self.pack(prompts, actions, padding_side)
        if self.lora is not None:
            with self.using_adapter(None):
                hidden = self._hidden_at_actions(self.causal_lm, batch)
            return self._token_scores(self.causal_lm, hidden, batch, temperature,
                                      with_entropy=False).log_probs
        reference = self._reference_model()
        hidden = self._hidden_at_actions(reference, batch)
        return self._token_scores(reference, hidden, batch, temperature,
                                  with_entropy=False).log_probs

    def _reference_model(self) -> PreTrainedModel:
        """The frozen starting weights, loaded on first use so runs without KL never hold a copy."""
        if self._reference is None:
            reference = load_causal_lm(self.reference_dir, self.precision.weights, self.device,
                                       "reference_dir").eval()
            reference.requires_grad_(False)
            object.__setattr__(self, "_reference", reference)
        return self._reference

    @classmethod
    def load(cls, checkpoint_dir: str | Path, **kwargs) -> "LanguagePolicy":
        """Restores a policy written by ``save`` (device/dtype/gradient_checkpointing via
        ``kwargs``).

        With LoRA the top-level weights are base + delta; the base is recovered by subtracting the
        saved adapter's delta, so the checkpoint directory alone suffices (reference = that base).
        """
        path = Path(checkpoint_dir)
        meta_file = path / POLICY_META
        if not meta_file.is_file():
            raise FileNotFoundError(f"{meta_file} not found: {path} is not a LanguagePolicy.save() "
                                    "directory; use LanguagePolicy(path) to start from plain HF "
                                    "weights")
        meta = json.loads(meta_file.read_text())
        lora = None
        if meta["lora"]:
            lora_fields = dict(meta["lora"])
            if isinstance(lora_fields["target_modules"], list):
                lora_fields["target_modules"] = tuple(lora_fields["target_modules"])
            lora = LoraSettings(**lora_fields)
        policy = cls(path, lora=lora, with_critic=meta["with_critic"],
                     reference_dir=meta["reference_dir"],
                     role_adapters=meta.get("role_adapters", ()),
                     value_heads=meta.get("value_heads", 1), **kwargs)
        if lora is not None:
            policy._restore_adapters(path / ADAPTER_DIR)
        if policy.value_head is not None:
            state = load_file(path / VALUE_HEAD_FILE, device=str(policy.device))
            policy.value_head.load_state_dict(state)
        return policy
