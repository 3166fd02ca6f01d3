"""The shepherd PRM's KV cache: what the PRM keeps of each text it scored (``Past``: its token ids, the keys
and values of every layer, its step scores), an LRU of those capped in bytes (``PastCache``), and the padding
that stacks several of them into one model cache (``padded_past``), so that a text one step longer than one it
scored runs through the model only from where the cached encoding ends (``reward_models.prm``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache


@dataclass(frozen=True)
class Past:
    """What the PRM keeps of one scored text of T tokens.

    ids: the T token ids (the text's encoding, truncation included).
    kv: [2 * layers, kv_heads, T, head_dim], the keys and values of every layer (keys of layer i at
        2i, values at 2i + 1), with RoPE already applied at positions 0..T-1.
    scores: [S] the scores of the S markers among the T tokens.
    """

    ids: tuple[int, ...]
    kv: torch.Tensor
    scores: np.ndarray

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PastCache:
    """An LRU of ``Past`` entries keyed by the text they encode, holding at most ``max_bytes`` of
    key/values (an entry larger than that is not kept). Keyed by text so that finding the previous
    call's entry costs no second tokenization; its ids are still compared with the new encoding."""

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be > 0")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.entries: OrderedDict[str, Past] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, text: str) -> Past | None:
        """The entry of ``text`` (now the most recently used), or None."""
        past = self.entries.get(text)
        if past is not None:
            self.entries.move_to_end(text)
        return past

    def put(self, text: str, past: Past) -> None:
        """Keeps ``past`` as the most recently used entry, evicting the least recently used ones
        until the total fits ``max_bytes``."""
        self.pop(text)
        if past.nbytes > self.max_bytes:
            return
        self.entries[text] = past
        self.nbytes += past.nbytes
        while self.nbytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def pop(self, text: str) -> None:
        past = self.entries.pop(text, None)
        if past is not None:
            self.nbytes -= past.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


def padded_past(pasts: Sequence[Past | None], width: int) -> DynamicCache:
    """The B pasts as one cache of [B, kv_heads, width, head_dim] per layer, each left-padded with
    zeros (masked by the caller; zeros, not garbage, since 0 * NaN would leak through the mask)."""
    if width == 0:
        return DynamicCache()  # no config: every layer a full DynamicLayer, none cropped to a window
    kv = next(p.kv for p in pasts if p is not None)
    two_layers, heads, _, head_dim = kv.shape
    padded = kv.new_zeros(two_layers, len(pasts), heads, width, head_dim)
    for b, past in enumerate(pasts):
        if past is not None:
            padded[:, b, :, width - past.length :] = past.kv
    return DynamicCache(ddp_cache_data=[(padded[i], padded[i + 1]) for i in range(0, two_layers, 2)])
