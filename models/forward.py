"""Forward passes to the final hidden states that predict each action token, for packed rows and for
rows that share prompts (each distinct prompt run once, its KV states read by every row continuing it).

The shared-prompt pass works under activation checkpointing: its KV cache gives the same states when
a checkpointed layer replays its forward in the backward (``PrefixCache``), so the layers may keep it.

Shapes: ``B`` rows, ``T`` packed tokens, ``U`` distinct prompts of ``P`` tokens, ``L`` action tokens,
``H`` hidden size.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterator

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from models.packing import PackedBatch, SharedPromptBatch

Autocast = Callable[[], contextlib.AbstractContextManager]


def kv_cache_keyword(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes a KV cache by: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` still works but warns on every call), ``past_key_values`` before it and in
    remote-code models written for older versions."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class PrefixCache(DynamicCache):
    """A KV cache of prompts that checkpointed layers may replay. Writing (the prompts' pass), a layer's
    states are set, not appended, so a replay rewrites equal ones; reading (``repeated``, the actions'
    pass), a layer gets prompt + new states and nothing is stored, so a replay reads the same prompt."""

    def __init__(self, read_only: bool = False) -> None:
        super().__init__()
        self.read_only = read_only

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.read_only:
            layer = self.layers[layer_idx]
            return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)
        while len(self.layers) <= layer_idx:
            self.layers.append(DynamicLayer())
        self.layers[layer_idx] = stored_layer(key_states, value_states)
        return key_states, value_states

    def repeated(self, rows: torch.Tensor) -> PrefixCache:
        """A read-only cache whose row b holds this cache's row ``rows[b]`` (an index: gradients flow back)."""
        reader = PrefixCache(read_only=True)
        reader.layers = [stored_layer(layer.keys[rows], layer.values[rows]) for layer in self.layers]
        return reader


def stored_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    """A cache layer holding ``keys`` and ``values`` [B, heads, P, head_dim]."""
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


@contextlib.contextmanager
def layers_keep_cache(decoder: nn.Module) -> Iterator[None]:
    """Lets checkpointed decoder layers keep a ``PrefixCache`` (transformers drops a cache under activation
    checkpointing unless a layer says a replay reads the same states, which a ``PrefixCache`` guarantees)."""
    layers = list(decoder.layers)
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


@contextlib.contextmanager
def module_mode(module: nn.Module, training: bool) -> Iterator[None]:
    """``module`` in training (activation checkpointing and dropout act) or eval mode for the enclosed
    passes; the caller's mode afterwards."""
    was_training = module.training
    module.train(training)
    try:
        yield
    finally:
        module.train(was_training)


def hidden_at_actions(decoder: nn.Module, batch: PackedBatch | SharedPromptBatch,
                      autocast: Autocast = contextlib.nullcontext) -> torch.Tensor:
    """``[B, L, H]`` final hidden states of ``decoder`` (a causal LM's ``get_decoder()``) at the positions
    that predict each action token; ``autocast``: the context the pass runs in."""
    if isinstance(batch, SharedPromptBatch):
        return hidden_after_shared_prompts(decoder, batch, autocast)
    with autocast():
        hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids, use_cache=False).last_hidden_state  # [B, T, H]
    index = batch.read_positions[..., None].expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, index)


def hidden_after_shared_prompts(decoder: nn.Module, batch: SharedPromptBatch,
                                autocast: Autocast = contextlib.nullcontext) -> torch.Tensor:
    """``hidden_at_actions`` with each distinct prompt run once: the prompts' pass fills a KV cache, its
    rows are repeated for the rows that continue each prompt (an index, so gradients flow back to the one
    prompt pass), and the actions run on top. G rows per prompt cost one prompt instead of G."""
    keyword = kv_cache_keyword(decoder)
    positions = torch.arange(batch.action_ids.shape[1], device=batch.action_ids.device)[None]  # [1, L]
    prompt_lengths = batch.prompt_mask.sum(1)[batch.prompt_of_row]  # [B]
    cache = PrefixCache()
    with autocast(), layers_keep_cache(decoder):
        prompted = decoder(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask,
                           position_ids=(batch.prompt_mask.cumsum(1) - 1).clamp(min=0),
                           **{keyword: cache}, use_cache=True).last_hidden_state  # [U, P, H]
        acted = decoder(input_ids=batch.action_ids,
                        attention_mask=torch.cat([batch.prompt_mask[batch.prompt_of_row], batch.action_mask.long()], 1),
                        position_ids=prompt_lengths[:, None] + positions,
                        **{keyword: cache.repeated(batch.prompt_of_row)}, use_cache=True).last_hidden_state  # [B, L, H]
    last_prompt = prompted[batch.prompt_of_row, -1:]  # [B, 1, H] predicts action token 0
    return torch.cat([last_prompt, acted[:, :-1]], 1)
