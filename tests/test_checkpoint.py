"""Checkpoints (train/checkpoint_files.py, train/run_state.py): the env's state round trip, atomic writes
that leave the previous checkpoint intact when the disk is full, incomplete directories skipped and
reported, pruning, exact resume (k + resume + k iterations = 2k in one go, same parameters,
optimizer state and logged values), non-finite steps, and a reward model that raises."""

from __future__ import annotations

import errno
import glob
import json
import logging
import math
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from absl import flags
from gymnasium.vector import AutoresetMode
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import train_math
from algorithms.appo import APPO
from envs.datasets import Arith
from envs.rewards import RewardModelError
from envs.vector import MathVectorEnv
from event_files import event_files, read_scalars
from test_env import StepLengthReward
from test_train_math import parse
from test_trainer import run_train_math
from train import builders, checkpoint_files, evaluation
from train.learner import Learner
from train.reporting import write_out
from train.rollouts import Rollouts
from train.runner import STOP_SIGNALS, NonFiniteError, Runner

PROBLEMS = Arith().problems(30, seed=2)


def deterministic_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar except wall-clock ones (time/, perf/)."""
    return {tag: sorted(points) for tag, points in read_scalars(run_dir).items()
            if not tag.startswith(("time/", "perf/"))}


def train_state(checkpoint_dir: Path, scratch: Path) -> dict[str, Any]:
    """``train_state/`` (DCP, read in this one process) flattened: "model/<param>", "optimizer/state/<param>/
    exp_avg", "optimizer/param_groups/0/lr", ... -> tensor or value."""
    dcp_to_torch_save(checkpoint_dir / "train_state", scratch)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, (dict, list)):
            for key, child in (value.items() if isinstance(value, dict) else enumerate(value)):
                walk(f"{prefix}/{key}" if prefix else str(key), child)
        else:
            flat[prefix] = value
    walk("", torch.load(scratch, weights_only=False))
    return flat


def assert_same_training_state(a: Path, b: Path) -> None:
    """Two checkpoints hold bit-identical weights (policy, LoRA adapters, value head, implicit PRM, every
    member's), optimizer moments (the policy's and every member's) and trainer state."""
    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    assert files == sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    for file in files:
        left, right = load_file(a / file), load_file(b / file)
        assert left.keys() == right.keys()
        for name in left:
            assert torch.equal(left[name], right[name]), f"{file}:{name} differs"
    parts = [Path(), *sorted(p.relative_to(a) for p in a.glob("members/*"))]  # the policy's, each member's
    assert parts == [Path(), *sorted(p.relative_to(b) for p in b.glob("members/*"))]
    for part in parts:
        with tempfile.TemporaryDirectory() as scratch:
            state_a, state_b = (train_state(p / part, Path(scratch) / f"{k}.pt") for k, p in enumerate((a, b)))
        assert state_a.keys() == state_b.keys(), part
        assert any(key.endswith("/exp_avg") for key in state_a), f"the run never stepped {part}"
        for key, value in state_a.items():
            assert torch.equal(value, state_b[key]) if torch.is_tensor(value) else value == state_b[key], (part, key)
    optimizers_a, optimizers_b = (torch.load(p / "optimizers.pt", weights_only=True) for p in (a, b))
    assert optimizers_a.get("members") == optimizers_b.get("members")
    assert optimizers_a.keys() == optimizers_b.keys()
    if "implicit_prm" in optimizers_a:
        state_a, state_b = optimizers_a["implicit_prm"]["state"], optimizers_b["implicit_prm"]["state"]
        assert state_a.keys() == state_b.keys()
        for index in state_a:
            for key in state_a[index]:
                assert torch.equal(state_a[index][key], state_b[index][key]), f"implicit PRM {index}/{key} differs"
    assert optimizers_a["scheduler"] == optimizers_b["scheduler"]
    state_a, state_b = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    for state in (state_a, state_b):  # wall clock: the training and evaluation seconds, and each evaluation's
        assert state.pop("seconds") > state.pop("eval_seconds") >= 0  # time/eval and seconds
        state["history"] = [{k: v for k, v in h.items() if not k.startswith("time/") and k != "seconds"}
                            for h in state["history"]]
    assert state_a == state_b


# ---------------------------------------------------------------------------------------------
# The env's state
# ---------------------------------------------------------------------------------------------

def test_vector_env_state_round_trip_continues_identically():
    """Episodes in progress, group bookkeeping and the sampler's epoch position survive a JSON
    round trip: the copy then steps exactly like the original."""
    make = lambda: MathVectorEnv(num_envs=6, group_size=3, problems=PROBLEMS, max_steps=3,  # noqa: E731
                                 autoreset_mode=AutoresetMode.SAME_STEP)
    original = make()
    original.reset(seed=5)
    rng = np.random.default_rng(0)
    choices = ["thinking", "The answer is \\boxed{1}.", "more"]
    for _ in range(4):
        original.step([choices[i] for i in rng.integers(0, 3, 6)])
    copy = make()
    copy.reset(seed=99)
    obs, info = copy.set_state(json.loads(json.dumps(original.get_state())))
    assert obs == original._observations()
    for _ in range(40):  # more than one epoch of the 30 problems
        actions = [choices[i] for i in rng.integers(0, 3, 6)]
        expected, got = original.step(actions), copy.step(actions)
        assert got[0] == expected[0]
        np.testing.assert_array_equal(got[1], expected[1])
        assert list(got[4]["group_id"]) == list(expected[4]["group_id"])
        assert list(got[4]["problem_id"]) == list(expected[4]["problem_id"])


