"""Generation backends behind one protocol: HF transformers (CPU/GPU) and vLLM (in-process, weight sync).

Conventions every backend follows:
- Samples are prompt-major: sample j of prompt i is at index ``i * n + j``.
- A stop string ends a sample (finish reason ``"stop"``) and is INCLUDED: ``token_ids`` hold every
  generated token up to and including the one that completed the stop string, and ``text`` is
  ``decode(token_ids)`` cut right after the stop string (the env appends/strips the delimiter itself).
- An EOS token ends a sample (``"eos"``); it is in ``token_ids`` (its log-prob is part of the action)
  but not in ``text`` (special tokens are skipped when decoding). ``"length"``: ``max_new_tokens`` reached.
- Rollout log-probs are those of the distribution actually sampled from: logits / temperature, then
  top-k, then top-p filtering, renormalised. With top_k/top_p off they equal
  ``LanguagePolicy.score_actions(..., temperature)``. Temperature 0 is greedy decoding, scored under the
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

The backends: ``models.hf_generation`` (HF transformers; its batching in ``models.batching``) and
``models.vllm_generation`` (vLLM in this process); ``models.vllm_server`` serves vLLM behind HTTP. What
they share is in ``models.sampling``; this module names the protocol, builds a backend, and exports the
types every caller of a backend uses (helpers are imported from the module that defines them).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from envs.modes import Backend
from models.hf_generation import HFGenerator
from models.policy import LanguagePolicy
from models.sampling import GenerationOutput, Prompts, Seed, mix_seed
from models.vllm_generation import VLLMGenerator

__all__ = ["GenerationOutput", "Generator", "HFGenerator", "Prompts", "Seed", "VLLMGenerator", "make_generator",
           "mix_seed"]


class Generator(Protocol):
    def generate(self, prompts: Prompts, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                 seed: Seed = None, adapters: Sequence[str | None] | None = None) -> GenerationOutput:
        """Samples ``n`` completions per prompt (``seed``, ``adapters`` [len(prompts)]: see the module
        docstring)."""

    def sync(self, policy: LanguagePolicy) -> float:
        """Makes the backend generate with ``policy``'s current weights; returns seconds taken."""


def make_generator(backend: Backend, policy: LanguagePolicy, **kwargs) -> Generator:
    """``hf``: HFGenerator(policy, **kwargs); ``vllm``: a VLLMGenerator on the policy's directory (dtype
    the policy's unless given; serving its role adapters, if any), synced to the policy's current weights
    (kwargs go to VLLMGenerator)."""
    if backend == Backend.HF:
        return HFGenerator(policy, **kwargs)
    if backend == Backend.VLLM:
        roles = {"role_adapters": policy.role_adapters, "lora_rank": policy.lora.rank} if policy.role_adapters else {}
        generator = VLLMGenerator(policy.model_dir, **{"dtype": policy.dtype_name, **roles, **kwargs})
        generator.sync(policy)
        return generator
    raise ValueError(f"generation backend {backend!r} is not one of 'hf', 'vllm'")
