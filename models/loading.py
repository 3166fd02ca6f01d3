"""Loading models from local directories: devices and dtypes, directory checks that say what to pass
instead, the tokenizer (with a pad token) and the causal LM."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel,
                          PreTrainedTokenizerBase)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else as given (cuda must exist)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but CUDA is not available here; use --device cpu "
                         "or auto")
    return resolved


def inference_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA (a 7B PRM never lands in fp32 on a GPU by accident), float32 on
    CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class Precision:
    """``compute``: dtype of the matmuls (autocast); ``weights``: dtype the trained weights are
    stored in."""

    compute: torch.dtype
    weights: torch.dtype

    @property
    def autocast_enabled(self) -> bool:
        return self.compute != torch.float32


def resolve_precision(dtype: str, device: torch.device,
                      low_precision_weights: bool = False) -> Precision:
    """fp32 master weights + autocast for bfloat16/float16 (the default); ``low_precision_weights``
    stores bfloat16 weights directly (no fp32 master copy; half the memory). float16 (CUDA only) is
    for inference: training in it needs a loss scaler (torch.amp.GradScaler), which the trainer
    does not have, so the trainer refuses it; float16 weights without an fp32 master copy are
    refused too (small updates would round away)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    compute = DTYPES[dtype]
    if compute == torch.float16 and device.type == "cpu":
        raise ValueError("dtype='float16' needs a CUDA device; use float32 or bfloat16 on CPU")
    if low_precision_weights and compute != torch.bfloat16:
        raise ValueError(f"low_precision_weights needs dtype='bfloat16' (got {dtype!r}): "
                         "float16/float32 weights keep an fp32 master copy")
    return Precision(compute=compute, weights=compute if low_precision_weights else torch.float32)


class ModelDirError(ValueError):
    """A model directory that cannot be used as given; the message is one line naming the argument
    (or flag), the directory, what is wrong and what to pass instead."""


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # what from_pretrained looks for, sharded or not
TOKENIZER_VOCAB_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken")
MODEL_DIR_FIX = ("pass a directory written by save_pretrained with its tokenizer (e.g. a run's "
                 "best/ or checkpoints/iter_N/policy/, or models.tiny's)")


def check_model_dir(path: str | Path, role: str = "model_dir") -> None:
    """Checks, without loading anything, that ``path`` holds what ``from_pretrained`` needs:
    config.json, weights and a tokenizer (tokenizer.json, or tokenizer_config.json with a vocabulary
    file). ``role`` names the argument or flag in the error (e.g. ``"--model_name_or_path"``).
    Raises ``ModelDirError``."""
    directory = Path(path)
    where = f"{role}={str(path)!r}"
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise ModelDirError(f"{where} {problem}: {MODEL_DIR_FIX}")
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        missing.append(f"weights ({' or '.join(WEIGHT_FILES)})")
    has_vocab = any(next(directory.glob(pattern), None) for pattern in TOKENIZER_VOCAB_FILES)
    tokenizer_config = (directory / "tokenizer_config.json").is_file()
    if not ((directory / "tokenizer.json").is_file() or tokenizer_config and has_vocab):
        missing.append("tokenizer (tokenizer.json, or tokenizer_config.json with a vocabulary "
                       "file)")
    if not missing:
        return
    # The two mistakes train_math's layout invites: <run>/checkpoints/iter_N (policy/ inside), <run>
    if (directory / "policy").is_dir() or (directory / "manifest.json").is_file():
        fix = ("this is a checkpoint directory; pass its policy/ subfolder "
               f"({str(directory / 'policy')!r})")
    elif (directory / "checkpoints").is_dir():
        fix = "this is a run directory; pass its best/ subfolder or checkpoints/iter_N/policy/"
    else:
        fix = MODEL_DIR_FIX
    raise ModelDirError(f"{where} has no {', no '.join(missing)}: {fix}")


def load_tokenizer(model_dir: str | Path, role: str = "model_dir") -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model, with a pad token (see ``ensure_pad_token``)."""
    check_model_dir(model_dir, role)
    return ensure_pad_token(AutoTokenizer.from_pretrained(str(model_dir)), str(model_dir))


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, where: str) -> PreTrainedTokenizerBase:
    """A missing pad token becomes eos, with a warning (harmless here: masks never rely on pad
    ids)."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer in {where} has neither a pad nor an eos token; add "
                             "one of them")
        logger.warning("tokenizer in %s has no pad token; using eos %r as pad (masks come from "
                       "lengths)", where, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                   role: str = "model_dir") -> PreTrainedModel:
    """``AutoModelForCausalLM`` from a local directory, with errors that say what to pass
    instead."""
    check_model_dir(model_dir, role)
    path = Path(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except ValueError as error:
        raise ValueError(f"{path} does not hold a causal language model (AutoModelForCausalLM "
                         f"could not load it): {error}") from error
    return model.to(device)


def meta_causal_lm(model_dir: str | Path, dtype: torch.dtype,
                   role: str = "model_dir") -> PreTrainedModel:
    """The causal LM of ``model_dir`` built from its config on the meta device: no weights read and
    no memory taken (its weights arrive later, e.g. broadcast from rank 0 into FSDP2 shards)."""
    check_model_dir(model_dir, role)
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(str(model_dir))
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
