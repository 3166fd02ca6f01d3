"""Atomic training checkpoints: everything a run needs to continue exactly where it stopped.

``<run_dir>/checkpoints/iter_N`` (N = completed iterations) holds

    policy/                    LanguagePolicy.save: HF weights and tokenizer (plain transformers and vLLM
                               load them), LoRA adapters (adapters/), value head (critic/)
    train_state/               torch.distributed.checkpoint (DCP): the trainable parameters as trained
                               (LoRA: the adapters and value head; full fine-tuning: every weight) and the
                               policy optimizer's state, each rank writing its own shard (FSDP2), keyed by
                               parameter name so any number of ranks, sharded or not, loads it back
    implicit_prm.safetensors   PRIME's implicit PRM weights, when one is trained
    optimizers.pt              the scheduler's state dict and the implicit PRM optimizer's ("scheduler",
                               "implicit_prm")
    rng.pt                     python, numpy and torch (CPU, CUDA) RNG states and the runner's generators
    trainer_state.json         iteration, env steps, counters, eval history, the env's state (problem
                               sampler position, episodes in progress), the runner's episode returns
    flags.json                 every flag of the run
    manifest.json              written last: format version, iteration, the size of every file above

Resuming builds the policy as a fresh run does (the frozen base re-read from the model directory bit for
bit) and loads ``train_state/`` into it.

Writing is atomic: the files go to a hidden sibling ``.tmp-iter_N-*``, are fsynced, the manifest is
written last, and one ``os.replace`` renames the directory into place. Killed at any moment, a save
leaves either the complete ``iter_N`` or a hidden directory that resuming ignores and the next save
removes. ``iter_N`` counts as a checkpoint only if its manifest parses and every file it lists has the
recorded size; ``find_latest`` reports and skips the others. Under torchrun every rank writes its part
of ``train_state/`` into rank 0's hidden directory (the checkpoint directory must be on storage every
rank sees); rank 0 writes the rest and renames.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_model, save_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from train import distributed
from train.distributed import Ranks
from models.policy import LanguagePolicy

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
POLICY_DIR = "policy"
TRAIN_STATE_DIR = "train_state"
IMPLICIT_PRM_FILE = "implicit_prm.safetensors"
OPTIMIZERS_FILE = "optimizers.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"
FLAGS_FILE = "flags.json"
PREFIX = "iter_"
SCRATCH = ".tmp-"  # temporary and retired directories; never a checkpoint, removed by the next save
DELAY_ENV = "MATHRL_CHECKPOINT_DELAY_S"  # fault tests: sleep between the files and the manifest


# The trainable parameters only (the frozen base is the model directory's); ``strict=False`` since the
# policy also holds those frozen ones.
TRAIN_STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or a directory is not a complete checkpoint."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk: its small parts read, the tensors loaded on demand."""

    path: Path
    iteration: int
    state: dict[str, Any]  # trainer_state.json
    flags: dict[str, Any]  # flags.json

    @property
    def policy_dir(self) -> Path:
        return self.path / POLICY_DIR

    @property
    def run_dir(self) -> Path | None:
        """The run directory it was written in (None if it was moved out of a ``checkpoints`` folder)."""
        return self.path.parent.parent if self.path.parent.name == "checkpoints" else None

    def optimizers(self, device: torch.device | str = "cpu") -> dict[str, Any]:
        """The scheduler's and the implicit PRM optimizer's state dicts (the policy's is in ``train_state/``)."""
        return torch.load(self.path / OPTIMIZERS_FILE, map_location=device, weights_only=True)

    def rng(self) -> dict[str, Any]:
        return torch.load(self.path / RNG_FILE, weights_only=True)

    def load_implicit_prm(self, model: torch.nn.Module) -> None:
        load_model(model, self.path / IMPLICIT_PRM_FILE, device=str(next(model.parameters()).device))


# -------------------------------------------------------------------------------------------------
# Writing
# -------------------------------------------------------------------------------------------------

def save(checkpoints_dir: str | Path, iteration: int, *, policy: LanguagePolicy, optimizer: torch.optim.Optimizer,
         optimizers: dict[str, Any], rng: dict[str, Any], state: dict[str, Any], flags: dict[str, Any],
         implicit_prm: torch.nn.Module | None = None, ranks: Ranks = Ranks()) -> Path:
    """Writes ``checkpoints_dir/iter_<iteration>`` atomically (see the module docstring); returns it.
    Under torchrun every rank calls it together (the train state and a sharded policy's export are
    collective); rank 0 writes everything else.

    ``optimizer``: the policy's; ``optimizers``: other state dicts by name (scheduler, implicit PRM);
    ``rng``: tensors and plain values (``rng_state()`` plus the caller's own generators); ``state`` and
    ``flags``: JSON-serialisable. Raises ``CheckpointError`` naming the path when anything fails (disk
    full, unwritable directory); earlier checkpoints are never touched by a failed save.
    """
    tensors = policy.full_tensors()  # every rank: a sharded policy gathers its weights

    def fill(directory: Path) -> None:
        policy.save(directory / POLICY_DIR, tensors)
        if implicit_prm is not None:
            save_model(implicit_prm, str(directory / IMPLICIT_PRM_FILE))  # handles tied weights
        torch.save(optimizers, directory / OPTIMIZERS_FILE)
        torch.save(rng, directory / RNG_FILE)
        (directory / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}))
        (directory / FLAGS_FILE).write_text(json.dumps(flags, indent=1, default=str))

    return atomic_write(Path(checkpoints_dir) / f"{PREFIX}{iteration}", iteration, fill,
                        shared_fill=lambda directory: save_train_state(directory / TRAIN_STATE_DIR, policy, optimizer),
                        ranks=ranks)


