"""Atomic training checkpoints: everything a run needs to continue exactly where it stopped.

``<run_dir>/checkpoints/iter_N`` (N = completed iterations) holds

    policy/                    LanguagePolicy.save: HF weights and tokenizer (plain transformers and vLLM
                               load them), LoRA adapters (adapters/), value head (critic/)
    trainable.safetensors      LoRA only: the trainable parameters (adapters, value head) as trained, so
                               that resuming re-reads the frozen base from the model directory bit for bit
                               instead of recovering it from the merged weights (off by rounding)
    implicit_prm.safetensors   PRIME's implicit PRM weights, when one is trained
    optimizers.pt              optimizer and scheduler state dicts ("policy", "scheduler", "implicit_prm")
    rng.pt                     python, numpy and torch (CPU, CUDA) RNG states and the runner's generators
    trainer_state.json         iteration, env steps, counters, eval history, the env's state (problem
                               sampler position, episodes in progress), the runner's episode returns
    flags.json                 every flag of the run
    manifest.json              written last: format version, iteration, the size of every file above

Writing is atomic: the files go to a hidden sibling ``.tmp-iter_N-*``, are fsynced, the manifest is
written last, and one ``os.replace`` renames the directory into place. Killed at any moment, a save
leaves either the complete ``iter_N`` or a hidden directory that resuming ignores and the next save
removes. ``iter_N`` counts as a checkpoint only if its manifest parses and every file it lists has the
recorded size; ``find_latest`` reports and skips the others.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from train.models.policy import LanguagePolicy, LoraSettings

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
POLICY_DIR = "policy"
IMPLICIT_PRM_FILE = "implicit_prm.safetensors"
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZERS_FILE = "optimizers.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"
FLAGS_FILE = "flags.json"
PREFIX = "iter_"
SCRATCH = ".tmp-"  # temporary and retired directories; never a checkpoint, removed by the next save
DELAY_ENV = "MATHRL_CHECKPOINT_DELAY_S"  # fault tests: sleep between the files and the manifest


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
        return torch.load(self.path / OPTIMIZERS_FILE, map_location=device, weights_only=True)

    def rng(self) -> dict[str, Any]:
        return torch.load(self.path / RNG_FILE, weights_only=True)

    def load_implicit_prm(self, model: torch.nn.Module) -> None:
        load_model(model, self.path / IMPLICIT_PRM_FILE, device=str(next(model.parameters()).device))


# -------------------------------------------------------------------------------------------------
# Writing
# -------------------------------------------------------------------------------------------------

def save(checkpoints_dir: str | Path, iteration: int, *, policy: LanguagePolicy, optimizers: dict[str, Any],
         rng: dict[str, Any], state: dict[str, Any], flags: dict[str, Any],
         implicit_prm: torch.nn.Module | None = None) -> Path:
    """Writes ``checkpoints_dir/iter_<iteration>`` atomically (see the module docstring); returns it.

    ``optimizers``: state dicts by name; ``rng``: tensors and plain values (``rng_state()`` plus the
    caller's own generators); ``state`` and ``flags``: JSON-serialisable. Raises ``CheckpointError``
    naming the path when anything fails (disk full, unwritable directory); earlier checkpoints are
    never touched by a failed save.
    """
    def fill(directory: Path) -> None:
        policy.save(directory / POLICY_DIR)
        if policy.lora is not None:
            save_file(trainable_parameters(policy), directory / TRAINABLE_FILE)
        if implicit_prm is not None:
            save_model(implicit_prm, str(directory / IMPLICIT_PRM_FILE))  # handles tied weights
        torch.save(optimizers, directory / OPTIMIZERS_FILE)
        torch.save(rng, directory / RNG_FILE)
        (directory / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}))
        (directory / FLAGS_FILE).write_text(json.dumps(flags, indent=1, default=str))

    return atomic_write(Path(checkpoints_dir) / f"{PREFIX}{iteration}", iteration, fill)


def atomic_write(final: Path, iteration: int, fill: Callable[[Path], None]) -> Path:
    """Runs ``fill(temp_dir)``, fsyncs, writes the manifest last and renames ``temp_dir`` to ``final``."""
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_scratch(parent)
        temp = parent / f"{SCRATCH}{final.name}-{os.getpid()}"
        temp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would stay on the renamed checkpoint
        try:
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
            # The error being raised is what matters; a leftover temp dir is skipped and removed later.
            shutil.rmtree(temp, ignore_errors=True)
            raise
    except Exception as error:
        raise CheckpointError(f"could not write checkpoint {final}: {type(error).__name__}: {error}. Earlier "
                              f"checkpoints in {parent} are intact. If the disk is full or the directory not "
                              "writable, free space or pass a writable --logdir, then resume with --resume auto") from error
    return final


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


def trainable_parameters(policy: LanguagePolicy) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous() for name, p in policy.named_parameters() if p.requires_grad}


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


def load_policy(saved: Checkpoint, model_dir: str | Path, lora: LoraSettings | None, with_critic: bool,
                **kwargs) -> LanguagePolicy:
    """The policy as saved, bit for bit (``kwargs``: device, dtype, ...). Full fine-tuning:
    ``LanguagePolicy.load`` of ``policy/``. LoRA: built on ``model_dir`` as a fresh run builds it, then
    the adapters and value head of ``trainable.safetensors`` loaded into it. ``lora`` and
    ``with_critic`` are this run's settings and must match the checkpoint's."""
    trained_with_lora = (saved.path / TRAINABLE_FILE).is_file()
    if trained_with_lora != (lora is not None):
        raise CheckpointError(f"{saved.path} was trained {'with' if trained_with_lora else 'without'} LoRA but this "
                              f"run has --lora_rank={lora.rank if lora else 0}: resume with the --lora_rank it was "
                              "trained with")
    if lora is None:
        policy = LanguagePolicy.load(saved.policy_dir, **kwargs)
    else:
        policy = LanguagePolicy(model_dir, lora=lora, with_critic=with_critic, **kwargs)
        trainable = load_file(saved.path / TRAINABLE_FILE, device=str(policy.device))
        expected = {name: tuple(p.shape) for name, p in trainable_parameters(policy).items()}
        if expected != {name: tuple(t.shape) for name, t in trainable.items()}:
            raise CheckpointError(f"{saved.path} holds other trainable parameters than this run builds (LoRA rank "
                                  "or targets, critic): resume with the flags it was trained with")
        policy.load_state_dict(trainable, strict=False)
    if policy.with_critic != with_critic:
        raise CheckpointError(f"{saved.path} {'has a' if policy.with_critic else 'has no'} critic but this run's "
                              f"algorithm {'trains one' if with_critic else 'uses none'}: resume with the algorithm "
                              "it was trained with")
    return policy


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