def test_env_state_refuses_another_problem_list_or_shape():
    env = MathVectorEnv(num_envs=4, group_size=2, problems=PROBLEMS)
    env.reset(seed=0)
    state = env.get_state()
    with pytest.raises(ValueError, match="different problem list"):
        MathVectorEnv(num_envs=4, group_size=2, problems=PROBLEMS[:20]).set_state(state)
    with pytest.raises(ValueError, match="4 envs in groups of 2, this env 4 in groups of 4"):
        MathVectorEnv(num_envs=4, group_size=4, problems=PROBLEMS).set_state(state)


# ---------------------------------------------------------------------------------------------
# Writing, finding, pruning
# ---------------------------------------------------------------------------------------------

def write_files(directory: Path) -> None:
    (directory / "weights.bin").write_bytes(b"\0" * 1000)


def test_incomplete_directories_are_skipped_and_reported(tmp_path, caplog):
    checkpoints = tmp_path / "exp" / "run_1" / "checkpoints"
    first = checkpoint_files.atomic_write(checkpoints / "iter_1", 1, write_files)
    checkpoint_files.atomic_write(checkpoints / "iter_3", 3, write_files)
    (checkpoints / "iter_4").mkdir()  # no manifest: a foreign or torn directory
    with open(checkpoints / "iter_3" / "weights.bin", "r+b") as f:
        f.truncate(10)  # manifest present, file cut short
    (checkpoints / ".tmp-iter_5-123").mkdir()  # a save killed mid-write
    with caplog.at_level(logging.WARNING, logger="train.checkpoint_files"):
        assert checkpoint_files.find_latest(tmp_path / "exp" / "run_1") == first
        assert checkpoint_files.resolve_resume("auto", tmp_path / "exp") == first
    assert "iter_4: no manifest.json" in caplog.text
    assert "iter_3: weights.bin has 10 bytes, the manifest says 1000" in caplog.text
    with pytest.raises(checkpoint_files.CheckpointError, match="iter_3 is not a complete checkpoint: weights.bin"):
        checkpoint_files.resolve_resume(str(checkpoints / "iter_3"), tmp_path / "exp")
    assert checkpoint_files.resolve_resume("auto", tmp_path / "empty_experiment") is None  # a fresh start
    checkpoint_files.atomic_write(checkpoints / "iter_6", 6, write_files)
    assert not list(checkpoints.glob(".tmp-*")), "the next save removes what killed saves left"


@pytest.mark.parametrize("code, message", [(errno.ENOSPC, "No space left on device"),
                                           (errno.EIO, "Input/output error")])
def test_failed_write_raises_naming_the_path_and_keeps_the_previous(tmp_path, code, message):
    checkpoints = tmp_path / "checkpoints"
    previous = checkpoint_files.atomic_write(checkpoints / "iter_1", 1, write_files)

    def failing(directory: Path) -> None:
        write_files(directory)
        raise OSError(code, os.strerror(code), str(directory / "more.bin"))

    with pytest.raises(checkpoint_files.CheckpointError, match=rf"could not write checkpoint .*iter_2: OSError: "
                                                         rf".*{message}.* "
                                                         rf"Nothing of it was kept; .* The last good checkpoint, "
                                                         rf"{previous}, is intact"):
        checkpoint_files.atomic_write(checkpoints / "iter_2", 2, failing)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_1"]
    assert checkpoint_files.invalid_reason(previous) is None
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(checkpoint_files.CheckpointError, match=r"could not write checkpoint .*file/iter_1"):
        checkpoint_files.atomic_write(not_a_dir / "iter_1", 1, write_files)


def test_saving_the_same_iteration_again_replaces_it_whole(tmp_path):
    checkpoint_files.atomic_write(tmp_path / "iter_1", 1, write_files)
    checkpoint_files.atomic_write(tmp_path / "iter_1", 1, lambda d: (d / "other.bin").write_bytes(b"x"))
    assert sorted(p.name for p in (tmp_path / "iter_1").iterdir()) == ["manifest.json", "other.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_1"]


def test_prune_deletes_the_oldest_complete_checkpoints(tmp_path):
    for n in (1, 2, 5, 10):
        checkpoint_files.atomic_write(tmp_path / f"iter_{n}", n, write_files)
    (tmp_path / "iter_11").mkdir()  # incomplete: reported by find_latest, never counted or deleted
    removed = checkpoint_files.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["iter_1", "iter_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_10", "iter_11", "iter_5"]


def test_write_out_puts_every_logged_point_in_the_file(tmp_path):
    """What a checkpoint relies on: after write_out, the event file on disk holds every point."""
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(str(tmp_path), purge_step=3)
    for round_ in range(3):
        for step in range(50):
            writer.add_scalar("x", float(step + round_), 50 * round_ + step)
        write_out(writer)
        assert len(read_scalars(tmp_path)["x"]) == 50 * (round_ + 1)
    writer.add_scalar("x", -1.0, 150)
    writer.close()
    points = read_scalars(tmp_path)["x"]
    assert [step for step, _ in points] == list(range(151)) and points[-1] == (150, -1.0)


