"""What every generation backend shares: the output type, prompt encoding, role-adapter groups, the
per-sample seeds and draws, argument checks, stop-string cuts and top-k/top-p filtering (the conventions
are ``models.generation``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from envs.modes import FinishReason

Prompts = Sequence[str] | Sequence[Sequence[int]]
Seed = int | Sequence[int] | None


@dataclass
class GenerationOutput:
    """``len(prompts) * n`` samples, prompt-major (sample j of prompt i at ``i * n + j``)."""

    texts: list[str]
    token_ids: list[list[int]]
    rollout_log_probs: list[list[float]]  # the sampler's log-prob of each generated token (see module docstring)
    finish_reasons: list[FinishReason]
    prompt_token_ids: list[list[int]]  # the prompt of each sample

    @classmethod
    def interleave(cls, parts: Sequence[tuple[Sequence[int], "GenerationOutput"]], size: int) -> "GenerationOutput":
        """One output of ``size`` samples from ``parts``: (the positions its samples take, an output)."""
        names = ("texts", "token_ids", "rollout_log_probs", "finish_reasons", "prompt_token_ids")
        fields = {name: [None] * size for name in names}
        for positions, part in parts:
            for name, values in fields.items():
                for position, value in zip(positions, getattr(part, name)):
                    values[position] = value
        return cls(**fields)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Prompts) -> list[list[int]]:
    """Token ids of each prompt; id lists pass through unchanged."""
    if not prompts:
        raise ValueError("prompts is empty; pass at least one prompt")
    if isinstance(prompts[0], str):
        return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]
    return [list(ids) for ids in prompts]


def adapter_groups(adapters: Sequence[str | None] | None, num_prompts: int,
                   role_adapters: Sequence[str]) -> dict[str | None, list[int]]:
    """{adapter: the prompts sampled with it}, adapters in order of first use, from ``adapters``
    [num_prompts] (None: the default actor; ``adapters=None``: every prompt with it). Every name must be
    one of ``role_adapters``."""
    if adapters is None:
        return {None: list(range(num_prompts))}
    if len(adapters) != num_prompts:
        raise ValueError(f"got {len(adapters)} adapters for {num_prompts} prompts; give one adapter name (or None) "
                         "per prompt")
    unknown = sorted({adapter for adapter in adapters if adapter is not None} - set(role_adapters))
    if unknown:
        raise ValueError(f"adapters {unknown} are not role adapters of the policy (it has {list(role_adapters)}); "
                         "name one of those, or None for the default actor")
    groups: dict[str | None, list[int]] = {}
    for prompt, adapter in enumerate(adapters):
        groups.setdefault(adapter, []).append(prompt)
    return groups


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, each changing it completely (numpy's SeedSequence hashing)."""
    words = [word for part in parts for word in (part % 2**32, part // 2**32 % 2**32)]  # negatives wrap
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> 1)


def row_seeds(seed: Seed, num_prompts: int, n: int) -> list[int]:
    """The seed of each of the ``num_prompts * n`` samples (prompt-major): ``mix_seed(seed, k)`` for sample k
    of an int seed, ``mix_seed(seed[i], j)`` for sample j of prompt i with one seed per prompt, fresh
    entropy for None."""
    if seed is None:
        seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1)
    if isinstance(seed, int):
        return [mix_seed(seed, k) for k in range(num_prompts * n)]
    if len(seed) != num_prompts:
        raise ValueError(f"got {len(seed)} seeds for {num_prompts} prompts; give one int, or one seed per prompt")
    return [mix_seed(prompt_seed, j) for prompt_seed in seed for j in range(n)]


def uniform_draws(seeds: Sequence[int], length: int, device: torch.device) -> torch.Tensor:
    """``[B, length]`` float64 uniforms in [0, 1), row b from a generator seeded with ``seeds[b]``."""
    generator = torch.Generator()
    rows = []
    for seed in seeds:  # one small draw per sample, not per token
        generator.manual_seed(seed)
        rows.append(torch.rand(length, generator=generator, dtype=torch.float64))
    return torch.stack(rows).to(device)


def check_sampling(n: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n={n} and max_new_tokens={max_new_tokens} must both be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if top_k < -1 or top_k == 0:
        raise ValueError(f"top_k={top_k} must be -1 (off) or >= 1")


def finish_texts(tokenizer: PreTrainedTokenizerBase, token_ids: list[list[int]], finish_reasons: list[FinishReason],
                 stop: Sequence[str] | None) -> list[str]:
    """Decoded samples; a sample that ended on a stop string is cut right after its first occurrence."""
    texts = tokenizer.batch_decode(token_ids, skip_special_tokens=True)
    return [_cut_after_stop(text, stop) if reason == FinishReason.STOP else text
            for text, reason in zip(texts, finish_reasons)]


def _cut_after_stop(text: str, stop: Sequence[str] | None) -> str:
    ends = [text.find(s) + len(s) for s in stop or () if s in text]
    return text[:min(ends)] if ends else text


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``[B, V]`` logits with tokens outside the top-k, then outside the top-p nucleus, set to -inf."""
    if top_k > 0:
        kth_largest = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        drop_sorted = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    return logits
