"""A training checkpoint's files on disk: their layout, atomic writing, validation, finding and loading them.
A checkpoint holds everything a run needs to continue exactly where it stopped; what the run puts in it (its
counters and state) is ``train.run_state``'s.

``<run_dir>/checkpoints/iter_N`` (N = completed iterations) holds

    policy/                    LanguagePolicy.save: HF weights and tokenizer (plain transformers and vLLM
                               load them), LoRA adapters (adapters/), value head (critic/)
    train_state/               torch.distributed.checkpoint (DCP): the policy optimizer's state and the
                               trainable parameters policy/ does not hold as trained (LoRA: the adapters
                               and value head; full fine-tuning: the value head alone, the weights are
                               policy/'s, written at the precision the optimizer steps them), each rank
                               writing its own shard (FSDP2), keyed by parameter name so any number of
                               ranks, sharded or not, loads it back
    members/<role>/            each member (a role on a base model of its own, ``train.members``) as the
                               policy is kept: its policy/ and train_state/
    implicit_prm.safetensors   PRIME's implicit PRM weights, when one is trained
    optimizers.pt              the scheduler's state dict, the members' ({role: state dict}) and the implicit
                               PRM optimizer's ("scheduler", "members", "implicit_prm")
    rng.pt                     python, numpy and torch (CPU, CUDA) RNG states and the runner's generators
    trainer_state.json         iteration, env steps, counters, eval history, the env's state (problem
                               sampler position, episodes in progress), the runner's episode returns
    flags.json                 every flag of the run
    manifest.json              written last: format version, iteration, the size of every file above

The weights are there once. Resuming builds the policy as a fresh run does (the frozen base re-read from
the model directory bit for bit), then loads the trained weights of ``policy/`` and ``train_state/``
into it.

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
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, load_model, save_model
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from train import distributed, run_lock
from train.distributed import Ranks
from models.policy import LanguagePolicy

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
POLICY_DIR = "policy"
TRAIN_STATE_DIR = "train_state"
MEMBERS_DIR = "members"
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

    def part(self, member: str | None = None) -> Path:
        """Where the policy's (None) or a member's ``policy/`` and ``train_state/`` are."""
        return self.path if member is None else self.path / MEMBERS_DIR / member

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
         implicit_prm: torch.nn.Module | None = None, ranks: Ranks = Ranks(),
         members: Mapping[str, tuple[LanguagePolicy, torch.optim.Optimizer]] | None = None) -> Path:
    """Writes ``checkpoints_dir/iter_<iteration>`` atomically (see the module docstring); returns it.
    Under torchrun every rank calls it together (the train state and a sharded policy's export are
    collective); rank 0 writes everything else.

    ``optimizer``: the policy's; ``members``: {role: (its policy, its optimizer)}, each kept under
    ``members/<role>/`` as the policy is; ``optimizers``: other state dicts by name (schedulers, implicit PRM);
    ``rng``: tensors and plain values (``rng_state()`` plus the caller's own generators); ``state`` and
    ``flags``: JSON-serialisable. Raises ``CheckpointError`` naming the path when anything fails (disk
    full, unwritable directory); earlier checkpoints are never touched by a failed save.
    """
    parts = {None: (policy, optimizer), **(members or {})}
    tensors = {name: model.full_tensors() for name, (model, _) in parts.items()}  # every rank: sharded ones gather
    in_train_state = [p for model, _ in parts.values() if model.lora is not None
                      for p in model.parameters() if p.requires_grad]
    moments = [list(model_optimizer.state.values()) for _, model_optimizer in parts.values()]
    sharded_bytes = distributed.all_reduce_sum([tensor_bytes(moments, in_train_state)])[0]
    needed = sum(export_bytes(part) for part in tensors.values()) + int(sharded_bytes) + tensor_bytes(
        optimizers, list(implicit_prm.parameters()) if implicit_prm is not None else [])

    def part_dir(directory: Path, name: str | None) -> Path:
        return directory if name is None else directory / MEMBERS_DIR / name

    def fill_train_states(directory: Path) -> None:
        for name, (model, model_optimizer) in parts.items():
            save_train_state(part_dir(directory, name) / TRAIN_STATE_DIR, model, model_optimizer)

    def fill(directory: Path) -> None:
        for name, (model, _) in parts.items():
            model.save(part_dir(directory, name) / POLICY_DIR, tensors[name])
        if implicit_prm is not None:
            save_model(implicit_prm, str(directory / IMPLICIT_PRM_FILE))  # handles tied weights
        torch.save(optimizers, directory / OPTIMIZERS_FILE)
        torch.save(rng, directory / RNG_FILE)
        (directory / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}))
        (directory / FLAGS_FILE).write_text(json.dumps(flags, indent=1, default=str))

    return atomic_write(Path(checkpoints_dir) / f"{PREFIX}{iteration}", iteration, fill,
                        shared_fill=fill_train_states,
                        ranks=ranks, needed_bytes=needed)


def atomic_write(final: Path, iteration: int, fill: Callable[[Path], None], *,
                 shared_fill: Callable[[Path], None] | None = None, ranks: Ranks = Ranks(),
                 needed_bytes: int = 0) -> Path:
    """Runs ``shared_fill(temp_dir)`` on every rank (their collective writes) and ``fill(temp_dir)`` on
    rank 0, fsyncs, writes the manifest last and renames ``temp_dir`` to ``final`` (rank 0). Rank 0 first
    checks that the disk has ``needed_bytes`` (the tensors to write) and a margin free; if not, every rank
    raises ``CheckpointError`` and nothing is written."""
    parent = final.parent
    try:
        temp, too_little = None, None
        if ranks.is_main:
            parent.mkdir(parents=True, exist_ok=True)
            remove_scratch(parent)
            too_little = space_shortfall(parent, needed_bytes)
            if too_little is None:
                temp = parent / f"{SCRATCH}{final.name}-{os.getpid()}"
                temp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would stay on the renamed checkpoint
        temp, too_little = distributed.all_gather_objects((temp, too_little))[0]
        if too_little is not None:
            raise CheckpointError(f"not enough space to save {final}: {too_little}. {intact(final)} Free space, "
                                  f"or {SHRINK}")
        temp = Path(temp)
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
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"could not write checkpoint {final}: {type(error).__name__}: {error}. Nothing of it "
                              f"was kept; {disk_report(parent, needed_bytes)}. {intact(final)} If the disk is full, "
                              f"free space or {SHRINK} If the directory is not writable, pass a writable "
                              "--logdir. Then resume with --resume auto") from error
    return final


SPACE_MARGIN = (1.05, 16 * 2**20)
"""A checkpoint's expected size: its tensors' bytes times 1.05 plus 16 MiB (tokenizer, config, RNG and
trainer state, file-system overhead)."""

SHRINK = ("write fewer or smaller checkpoints: --keep_checkpoints (how many are kept), --save_interval (how "
          "often one is written), --lora_rank (LoRA: adapters and their optimizer state instead of every "
          "weight's), --save_dtype (<run>/best's weights), or --logdir on a larger disk.")


def space_shortfall(directory: Path, needed_bytes: int) -> str | None:
    """What is missing when ``directory``'s file system has less than ``needed_bytes`` (with
    ``SPACE_MARGIN``) free, else None."""
    scale, extra = SPACE_MARGIN
    expected = int(needed_bytes * scale) + extra if needed_bytes else 0
    free = free_bytes(directory)
    if free >= expected:
        return None
    return f"it needs about {human_bytes(expected)}, {directory} has {human_bytes(free)} free"


def disk_report(directory: Path, needed_bytes: int) -> str:
    """``directory``'s free space against what the save needed, and what this run's checkpoints take."""
    free = free_bytes(directory)
    report = f"{directory} has {human_bytes(free)} free (the save needed about {human_bytes(needed_bytes)}"
    report += ": too little)" if free < needed_bytes else ")"
    complete = [path for path in checkpoint_dirs(directory) if invalid_reason(path) is None]
    if complete:
        taken = sum(file.stat().st_size for path in complete for file in path.rglob("*") if file.is_file())
        report += f"; the run's {len(complete)} checkpoint(s) there take {human_bytes(taken)}"
    return report


def free_bytes(path: Path) -> int:
    """Free bytes of the file system holding ``path`` (its nearest existing ancestor when it is absent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def intact(final: Path) -> str:
    """Names the checkpoint a resume would take, which a failed save of ``final`` left as it was."""
    if not final.name.startswith(PREFIX):
        return f"The previous {final.name} is intact." if final.exists() else ""
    last = next((path for path in reversed(checkpoint_dirs(final.parent)) if invalid_reason(path) is None), None)
    return f"The last good checkpoint, {last}, is intact." if last else "No checkpoint of this run was written yet."


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def export_bytes(tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
                 dtype: torch.dtype | None = None) -> int:
    """Bytes of a policy export (``full_tensors``; floating tensors in ``dtype``, None: as held), tied
    tensors once."""
    seen, total = set(), 0
    for tensor in [*tensors[0].values(), *tensors[1].values()]:
        if (tensor.data_ptr(), tensor.shape) in seen:
            continue
        seen.add((tensor.data_ptr(), tensor.shape))
        size = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * size
    return total


def tensor_bytes(*values: Any) -> int:
    """Bytes of the tensors in ``values`` and the dicts, lists and tuples among them (of a sharded tensor,
    this rank's shard)."""
    total = 0
    for value in values:
        if torch.is_tensor(value):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
        elif isinstance(value, dict):
            total += tensor_bytes(*value.values())
        elif isinstance(value, (list, tuple)):
            total += tensor_bytes(*value)
    return total


def save_train_state(directory: Path, policy: LanguagePolicy, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer state and the trainable parameters that ``policy/`` does not hold as trained
    (``in_policy_dir``) as DCP, keyed by parameter name (every rank writes its shard of a sharded policy; a
    whole one is written once)."""
    model_state, optimizer_state = get_state_dict(policy, optimizer, options=TRAIN_STATE_OPTIONS)
    trainable = trainable_names(policy)
    referenced = in_policy_dir(policy, trainable)
    model_state = {name: tensor for name, tensor in model_state.items() if name in trainable - referenced}
    with one_process_quietly():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory,
                 no_dist=not dist.is_initialized())


def trainable_names(policy: LanguagePolicy) -> set[str]:
    """Names of the parameters the optimizer steps (a tied weight under each of its names). The state dict
    DCP gives without frozen parameters still holds a frozen tied weight (a LoRA base's output embedding),
    which this leaves out."""
    return {name for name, param in policy.named_parameters(remove_duplicate=False) if param.requires_grad}


def in_policy_dir(policy: LanguagePolicy, trainable: set[str]) -> set[str]:
    """The trainable parameters ``policy/`` holds bit for bit, which ``train_state/`` therefore leaves out:
    under full fine-tuning every weight of the causal LM (``policy/`` writes them at the precision the
    optimizer steps them). LoRA adapters and value heads stay in ``train_state/`` (they are small, and
    ``policy/`` holds the adapters merged)."""
    return set() if policy.lora is not None else {name for name in trainable if name.startswith("model.")}


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
            holder = run_lock.holder(run_dir)
            if holder is not None:  # the newest run is still training: continuing it would make a second writer
                raise run_lock.in_use(run_dir, holder)
            latest = find_latest(run_dir)
            if latest is not None:
                return latest
        log.info("--resume=auto: no complete checkpoint under %s; starting a new run", experiment_dir)
        return None
    path = Path(resume).expanduser()
    reason = invalid_reason(path)
    if reason is not None:
        raise CheckpointError(f"--resume={resume} is not a complete checkpoint: {reason}. Pass an iter_N directory "
                              "written by this trainer (<logdir>/<experiment>/<run>/checkpoints/iter_N) "
                              "or --resume auto")
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


def load_train_state(saved: Checkpoint, policy: LanguagePolicy, optimizer: torch.optim.Optimizer,
                     member: str | None = None) -> None:
    """Loads the trained weights (``train_state/`` and, for those it leaves out, ``policy/``) into a policy
    built as a fresh run builds it (sharded or not, on any number of ranks: DCP splits each tensor as this
    run holds it) and the optimizer state into its optimizer; ``member``: the role whose part this is (None:
    the policy's). The trainable parameters must be the ones this run builds (LoRA rank and targets, critic)."""
    model_state, optimizer_state = get_state_dict(policy, optimizer, options=TRAIN_STATE_OPTIONS)
    directory = saved.part(member) / TRAIN_STATE_DIR
    if not directory.is_dir():
        raise CheckpointError(f"{saved.path} holds no {directory.relative_to(saved.path)}: it was trained without "
                              f"role {member!r} on a base model of its own; resume with the --role_base_model "
                              "flags it was trained with")
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    stored = {key.removeprefix("model."): tuple(meta.size) for key, meta in metadata.items()
              if key.startswith("model.")}
    trainable = trainable_names(policy)
    # a DTensor's shape is the whole one
    built = {key: tuple(tensor.shape) for key, tensor in model_state.items() if key in trainable}
    referenced = in_policy_dir(policy, trainable)
    needed = {key: shape for key, shape in built.items() if key not in referenced}
    # older checkpoints stored the referenced weights too, and a LoRA base's tied output embedding
    if not needed.items() <= stored.items() or not stored.keys() <= model_state.keys():
        rank_flag = "--lora_rank" if member is None else f"--role_lora_rank {member}=R"
        differ = sorted({key for key, shape in needed.items() if stored.get(key) != shape}
                        | (stored.keys() - model_state.keys()))
        raise CheckpointError(f"{saved.path} holds other trainable parameters than this run builds ({len(differ)} "
                              f"differ in name or shape, e.g. {differ[:2]}): the LoRA rank or targets ({rank_flag}) "
                              "or the critic (--algorithm_name, --critic) changed; resume with the flags it was "
                              "trained with")
    load_policy_weights(saved.part(member) / POLICY_DIR, policy, referenced - stored.keys())
    train_state = {"model": {key: model_state[key] for key in stored.keys() & built.keys()},
                   "optimizer": optimizer_state}
    with one_process_quietly():
        dcp.load(train_state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    set_state_dict(policy, optimizer, model_state_dict=train_state["model"], optim_state_dict=train_state["optimizer"],
                   options=TRAIN_STATE_OPTIONS)


def load_policy_weights(policy_dir: Path, policy: LanguagePolicy, names: set[str]) -> None:
    """Loads the parameters ``names`` (``in_policy_dir``'s) from the HF weights in ``policy_dir`` (a sharded
    policy: rank 0 reads them and each rank receives its shards). A tied weight the file holds once
    (the output embedding) is loaded with the one it is tied to."""
    if not names:
        return
    whole: dict[str, torch.Tensor] = {}
    if not policy.sharded or dist.get_rank() == 0:
        for file in sorted(policy_dir.glob("*.safetensors")):  # model.safetensors, or an index's shards
            whole.update({f"model.{name}": tensor for name, tensor in load_file(file).items()
                          if f"model.{name}" in names})
        parameters = dict(policy.named_parameters(remove_duplicate=False))
        loaded = {id(parameters[name]) for name in whole if name in parameters}
        absent = sorted(name for name in names - whole.keys() if id(parameters.get(name)) not in loaded)
        if absent:
            raise CheckpointError(f"{policy_dir} lacks {len(absent)} trained weights, e.g. {absent[:2]}: it is not "
                                  "the policy/ this checkpoint was written with")
    set_model_state_dict(policy, whole, options=StateDictOptions(full_state_dict=True, strict=False,
                                                                 broadcast_from_rank0=policy.sharded))


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