def test_rng_states_round_trip_through_weights_only_load(tmp_path):
    torch.manual_seed(1)
    np.random.seed(1)
    torch.save(checkpoint_files.rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), __import__("random").random())
    checkpoint_files.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    np.testing.assert_array_equal(np.random.rand(3), expected[1])
    assert __import__("random").random() == expected[2]


# ---------------------------------------------------------------------------------------------
# Through train_math: exact resume, signals, non-finite steps, failures
# ---------------------------------------------------------------------------------------------

def flags_for(policy_dir, logdir, algorithm: str, iterations: int, *extra: str) -> list[str]:
    """Small settings, synchronous collection (exact resume); APPO in step mode so that episodes run
    across iterations (its env state holds episodes in progress); GRPO/RLOO in groups of 2, evaluated
    every 2 iterations."""
    common = ["--model_name_or_path", str(policy_dir), "--logdir", str(logdir), "--n_rollout_threads", "4",
              "--max_new_tokens", "5", "--seed", "3", "--warmup_iterations", "0", "--lr", "1e-3", "--noasync_rollouts"]
    if algorithm == "APPO":
        common += ["--algorithm_name", "APPO", "--action_level", "step", "--episode_length", "2",
                   "--eval_interval", "0", "--num_env_steps", str(8 * iterations)]
    else:
        oversample = 4 if algorithm == "RLOO" else 1  # RLOO steps --oversample_factor (4) times the envs
        common += ["--algorithm_name", algorithm, "--group_size", "2", "--eval_interval", "2", "--eval_limit", "4",
                   "--eval_batch_size", "4", "--num_env_steps", str(4 * oversample * iterations)]
    return common + list(extra)


@pytest.fixture
def length_reward(monkeypatch):
    """train_math's env pays len(step) / 100 (the untrained policy never answers correctly)."""
    monkeypatch.setattr(builders, "build_reward_model", lambda config, device, template: StepLengthReward())


def run_stopped_by_sigterm(monkeypatch, last: int, argv: list[str]) -> str:
    """Runs train_math in this process and sends it SIGTERM right after iteration ``last`` is logged: it
    must save and exit 75 (``train_math.STOPPED_TO_RESUME``), leaving the stop signals ignored until the
    process exits (this one goes on: its handlers are put back). Returns the run directory."""
    log = Runner.log

    def log_then_signal(self, iteration, buffer, stats):
        log(self, iteration, buffer, stats)
        if iteration == last:
            os.kill(os.getpid(), signal.SIGTERM)

    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        with monkeypatch.context() as patch:
            patch.setattr(Runner, "log", log_then_signal)
            with pytest.raises(SystemExit) as stopped:
                run_train_math(argv)
        assert all(signal.getsignal(signum) is signal.SIG_IGN for signum in STOP_SIGNALS)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert stopped.value.code == train_math.STOPPED_TO_RESUME == 75
    return sorted(glob.glob(f"{argv[argv.index('--logdir') + 1]}/*/run_*"))[-1]


@pytest.mark.parametrize("algorithm, extra", [
    pytest.param("APPO", [], marks=pytest.mark.slow),  # APPO runs by default with LoRA and with per-role critics
    ("GRPO", []), ("APPO", ["--lora_rank", "4"]),
    ("RLOO", ["--accuracy_lower_bound", "0"]),  # keeps the groups the untrained policy gets all wrong
    # a LoRA adapter per role of the chain (3 turns per episode: 48 env steps = 4 iterations); the KL term keeps
    # every row in the update, where the untrained roles' equal rewards would leave no advantage
    ("GRPO", ["--env_id", "Arith-Chain-v0", "--noshare_policy", "--lora_rank", "4", "--kl_coef", "0.05",
              "--num_env_steps", "48"]),
    ("APPO", ["--env_id", "Arith-Chain-v0", "--critic", "per_role", "--action_level", "solution",
              "--episode_length", "3", "--num_env_steps", "48"]),
], ids=["APPO", "GRPO", "APPO-LoRA", "RLOO-implicit-PRM", "GRPO-chain-role-adapters", "APPO-chain-per-role-critics"])
def test_k_then_resume_then_k_equals_2k_in_one_go(untrained_policy_dir, tmp_path, monkeypatch, capsys,
                                                 length_reward, algorithm, extra):
    """Stopped by SIGTERM after k iterations and resumed with --resume auto, a run ends with the
    weights, optimizer state, trainer state and TensorBoard scalars of a run never stopped."""
    k = 2
    straight = run_train_math(flags_for(untrained_policy_dir, tmp_path / "straight", algorithm, 2 * k, *extra))
    stopped = run_stopped_by_sigterm(monkeypatch, k - 1, flags_for(untrained_policy_dir, tmp_path / "resumed",
                                                                  algorithm, 2 * k, *extra))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"stopped by SIGTERM after iteration {k}: checkpoint {stopped}/checkpoints/iter_{k}; "
                           "resume with: ") and line.endswith(f"--resume={stopped}/checkpoints/iter_{k}")
    resumed = run_train_math(flags_for(untrained_policy_dir, tmp_path / "resumed", algorithm, 2 * k, *extra,
                                       "--resume", "auto"))
    assert resumed == stopped  # the same run directory, TensorBoard continued in it
    assert_same_training_state(Path(straight) / "checkpoints" / f"iter_{2 * k}",
                               Path(resumed) / "checkpoints" / f"iter_{2 * k}")
    expected, got = deterministic_scalars(straight), deterministic_scalars(resumed)
    assert [step for step, _ in got["train/reward"]] == list(range(2 * k))  # no duplicated or missing points
    assert got == expected
    if "per_role" in extra:  # a value loss for each role's critic
        assert {tag for tag in got if tag.endswith("/value_loss")} == {
            "loss/value_loss", "loss/solver/value_loss", "loss/verifier/value_loss", "loss/refiner/value_loss"}
    if algorithm != "APPO":
        assert [step for step, _ in got["eval/accuracy"]] == [0, 2, 4]  # every 2 iterations and at the end
        history = json.loads((Path(resumed) / "eval_history.json").read_text())
        assert [h["iteration"] for h in history] == [0, 2, 4]


