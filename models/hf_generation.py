"""The HF transformers backend: KV-cached decoding with the policy's own model (CPU or GPU), left padding,
a preallocated cache that drops rows as they end, and plain torch sampling (conventions:
``models.generation``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StopStringCriteria
from transformers.cache_utils import Cache, DynamicLayer

from envs.modes import FinishReason
from models.batching import compacts, length_batches
from models.forward import kv_cache_keyword, module_mode
from models.packing import distinct_rows, left_padded
from models.policy import LanguagePolicy
from models.sampling import (GenerationOutput, Prompts, Seed, adapter_groups, check_sampling, encode_prompts,
                             filter_logits, finish_texts, row_seeds, uniform_draws)


@dataclass(frozen=True)
class Sampler:
    """Draws next tokens and scores them under the distribution drawn from (module docstring)."""

    temperature: float
    top_k: int
    top_p: float

    def __call__(self, logits: torch.Tensor, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``([A] token ids, [A] rollout log-probs)`` from ``[A, V]`` next-token logits and ``[A]``
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


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """The tokenizer's EOS plus any the model's generation config lists (as vLLM does)."""
    configured = model.generation_config.eos_token_id
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return sorted({tokenizer.eos_token_id, *configured} - {None})


@dataclass
class _Samples:
    """What B rows generated so far: ``[B, S]`` buffers (S = max_new_tokens) and where rows ended."""

    token_ids: torch.Tensor  # [B, S] (pad after a row's end)
    log_probs: torch.Tensor  # [B, S]
    ends: torch.Tensor  # [B] tokens generated when the row ended; 0 while it goes on
    on_eos: torch.Tensor  # [B] ended on an EOS token (else on a stop string)

    @classmethod
    def empty(cls, rows: int, max_new_tokens: int, pad_id: int, device: torch.device) -> "_Samples":
        return cls(torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device),
                   torch.zeros(rows, max_new_tokens, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.bool, device=device))

    def outputs(self) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
        """Per row: generated ids and log-probs up to its end, and its finish reason."""
        lengths = torch.where(self.ends == 0, self.token_ids.shape[1], self.ends).tolist()
        reasons = [FinishReason.LENGTH if end == 0 else FinishReason.EOS if eos else FinishReason.STOP
                   for end, eos in zip(self.ends.tolist(), self.on_eos.tolist())]
        token_ids = [ids[:length] for ids, length in zip(self.token_ids.tolist(), lengths)]
        log_probs = [lps[:length] for lps, length in zip(self.log_probs.tolist(), lengths)]
        return token_ids, log_probs, reasons


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
        token_ids, log_probs, reasons = [None] * len(rows), [None] * len(rows), [None] * len(rows)
        for batch in length_batches([len(row) for row in rows], max_new_tokens, self.batch_size,
                                    self.max_batch_tokens, self.length_buckets):
            uniforms = (uniform_draws([seeds[i] for i in batch], max_new_tokens, self.policy.device)
                        if seeds is not None else None)
            outputs = self._generate_rows([rows[i] for i in batch], max_new_tokens, sampler, uniforms, stop)
            for i, row_ids, row_log_probs, reason in zip(batch, *outputs):
                token_ids[i], log_probs[i], reasons[i] = row_ids, row_log_probs, reason
        return GenerationOutput(texts=finish_texts(tokenizer, token_ids, reasons, stop), token_ids=token_ids,
                                rollout_log_probs=log_probs, finish_reasons=reasons, prompt_token_ids=rows)

    def _generate_rows(self, rows: list[list[int]], max_new_tokens: int, sampler: Sampler,
                       uniforms: torch.Tensor | None, stop: list[str] | None,
                       ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Decodes ``rows`` (prompt ids) together; ``uniforms`` [rows, max_new_tokens]: each row's draws."""
        model, pad_id, device = self.policy.causal_lm, self.policy.tokenizer.pad_token_id, self.policy.device
        prompts, prompt_of_row = distinct_rows(rows)
        input_ids, attention_mask = left_padded(prompts, pad_id, device)  # [U, P]
        cache = preallocated_cache(model, input_ids.shape[1] + max_new_tokens)
        samples = _Samples.empty(len(rows), max_new_tokens, pad_id, device)
        # The last position by index, not logits_to_keep=1: that slice is a strided [U, 1, H] view, and a CPU
        # linear on it expands the [V, H] head per row (2.2 GB and 4.5 s for 8 rows at V = 151,936).
        last = torch.tensor([input_ids.shape[1] - 1], device=device)
        with module_mode(model, training=False), torch.no_grad(), self.policy.autocast():
            logits = model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
                           **{kv_cache_keyword(model): cache}, use_cache=True,
                           logits_to_keep=last).logits[:, -1]  # [U, V]
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
            tokens, log_probs = sampler(logits[rows], uniforms[live, step] if uniforms is not None else None)  # [A]
            samples.token_ids[live, step], samples.log_probs[live, step] = tokens, log_probs
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