def atomic_write(final: Path, iteration: int, fill: Callable[[Path], None], *,
                 shared_fill: Callable[[Path], None] | None = None, ranks: Ranks = Ranks()) -> Path:
    """Runs ``shared_fill(temp_dir)`` on every rank (their collective writes) and ``fill(temp_dir)`` on
    rank 0, fsyncs, writes the manifest last and renames ``temp_dir`` to ``final`` (rank 0)."""
    parent = final.parent
    try:
        temp = None
        if ranks.is_main:
            parent.mkdir(parents=True, exist_ok=True)
            remove_scratch(parent)
            temp = parent / f"{SCRATCH}{final.name}-{os.getpid()}"
            temp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would stay on the renamed checkpoint
        temp = Path(distributed.all_gather_objects(temp)[0])
        try:
            if shared_fill is not None:
                shared_fill(temp)
            if not ranks.is_main:
                return final
            fill(temp)
            delay = float(os.environ.get(DELAY_ENV, "0"))
            if delay > 0:
                time.sleep(delay)  # lets the fault test kill the process while the files are half written
            files = {str(p.relative_to(temp)): p.stat().st_size for p in sorted(temp.rglob("*")) if p.is_file()}
            manifest = {"format": FORMAT_VERSION, "iteration": iteration, "files": files,
                        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            (temp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            fsync_tree(temp)
            replace_dir(temp, final)
            fsync_path(parent)
        except BaseException:
            if ranks.is_main:  # the error being raised is what matters; a leftover temp dir is removed later
                shutil.rmtree(temp, ignore_errors=True)
            raise
    except Exception as error:
        raise CheckpointError(f"could not write checkpoint {final}: {type(error).__name__}: {error}. Earlier "
                              f"checkpoints in {parent} are intact. If the disk is full or the directory not "
                              "writable, free space or pass a writable --logdir, then resume with --resume auto") from error
    return final


def save_train_state(directory: Path, policy: LanguagePolicy, optimizer: torch.optim.Optimizer) -> None:
    """The trainable parameters and the optimizer state as DCP, keyed by parameter name (every rank
    writes its shard of a sharded policy; a whole one is written once)."""
    model_state, optimizer_state = get_state_dict(policy, optimizer, options=TRAIN_STATE_OPTIONS)
    with one_process_quietly():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory,
                 no_dist=not dist.is_initialized())


@contextlib.contextmanager
def one_process_quietly() -> Iterator[None]:
    """DCP warns on every call without a process group that it assumes one process: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def replace_dir(source: Path, final: Path) -> None:
    """Renames ``source`` to ``final``; an existing ``final`` (the same iteration saved again) is moved
    aside first and deleted after, so a kill in between leaves the new one or nothing, never a mix."""
    retired = None
    if final.exists():
        retired = final.with_name(f"{SCRATCH}{final.name}-replaced-{os.getpid()}")
        os.replace(final, retired)
    os.replace(source, final)
    if retired is not None:
        shutil.rmtree(retired)


def fsync_tree(root: Path) -> None:
    """Flushes every file and directory under ``root`` to disk (a rename is only as durable as its contents)."""
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        fsync_path(path)
    fsync_path(root)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_scratch(checkpoints_dir: Path) -> None:
    """Deletes temporary directories that killed saves or prunes left behind."""
    for path in checkpoints_dir.glob(f"{SCRATCH}*"):
        log.info("removing %s (left by an interrupted checkpoint write)", path)
        shutil.rmtree(path)


def prune(checkpoints_dir: str | Path, keep: int) -> list[Path]:
    """Deletes the oldest complete checkpoints until ``keep`` remain; returns the deleted paths.
    Each is renamed to a scratch name first, so a kill mid-delete never leaves a torn ``iter_N``."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (keep every checkpoint by not pruning)")
    complete = [path for path in checkpoint_dirs(Path(checkpoints_dir)) if invalid_reason(path) is None]
    removed = complete[:-keep]
    for path in removed:
        retired = path.with_name(f"{SCRATCH}{path.name}-pruned")
        os.replace(path, retired)
        shutil.rmtree(retired)
        log.info("pruned checkpoint %s (--keep_checkpoints=%d)", path, keep)
    return removed


# -------------------------------------------------------------------------------------------------
# Finding and reading
# -------------------------------------------------------------------------------------------------