def test_training_seconds_continue_across_a_resume(untrained_policy_dir, tmp_path, monkeypatch):
    """Each evaluation records the run's training wall seconds so far (``seconds``, every evaluation's own
    time excluded), and a resumed run counts on from its checkpoint's instead of from 0: with every update
    slowed by 0.3 s, the evaluation after 2 iterations, a SIGTERM and a resume reports at least the
    stopped run's 0.6 s; with every evaluation batch slowed by 0.3 s too, none of that time counts."""
    delay, train, solve_batch = 0.3, Learner.train, evaluation.solve_batch

    def slow_train(self, *args):
        time.sleep(delay)
        return train(self, *args)

    def slow_solve_batch(*args, **kwargs):
        time.sleep(delay)
        return solve_batch(*args, **kwargs)

    monkeypatch.setattr(Learner, "train", slow_train)
    monkeypatch.setattr(evaluation, "solve_batch", slow_solve_batch)
    run_dir = Path(run_stopped_by_sigterm(monkeypatch, 1, flags_for(untrained_policy_dir, tmp_path, "GRPO", 4)))
    stopped = json.loads((run_dir / "checkpoints" / "iter_2" / "trainer_state.json").read_text())
    trained = stopped["seconds"] - stopped["eval_seconds"]
    assert trained >= 2 * delay
    run_train_math(flags_for(untrained_policy_dir, tmp_path, "GRPO", 4, "--resume", "auto"))
    history = json.loads((run_dir / "eval_history.json").read_text())
    assert [h["iteration"] for h in history] == [0, 2, 4]
    assert history[:1] == stopped["history"]  # the evaluation before the stop, as it was
    seconds = [h["seconds"] for h in history]
    assert 0 <= seconds[0] < 2 * delay <= trained <= seconds[1] < seconds[2]
    assert seconds[2] >= 4 * delay
    final = json.loads((run_dir / "checkpoints" / "iter_4" / "trainer_state.json").read_text())
    eval_seconds = sum(h["time/eval"] for h in history)
    assert eval_seconds >= 3 * delay and final["eval_seconds"] == pytest.approx(eval_seconds)
    assert final["seconds"] - seconds[2] >= eval_seconds  # the last evaluation counted no earlier one


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(untrained_policy_dir, tmp_path, monkeypatch, caplog):
    """A NaN loss at iteration 1 is skipped (the weights do not move) and counted; from iteration 3
    on every loss is NaN: with --max_nonfinite_steps=2 the run stops in iteration 4, naming it and
    the last checkpoint (iter_4, written after iteration 3), which skipped steps left untouched."""
    loss, calls = APPO.loss, []

    def sometimes_nan(self, scores, batch):  # one loss call per iteration with these settings
        calls.append(len(calls))
        value, stats = loss(self, scores, batch)
        return (value * float("nan"), stats) if calls[-1] == 1 or calls[-1] >= 3 else (value, stats)

    monkeypatch.setattr(APPO, "loss", sometimes_nan)
    argv = flags_for(untrained_policy_dir, tmp_path, "APPO", 10, "--save_interval", "1", "--max_nonfinite_steps", "2",
                     "--keep_checkpoints", "0")
    with pytest.raises(NonFiniteError, match=r"iteration 4: 2 optimizer steps in a row had a non-finite loss "
                                             r"\(--max_nonfinite_steps=2\); stopped without saving\. Last good "
                                             r"checkpoint: .*checkpoints/iter_4\."):
        with caplog.at_level(logging.WARNING, logger="train.learner"):
            run_train_math(argv)
    assert "iteration 1: non-finite loss; optimizer step skipped (1 in a row, 1 in the run)" in caplog.text
    (run_dir,) = glob.glob(f"{tmp_path}/APPO_Arith-v0/run_*")
    checkpoints = Path(run_dir) / "checkpoints"
    assert [p.name for p in checkpoint_files.checkpoint_dirs(checkpoints)] == ["iter_1", "iter_2", "iter_3", "iter_4"]
    weights = [load_file(checkpoints / f"iter_{n}" / "policy" / "model.safetensors") for n in (1, 2, 3, 4)]
    same = [all(torch.equal(before[k], after[k]) for k in before) for before, after in zip(weights, weights[1:])]
    assert same == [True, False, True]  # iterations 1 and 3 skipped their step, iteration 2 trained
    counts = read_scalars(run_dir)["train/nonfinite_steps"]
    assert counts == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 2.0)]


