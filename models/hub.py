"""Model locations: a local directory, or a Hugging Face hub id resolved as ``from_pretrained`` resolves it.

A hub id becomes the directory of its snapshot in the Hugging Face cache (HF_HOME / HF_HUB_CACHE),
downloaded when the hub is reachable and taken from the cache when it is not or when HF_HUB_OFFLINE=1.
Everything downstream (directory checks, vLLM, servers) then sees an ordinary local directory.
"""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

IGNORED_FILES = ["*.pth", "*.pt", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.ot", "original/*"]
"""Weight formats transformers' PyTorch loader never reads (other frameworks' copies, raw checkpoints):
left on the hub so a snapshot downloads what from_pretrained would."""


def resolve_model(name_or_path: str, revision: str | None = None, flag: str = "--model_name_or_path") -> Path:
    """The local directory of a model: ``name_or_path`` itself when it exists, else the snapshot of the hub
    id ``name_or_path`` at ``revision`` (a branch, tag or commit; the default branch when None). ``flag``
    names the argument in errors. Raises ``ValueError`` (one line) when the id cannot be resolved."""
    local = Path(name_or_path).expanduser()
    if local.exists():
        return local
    where = f"{flag}={name_or_path!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        snapshot = huggingface_hub.snapshot_download(name_or_path, revision=revision,
                                                     local_files_only=huggingface_hub.is_offline_mode(),
                                                     ignore_patterns=IGNORED_FILES)
    except HFValidationError as error:
        raise ValueError(f"{where} is neither an existing local directory nor a hub id (org/name): "
                         "pass a model directory or a Hugging Face model id") from error
    except LocalEntryNotFoundError as error:
        fetch = f"hf download {name_or_path}" + (f" --revision {revision}" if revision else "")
        raise ValueError(f"{where} is not a local directory and not in the Hugging Face cache "
                         f"({huggingface_hub.constants.HF_HUB_CACHE}) with the hub unreachable or HF_HUB_OFFLINE=1: "
                         f"run `{fetch}` (or `huggingface-cli download`) with network and the same HF_HOME, "
                         "or pass a local directory") from error
    except RevisionNotFoundError as error:
        raise ValueError(f"{where}: the hub has no such revision; pass a branch, tag or commit of "
                         f"{name_or_path}") from error
    except RepositoryNotFoundError as error:
        raise ValueError(f"{where} is not a local directory and the hub has no such model (or it is private or "
                         "gated): check the id, or log in with `hf auth login`") from error
    return Path(snapshot)