def iteration_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def checkpoint_dirs(checkpoints_dir: Path) -> list[Path]:
    """``iter_N`` directories, oldest (smallest N) first, complete or not."""
    found = [p for p in checkpoints_dir.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=iteration_of)


def invalid_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None if it is one."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (a save that did not finish, or not written by this trainer)"
    except (OSError, ValueError) as error:
        return f"unreadable {MANIFEST}: {error}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        return f"{MANIFEST} is not format {FORMAT_VERSION}"
    if path.name.startswith(PREFIX) and manifest.get("iteration") != iteration_of(path):
        return f"{MANIFEST} says iteration {manifest.get('iteration')}, the directory name {iteration_of(path)}"
    for name, size in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    return None


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir/checkpoints``; newer directories that are not
    complete are logged (with the reason) and skipped. None when there is none."""
    for path in reversed(checkpoint_dirs(Path(run_dir) / "checkpoints")):
        reason = invalid_reason(path)
        if reason is None:
            return path
        log.warning("ignoring %s: %s", path, reason)
    return None


def resolve_resume(resume: str | None, experiment_dir: str | Path) -> Path | None:
    """The checkpoint ``--resume`` names: ``auto`` = the newest complete one of the newest run under
    ``experiment_dir`` that has one (None, a fresh start, when there is none), else the given path,
    which must be complete."""
    if resume is None:
        return None
    if resume == "auto":
        for run_dir in sorted(Path(experiment_dir).glob("*"), reverse=True):  # run_<timestamp>: newest first
            latest = find_latest(run_dir)
            if latest is not None:
                return latest
        log.info("--resume=auto: no complete checkpoint under %s; starting a new run", experiment_dir)
        return None
    path = Path(resume).expanduser()
    reason = invalid_reason(path)
    if reason is not None:
        raise CheckpointError(f"--resume={resume} is not a complete checkpoint: {reason}. Pass an iter_N directory "
                              "written by this trainer (<logdir>/<experiment>/<run>/checkpoints/iter_N) or --resume auto")
    return path


def load(path: str | Path) -> Checkpoint:
    """Reads a complete checkpoint's state and flags (tensors stay on disk until asked for)."""
    path = Path(path)
    reason = invalid_reason(path)
    if reason is not None:
        raise CheckpointError(f"{path} is not a complete checkpoint: {reason}")
    state = json.loads((path / STATE_FILE).read_text())
    return Checkpoint(path=path, iteration=state["iteration"], state=state,
                      flags=json.loads((path / FLAGS_FILE).read_text()))


def load_train_state(saved: Checkpoint, policy: LanguagePolicy, optimizer: torch.optim.Optimizer) -> None:
    """Loads ``train_state/`` into a policy built as a fresh run builds it (sharded or not, on any number
    of ranks: DCP splits each tensor as this run holds it) and its optimizer. The trainable parameters
    must be the ones this run builds (LoRA rank and targets, critic)."""
    model_state, optimizer_state = get_state_dict(policy, optimizer, options=TRAIN_STATE_OPTIONS)
    directory = saved.path / TRAIN_STATE_DIR
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    stored = {key.removeprefix("model."): tuple(meta.size) for key, meta in metadata.items() if key.startswith("model.")}
    built = {key: tuple(tensor.shape) for key, tensor in model_state.items()}  # a DTensor's shape is the whole one
    if stored != built:
        differ = sorted(key for key in stored.keys() | built.keys() if stored.get(key) != built.get(key))
        raise CheckpointError(f"{saved.path} holds other trainable parameters than this run builds ({len(differ)} "
                              f"differ in name or shape, e.g. {differ[:2]}): the LoRA rank or targets (--lora_rank) "
                              "or the critic (--algorithm_name, --critic) changed; resume with the flags it was "
                              "trained with")
    train_state = {"model": model_state, "optimizer": optimizer_state}
    with one_process_quietly():
        dcp.load(train_state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    set_state_dict(policy, optimizer, model_state_dict=train_state["model"], optim_state_dict=train_state["optimizer"],
                   options=TRAIN_STATE_OPTIONS)


def retire_newer(saved: Checkpoint) -> list[Path]:
    """Resuming from an older checkpoint of a run abandons the newer ones: they are renamed
    ``abandoned-iter_N-<time>`` (kept on disk, never picked by ``--resume auto``, never overwritten)."""
    if saved.run_dir is None:
        return []
    stamp = time.strftime("%Y%m%d_%H%M%S")
    retired = []
    for path in checkpoint_dirs(saved.path.parent):
        if iteration_of(path) > saved.iteration:
            target = path.with_name(f"abandoned-{path.name}-{stamp}")
            os.replace(path, target)
            log.warning("resuming from %s: the newer %s is renamed %s (kept, not resumable by --resume auto)",
                        saved.path, path.name, target.name)
            retired.append(target)
    return retired


# -------------------------------------------------------------------------------------------------
# Global RNG states
# -------------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """python, numpy and torch (CPU and every CUDA device) global RNG states, as values
    ``torch.load(weights_only=True)`` accepts."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