class FailingReward(StepLengthReward):
    """Pays like StepLengthReward, then raises on its ``fail_at``-th call."""

    name = "flaky"

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at = fail_at

    def score(self, contexts):
        if len(self.batch_sizes) + 1 == self.fail_at:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return super().score(contexts)


def test_reward_model_error_names_model_and_batch_and_saves_first(untrained_policy_dir, tmp_path, monkeypatch):
    """One scoring call per iteration (solution mode, no eval): the 3rd fails in iteration 2, whose
    start state is saved as iter_2, from which the run then resumes and finishes."""
    monkeypatch.setattr(builders, "build_reward_model", lambda config, device, template: FailingReward(fail_at=3))
    argv = flags_for(untrained_policy_dir, tmp_path, "GRPO", 4, "--eval_interval", "0", "--save_interval", "0")
    with pytest.raises(RewardModelError, match=r"reward model 'flaky' \(FailingReward\) raised RuntimeError: CUDA "
                                               r"error: device-side assert triggered while scoring a batch of 4 steps "
                                               r"of problems \[arith:[^,]+(, arith:[^,]+)*\]$"):
        run_train_math(argv)
    (run_dir,) = glob.glob(f"{tmp_path}/GRPO_Arith-v0/run_*")
    saved = checkpoint_files.find_latest(run_dir)
    assert saved is not None and saved.name == "iter_2"
    monkeypatch.setattr(builders, "build_reward_model", lambda config, device, template: StepLengthReward())
    assert run_train_math([*argv, "--resume", "auto"]) == run_dir
    assert checkpoint_files.find_latest(run_dir).name == "iter_4"


def test_a_write_failing_with_enospc_keeps_nothing_of_it_and_says_so(untrained_policy_dir, tmp_path, monkeypatch,
                                                                      capsys):
    """The disk fills up in the middle of the third save (torch.save raising ENOSPC): the run stops with one
    line naming the checkpoint, the error, the free space and the last good checkpoint; nothing of iter_3
    is left, and iter_2 is what --resume auto takes."""
    save = torch.save

    def full_on_third_save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizers.pt") and ".tmp-iter_3" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_on_third_save)
    argv = flags_for(untrained_policy_dir, tmp_path, "GRPO", 4, "--eval_interval", "0", "--save_interval", "1")
    with pytest.raises(SystemExit) as stopped:
        run_train_math(argv)
    assert stopped.value.code == 1
    (run_dir,) = glob.glob(f"{tmp_path}/GRPO_Arith-v0/run_*")
    checkpoints = Path(run_dir) / "checkpoints"
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert re.fullmatch(rf"train_math.py: error: could not write checkpoint {checkpoints}/iter_3: OSError: "
                        rf"\[Errno 28\] No space left on device: '\S+optimizers.pt'. Nothing of it was kept; "
                        rf"{checkpoints} has [\d.]+ \w+ free \(the save needed about [\d.]+ MiB\); the run's 2 "
                        rf"checkpoint\(s\) there take [\d.]+ MiB. The last good checkpoint, {checkpoints}/iter_2, is "
                        rf"intact. If the disk is full, "
                        rf"free space or write fewer or smaller checkpoints: --keep_checkpoints .*", line), line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_1", "iter_2"]
    assert checkpoint_files.find_latest(run_dir).name == "iter_2"


@pytest.fixture
def small_disk(tmp_path):
    """A 50 MiB tmpfs mounted at tmp_path/disk (root only: skipped elsewhere). A checkpoint of the tiny
    policy takes 13.1 MiB, and a save asks for 29.2 MiB free (its 12.6 MiB of tensors and the margin):
    the third finds 23.9 MiB."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # the failed run left its event file open


def run_on_the_small_disk(policy_dir, small_disk: Path, capsys) -> tuple[Path, str]:
    """A 4-iteration run saving every iteration and keeping every checkpoint, which must stop with exit 1:
    (its checkpoints directory, the last line it wrote to stderr)."""
    argv = flags_for(policy_dir, small_disk, "GRPO", 4, "--eval_interval", "0", "--save_interval", "1",
                     "--keep_checkpoints", "0")
    with pytest.raises(SystemExit) as stopped:
        run_train_math(argv)
    assert stopped.value.code == 1
    (run_dir,) = glob.glob(f"{small_disk}/GRPO_Arith-v0/run_*")
    return Path(run_dir) / "checkpoints", capsys.readouterr().err.strip().splitlines()[-1]


def test_a_full_small_disk_stops_before_the_save_naming_what_and_where(untrained_policy_dir, small_disk, capsys):
    """On a real 50 MiB file system, with every checkpoint kept, the third save finds too little space
    before writing anything: one line names the directory, the size needed, the space free, the last good
    checkpoint and the flags that shrink checkpoints; the two written are intact and nothing else is left."""
    checkpoints, line = run_on_the_small_disk(untrained_policy_dir, small_disk, capsys)
    assert re.fullmatch(rf"train_math.py: error: not enough space to save {checkpoints}/iter_3: it needs about "
                        rf"[\d.]+ MiB, {checkpoints} has [\d.]+ MiB free. The last good checkpoint, "
                        rf"{checkpoints}/iter_2, is intact. Free space, or write fewer or smaller checkpoints: "
                        r"--keep_checkpoints .* --save_interval .* --lora_rank .* or --logdir on a larger disk.",
                        line), line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_1", "iter_2"]
    assert all(checkpoint_files.invalid_reason(checkpoints / name) is None for name in ("iter_1", "iter_2"))


def test_a_save_that_fills_a_real_disk_midway_leaves_no_checkpoint_of_it(untrained_policy_dir, small_disk,
                                                                        monkeypatch, capsys):
    """With the space check blinded (it sees no tensors to write), the fourth save really runs out of space
    on the 50 MiB file system in the middle of its files: the line says so, no iter_4 nor temporary
    directory is left, and iter_3 stays the one to resume."""
    monkeypatch.setattr(checkpoint_files, "export_bytes", lambda tensors, dtype=None: 0)
    monkeypatch.setattr(checkpoint_files, "tensor_bytes", lambda *values: 0)
    checkpoints, line = run_on_the_small_disk(untrained_policy_dir, small_disk, capsys)
    assert line.startswith(f"train_math.py: error: could not write checkpoint {checkpoints}/iter_4: "), line
    assert f"Nothing of it was kept; {checkpoints} has " in line
    assert f"The last good checkpoint, {checkpoints}/iter_3, is intact." in line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_1", "iter_2", "iter_3"]
    assert checkpoint_files.find_latest(checkpoints.parent).name == "iter_3"


def test_unwritable_logdir_fails_before_any_model_loads(untrained_policy_dir, tmp_path, monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("models.policy.LanguagePolicy.__init__", no_model)
    logdir = tmp_path / "not_a_directory"
    logdir.write_text("")
    with pytest.raises(SystemExit) as stopped:
        run_train_math(["--logdir", str(logdir), "--model_name_or_path", str(untrained_policy_dir)])
    assert stopped.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()  # one line, not absl's usage text
    assert f"--logdir={logdir}: cannot write to {logdir}/GRPO_Arith-v0/run_" in line


@pytest.mark.parametrize("argv, message", [
    (["--keep_checkpoints", "-1"], "not a non-negative integer"),
    (["--max_nonfinite_steps", "0"], "not a positive integer"),
    (["--resume", "/no/such/iter_3"], "does not exist"),
])
def test_checkpoint_flags_are_validated(argv, message):
    with pytest.raises(flags.Error, match=message):
        parse(*argv)


def test_resume_of_a_directory_without_manifest_fails_at_parse(tmp_path):
    with pytest.raises(flags.Error, match="has no manifest.json: pass 'auto' or a complete checkpoint"):
        parse("--resume", str(tmp_path))
    parse("--resume", "auto")


class ScheduledVerdicts:
    """Verdicts on finished episodes: during evaluation number k, the first ``accuracies[k] * batch``
    are right; during training every other one."""

    name = "scheduled"

    def __init__(self, accuracies: list[float], batch: int):
        self.accuracies, self.batch, self.eval_index = accuracies, batch, -1

    def score(self, contexts):
        from envs.rewards import RewardOutput

        if self.eval_index >= 0:
            right = round(self.accuracies[self.eval_index] * self.batch)
            verdicts = [float(i < right) for i in range(len(contexts))]
        else:  # training: one of each group of 2 right, so every update moves the weights
            verdicts = [float(i % 2 == 0) for i in range(len(contexts))]
        correct = np.array([v if c.done else np.nan for v, c in zip(verdicts, contexts)])
        return RewardOutput(rewards=np.nan_to_num(correct), sources={self.name: np.nan_to_num(correct)},
                            correct=correct)


def test_best_policy_is_saved_when_eval_accuracy_improves(untrained_policy_dir, tmp_path, monkeypatch):
    """Evals at iterations 0, 2, 4, 6 score 0.25, 0.75, 0.5, 0.75: <run>/best is written at 0 and 2
    only (a tie does not replace it) and holds the weights of iteration 2, loadable by transformers."""
    from transformers import AutoModelForCausalLM

    verdicts = ScheduledVerdicts([0.25, 0.75, 0.5, 0.75], batch=4)
    monkeypatch.setattr(builders, "build_reward_model", lambda config, device, template: verdicts)
    evaluate, saved, evals = Runner.evaluate, [], []

    def counted(self, iteration):
        verdicts.eval_index = len(evals)
        evals.append(iteration)
        result = evaluate(self, iteration)
        verdicts.eval_index = -1
        return result

    save_best = Runner.save_best

    def recorded(self, iteration, accuracy):
        saved.append((iteration, accuracy, {k: v.clone() for k, v in self.policy.causal_lm.state_dict().items()}))
        return save_best(self, iteration, accuracy)

    monkeypatch.setattr(Runner, "evaluate", counted)
    monkeypatch.setattr(Runner, "save_best", recorded)
    run_dir = Path(run_train_math(flags_for(untrained_policy_dir, tmp_path, "GRPO", 6)))
    assert evals == [0, 2, 4, 6]
    assert [(iteration, accuracy) for iteration, accuracy, _ in saved] == [(0, 0.25), (2, 0.75)]
    assert json.loads((run_dir / "best" / "manifest.json").read_text())["iteration"] == 2
    best = AutoModelForCausalLM.from_pretrained(run_dir / "best").state_dict()
    for name, tensor in best.items():
        torch.testing.assert_close(tensor, saved[-1][2][name], rtol=0, atol=0)
    final = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "iter_6" / "policy").state_dict()
    assert any(not torch.equal(final[name], best[name]) for name in best)  # training went on after the best


def test_the_last_checkpoint_is_written_once_and_a_resume_evaluates_each_iteration_once(untrained_policy_dir, tmp_path,
                                                                                      monkeypatch, length_reward):
    """--save_interval 2 over 4 iterations writes iter_2 and iter_4 once each (the final save is the
    periodic one's). Resumed from iter_4, whose history holds the evaluation of iteration 4, with a budget
    of 6: the run does not evaluate iteration 4 again, and TensorBoard still shows it."""
    save, written = checkpoint_files.save, []

    def recorded(checkpoints_dir, iteration, **kwargs):
        written.append(iteration)
        return save(checkpoints_dir, iteration, **kwargs)

    monkeypatch.setattr(checkpoint_files, "save", recorded)
    run_dir = Path(run_train_math(flags_for(untrained_policy_dir, tmp_path, "GRPO", 4, "--save_interval", "2")))
    assert written == [2, 4]
    first = json.loads((run_dir / "eval_history.json").read_text())
    run_train_math(flags_for(untrained_policy_dir, tmp_path, "GRPO", 6, "--save_interval", "2", "--resume", "auto"))
    assert written == [2, 4, 6]
    history = json.loads((run_dir / "eval_history.json").read_text())
    assert [h["iteration"] for h in history] == [0, 2, 4, 6] and history[:3] == first
    assert [step for step, _ in read_scalars(run_dir)["eval/accuracy"]] == [0, 2, 4, 6]


def test_async_rollouts_count_only_the_batches_trained_on(untrained_policy_dir, tmp_path):
    """Under asynchronous rollouts the next batch is collected while one trains: evaluations,
    train/env_steps and train/generated_tokens count the batches handed to the trainer only (4 env steps an
    iteration, each a solution of train/action_tokens tokens on average). The untrained policy earns no outcome
    reward, so every GRPO advantage is 0 and no iteration steps the optimizer: none logs train/trained_samples."""
    run_dir = Path(run_train_math(flags_for(untrained_policy_dir, tmp_path, "GRPO", 4, "--async_rollouts")))
    history = json.loads((run_dir / "eval_history.json").read_text())
    assert [(h["iteration"], h["env_steps"]) for h in history] == [(0, 0), (2, 8), (4, 16)]
    scalars = read_scalars(run_dir)
    assert scalars["train/env_steps"] == [(i, 4.0 * (i + 1)) for i in range(4)]
    tokens = [value for _, value in scalars["train/generated_tokens"]]
    assert np.diff([0.0, *tokens]) == pytest.approx([4 * mean for _, mean in scalars["train/action_tokens"]])
    assert [h["generated_tokens"] for h in history] == [0, tokens[1], tokens[3]] and tokens[0] > 0
    assert scalars["train/optimizer_steps"] == [(i, 0.0) for i in range(4)]
    assert "train/trained_samples" not in scalars


def test_the_async_rollout_copy_holds_bfloat16_weights_in_a_bfloat16_run(untrained_policy_dir, tmp_path,
                                                                         monkeypatch, length_reward):
    """--dtype bfloat16 with asynchronous rollouts: the trainer keeps fp32 master weights, the rollout copy
    bfloat16 ones (half the memory), each refresh its rounding of the trainer's; the run trains on the
    copy's samples (the update steps) and its rollout log-probs are the copy's."""
    seen = {}
    train = Learner.train

    def recorded(self, *args):
        runner_copy = seen["rollouts"].rollout_policy
        seen["copy"] = {p.dtype for p in runner_copy.causal_lm.parameters()}
        seen["trainer"] = {p.dtype for p in self.team.policy.causal_lm.parameters()}
        trained, copied = self.team.policy.causal_lm.state_dict(), runner_copy.causal_lm.state_dict()
        seen["rounded"] = all(torch.equal(trained[name].to(torch.bfloat16), copied[name]) for name in trained)
        return train(self, *args)

    rollouts_init = Rollouts.__init__

    def remember(self, *args, **kwargs):
        rollouts_init(self, *args, **kwargs)
        seen["rollouts"] = self

    monkeypatch.setattr(Learner, "train", recorded)
    monkeypatch.setattr(Rollouts, "__init__", remember)
    run_dir = run_train_math(flags_for(untrained_policy_dir, tmp_path, "GRPO", 2, "--async_rollouts", "--dtype",
                                       "bfloat16", "--eval_interval", "0", "--max_policy_lag", "1"))
    assert seen["copy"] == {torch.bfloat16} and seen["trainer"] == {torch.float32}
    assert seen["rounded"]  # the second batch's copy was refreshed from the weights the first update left
    assert read_scalars(run_dir)["train/optimizer_steps"][-1][1] >= 1


def test_writers_opened_in_the_same_second_keep_their_own_event_files(tmp_path):
    """A resume right after a stop opens a second writer in the run directory, often within the same
    second: tensorboardX alone would name both files alike and the second would overwrite the first."""
    first = train_math.open_writer(tmp_path)
    first.add_scalar("x", 1.0, 0)
    first.close()
    second = train_math.open_writer(tmp_path, purge_step=1)
    second.add_scalar("x", 2.0, 1)
    second.close()
    assert len(glob.glob(f"{tmp_path}/events.out.tfevents.*")) == 2
    assert read_scalars(tmp_path)["x"] == [(0, 1.0), (1, 2.0)]


def test_event_files_are_read_in_name_order_whatever_order_they_were_listed_in(tmp_path):
    """A resumed run's file comes after the run's in name (and time) order; created here the other way
    round, so a reader in the file system's listing order (on tmpfs: newest first) reads [1, 0]."""
    from tensorboardX import SummaryWriter

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step, second in ((1, 1_700_000_001), (0, 1_700_000_000)):  # the later-named file created first
        writer = SummaryWriter(str(tmp_path / str(step)))
        writer.add_scalar("train/optimizer_steps", float(step), step)
        writer.close()
        (written,) = (tmp_path / str(step)).glob("events.out.tfevents.*")
        written.rename(run_dir / f"events.out.tfevents.{second}.host")
    assert [path.name[-15:-5] for path in event_files(run_dir)] == ["1700000000", "1700000001"]
    assert read_scalars(run_dir)["train/optimizer_steps"] == [(0, 0.0), (1, 1.0)]


def test_checkpoints_hold_the_weights_once_and_best_is_exported_in_the_training_dtype(untrained_policy_dir, tmp_path,
                                                                                      length_reward):
    """Full fine-tuning in bfloat16 (fp32 master weights), a checkpoint after each of 3 iterations: the
    default --keep_checkpoints keeps the newest 2; each holds the weights once, in policy/ at the precision
    the optimizer steps them (fp32), its train_state/ only AdamW's two moments of each (twice the weights'
    bytes) and no weight; <run>/best holds bfloat16 weights that transformers loads as such."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run_dir = Path(run_train_math(flags_for(untrained_policy_dir, tmp_path, "GRPO", 3, "--dtype", "bfloat16",
                                            "--save_interval", "1", "--kl_coef", "0.05")))
    checkpoints = run_dir / "checkpoints"
    assert [p.name for p in checkpoint_files.checkpoint_dirs(checkpoints)] == ["iter_2", "iter_3"]
    last = checkpoints / "iter_3"
    with safe_open(last / "policy" / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
        weight_bytes = sum(math.prod(weights.get_slice(name).get_shape()) * 4 for name in weights.keys())
    assert dtypes == {"F32"}
    metadata = torch.distributed.checkpoint.FileSystemReader(last / "train_state").read_metadata()
    assert not [key for key in metadata.state_dict_metadata if key.startswith("model.")]
    moments = sum(meta.size.numel() * 4 for key, meta in metadata.state_dict_metadata.items()
                  if key.endswith(("exp_avg", "exp_avg_sq")))
    assert moments == 2 * weight_bytes
    state_bytes = sum(p.stat().st_size for p in (last / "train_state").rglob("*") if p.is_file())
    assert moments <= state_bytes < moments * 1.05
    best = run_dir / "best"
    with safe_open(best / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    assert json.loads((best / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(best, dtype="auto").dtype == torch.bfloat16


def test_lora_checkpoints_hold_no_frozen_weight_and_older_full_checkpoints_resume(untrained_policy_dir, tmp_path,
                                                                                   monkeypatch, length_reward):
    """A LoRA checkpoint's train_state/ holds adapters (and a value head) only, not the frozen base's tied
    output embedding. A full fine-tuning checkpoint whose train_state/ holds the weights too (as written
    before they were held once) resumes to the weights and optimizer state of a run never stopped."""
    lora = Path(run_train_math(flags_for(untrained_policy_dir, tmp_path / "lora", "APPO", 1, "--lora_rank", "4")))
    metadata = torch.distributed.checkpoint.FileSystemReader(lora / "checkpoints" / "iter_1" / "train_state")
    stored = [key for key in metadata.read_metadata().state_dict_metadata if key.startswith("model.")]
    assert stored and all("lora_" in key or "value_head" in key for key in stored), stored
    straight = Path(run_train_math(flags_for(untrained_policy_dir, tmp_path / "straight", "GRPO", 4)))
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_files, "in_policy_dir", lambda policy, trained: set())
        older = Path(run_stopped_by_sigterm(patch, 1, flags_for(untrained_policy_dir, tmp_path / "older", "GRPO", 4)))
    metadata = torch.distributed.checkpoint.FileSystemReader(older / "checkpoints" / "iter_2" / "train_state")
    assert any(key.startswith("model.model.") for key in metadata.read_metadata().state_dict_metadata)
    run_train_math(flags_for(untrained_policy_dir, tmp_path / "older", "GRPO", 4, "--resume", "auto"))
    assert_same_training_state(straight / "checkpoints" / "iter_4", older / "checkpoints" / "iter_4")
