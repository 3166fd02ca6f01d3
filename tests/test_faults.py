"""Faults from outside the trainer: SIGTERM or SIGUSR1 on a running train_math.py (saves, exits 75,
prints the command that resumes), sent again or followed by SIGINT (ignored: the same, and the run resumes
exactly), a second writer on the same run (refused by the run's lock), generations the env must survive,
and (slow) SIGKILL at random moments, including in the middle of checkpoint writes, each followed by
``--resume auto``: it always resumes from the last complete checkpoint, and the run it finishes equals a
run never killed."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from envs.vector import MathVectorEnv
from fault_proxy import FaultProxy
from reward_models.prm import ProcessRewardModel
from test_checkpoint import assert_same_training_state, deterministic_scalars
from test_distributed import TORCHRUN, worker_pids
from test_prm_server import serving, stop
from train import checkpoint_files
from train.run_state import RunProgress
from train.runner import STOP_SIGNALS, Runner

ROOT = Path(__file__).resolve().parents[1]


def train_command(policy_dir, logdir, iterations: int, *extra: str) -> list[str]:
    """APPO (critic: every iteration steps the optimizer even though the untrained policy earns no
    reward), synchronous, steps as actions so episodes span iterations; 8 envs x 2 steps. The
    learning-rate flags are pinned so that a default changed while the test runs cannot make the
    reference and the killed runs differ."""
    return [sys.executable, str(ROOT / "train_math.py"), "--model_name_or_path", str(policy_dir),
            "--logdir", str(logdir), "--algorithm_name", "APPO", "--noasync_rollouts", "--action_level", "step",
            "--episode_length", "2", "--n_rollout_threads", "8", "--max_new_tokens", "8", "--eval_interval", "0",
            "--lr", "1e-4", "--warmup_iterations", "20", "--lr_schedule", "linear",
            "--num_env_steps", str(16 * iterations), *extra]


def child_env(checkpoint_delay: float = 0.0) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", checkpoint_files.DELAY_ENV: str(checkpoint_delay)}


def wait_for(condition, process: subprocess.Popen, timeout: float):
    """Polls ``condition()`` until it returns something truthy (returned), the process exits or time runs out (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        found = condition()
        if found:
            return found
        time.sleep(0.01)
    return None


def launch(command: list[str], log: Path, **kwargs) -> subprocess.Popen:
    with open(log, "w") as stderr:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT, **kwargs)


def wait_until_training(process: subprocess.Popen, log: Path) -> None:
    """Waits until the progress bar shows a finished iteration."""
    assert wait_for(lambda: re.search(r"APPO: +\d+%.*\| [1-9]\d*/", log.read_text()), process, 120), log.read_text()


# by default SIGTERM's save, exit 75 and printed command are run by the repeated-signal test below, and SIGUSR1's
# through the sbatch script
@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_saves_exits_75_and_prints_the_command_that_resumes(untrained_policy_dir, tmp_path, stop):
    """SIGTERM (a scheduler's stop) or SIGUSR1 (SLURM's --signal warning): the iteration finishes, the
    checkpoint is written, the exit status is 75 (train_math.STOPPED_TO_RESUME) and the printed command
    resumes it and finishes."""
    command = train_command(untrained_policy_dir, tmp_path, 10_000, "--save_interval", "0")
    process = launch(command, tmp_path / "train.log", env=child_env())
    wait_until_training(process, tmp_path / "train.log")
    process.send_signal(stop)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 75, (tmp_path / "train.log").read_text()[-3000:]
    match = re.fullmatch(rf"stopped by {stop.name} after iteration (\d+): checkpoint (\S+); resume with: (.+)",
                         out.strip())
    assert match, out
    iteration, path = int(match[1]), Path(match[2])
    assert iteration >= 1 and path.name == f"iter_{iteration}" and checkpoint_files.invalid_reason(path) is None
    assert shlex.split(match[3]) == [*command, f"--resume={path}"]  # this command with --resume added
    budget = ["--num_env_steps", str(16 * (iteration + 1))]  # one more iteration
    resumed = subprocess.run([*shlex.split(match[3]), *budget], capture_output=True, text=True, env=child_env(),
                             cwd=ROOT, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {path} (iteration {iteration})" in resumed.stderr
    assert checkpoint_files.find_latest(path.parents[1]).name == f"iter_{iteration + 1}"


@pytest.mark.parametrize("first", STOP_SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("then", STOP_SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("exit_after_stop", [True, False], ids=["command-line", "library"])
def test_once_a_run_stops_only_a_second_sigint_interrupts_it(first, then, exit_after_stop, caplog):
    """The runner's handlers, sent real signals: the first asks for the stop; then SIGINT after SIGINT (Ctrl-C
    twice) interrupts at once, and every other one, sent twice, is ignored and logged once; after the run the
    three stay ignored until the process exits (train_math), or the handlers before come back (a library
    caller that goes on, e.g. a notebook whose next Ctrl-C must still interrupt)."""
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    runner = SimpleNamespace(stop_signal=None, progress=RunProgress())  # all the handlers read of a Runner
    try:
        with Runner.signals_stop_after_iteration(runner, exit_after_stop):
            signal.raise_signal(first)
            if first == then == signal.SIGINT:
                with pytest.raises(KeyboardInterrupt, match="second SIGINT: stopping without saving"):
                    signal.raise_signal(then)
            else:
                signal.raise_signal(then)
                signal.raise_signal(then)
        assert runner.stop_signal == first.name
        ignored = [r.message for r in caplog.records if "while stopping" in r.message]
        assert ignored == ([] if first == then == signal.SIGINT else
                           [f"{then.name} received while stopping for {first.name}: ignored, the checkpoint is still "
                            "written"])
        after = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        assert after == (dict.fromkeys(STOP_SIGNALS, signal.SIG_IGN) if exit_after_stop else handlers)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


REPEATED = [  # the signal that stops the run, what follows it 0.3 s apart, when that starts, ranks
    pytest.param(signal.SIGTERM, [signal.SIGTERM], "0.3 s later", 1, id="SIGTERM-twice"),
    pytest.param(signal.SIGTERM, [signal.SIGTERM, signal.SIGTERM], "in its save", 1, marks=pytest.mark.slow,
                 id="SIGTERM-twice-in-its-save"),
    pytest.param(signal.SIGUSR1, [signal.SIGINT], "0.3 s later", 1, marks=pytest.mark.slow, id="SIGUSR1-then-SIGINT"),
    pytest.param(signal.SIGTERM, [signal.SIGINT], "in its save", 1, marks=pytest.mark.slow,
                 id="SIGTERM-then-SIGINT-in-its-save"),
    pytest.param(signal.SIGTERM, [signal.SIGTERM], "0.3 s later", 2, marks=pytest.mark.slow, id="torchrun"),
]


@pytest.mark.parametrize("first, then, when, ranks", REPEATED)
def test_a_repeated_stop_signal_is_ignored_and_the_checkpoint_resumes_exactly(untrained_policy_dir, tmp_path, first,
                                                                              then, when, ranks):
    """A stop signal sent again (GNU ``timeout`` signals the command, then its process group), or a SIGINT after
    one, while the run finishes its iteration or writes its checkpoint: ignored (one line in the log), the
    checkpoint is written, the run exits 75, and ``--resume auto`` ends where a run never stopped ends (weights,
    optimizer state, scalars). Under torchrun the first signal goes to torchrun, which passes it on to its
    ranks, and the ones after to every rank (a scheduler signalling every process of the job)."""
    iterations = 6
    launcher = [*TORCHRUN, "--nproc_per_node", "2"] if ranks > 1 else [sys.executable]

    def command(name: str, *extra: str) -> list[str]:
        return [*launcher, *train_command(untrained_policy_dir, tmp_path / name, iterations, "--save_interval", "0",
                                          *extra)[1:]]

    reference = launch(command("reference"), tmp_path / "reference.log", env=child_env())
    log = tmp_path / "stopped.log"
    process = launch(command("stopped"), log, env=child_env(checkpoint_delay=1.0))  # a save takes 1 s or more
    try:
        wait_until_training(process, log)
        process.send_signal(first)
        if when == "in its save":
            assert wait_for(lambda: list(tmp_path.glob("stopped/*/*/checkpoints/.tmp-iter_*/rng.pt")), process,
                            60), log.read_text()[-3000:]
        targets = list(worker_pids(process).values()) if ranks > 1 else [process.pid]
        for repeat in then:
            time.sleep(0.3)
            for pid in targets:
                os.kill(pid, repeat)
        out, _ = process.communicate(timeout=120)
        text = log.read_text()
        assert process.returncode == (75 if ranks == 1 else 1), text[-3000:]  # torchrun ends 1 on a signal
        match = re.search(rf"stopped by {first.name} after iteration (\d+): checkpoint (\S+); resume with: (.+)", out)
        assert match, text[-3000:]
        stopped_at, path = int(match[1]), Path(match[2])
        assert stopped_at < iterations and checkpoint_files.invalid_reason(path) is None
        if ranks == 1:
            assert shlex.split(match[3]) == [*command("stopped"), f"--resume={path}"]
        assert text.count(f"{then[0].name} received while stopping for {first.name}: ignored") == ranks, text[-3000:]
        resumed = subprocess.run(command("stopped", "--resume", "auto"), capture_output=True, text=True,
                                 env=child_env(), cwd=ROOT, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resuming from {path} (iteration {stopped_at})" in resumed.stderr
        assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    finally:
        process.kill()
        reference.kill()
    (reference_dir,), run_dir = (tmp_path / "reference").glob("*/run_*"), path.parents[1]
    assert_same_training_state(reference_dir / "checkpoints" / f"iter_{iterations}",
                               run_dir / "checkpoints" / f"iter_{iterations}")
    scalars = deterministic_scalars(run_dir)
    assert [step for step, _ in scalars["train/reward"]] == list(range(iterations))
    assert scalars == deterministic_scalars(reference_dir)


def sbatch_script() -> str:
    """docs/distributed.md's SLURM script (the lines its block writes to train.sbatch)."""
    page = (ROOT / "docs" / "distributed.md").read_text()
    return re.search(r"^cat > train.sbatch <<'SCRIPT'\n(.*?)^SCRIPT$", page, flags=re.M | re.S)[1]


def test_the_sbatch_requeue_script_saves_requeues_and_resumes(untrained_policy_dir, tmp_path):
    """docs/distributed.md's script, run by bash as SLURM runs a batch script, with a stand-in scontrol
    that records its arguments: SIGUSR1 to the script (what --signal=B:USR1@... sends) reaches the
    trainer, which saves and exits 75; the script requeues the job and exits 75. The requeued script
    (the same command) resumes from that checkpoint and finishes (exit 0) without requeueing."""
    script, bin_dir = tmp_path / "train.sbatch", tmp_path / "bin"
    script.write_text(sbatch_script())
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.calls"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {**child_env(), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "recipe"}
    flags = train_command(untrained_policy_dir, tmp_path, 10_000, "--save_interval", "0")[2:]
    job = launch(["bash", str(script), *flags], tmp_path / "job.log", env=env)
    wait_until_training(job, tmp_path / "job.log")
    job.send_signal(signal.SIGUSR1)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 75, (tmp_path / "job.log").read_text()[-3000:]
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"
    match = re.search(r"stopped by SIGUSR1 after iteration (\d+): checkpoint (\S+);", out)
    assert match, out
    iteration = int(match[1])
    assert Path(match[2]).parts[-4] == "recipe"  # the experiment is the job's name
    requeued = subprocess.run(["bash", str(script), *flags, "--num_env_steps", str(16 * (iteration + 1))],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"resuming from {match[2]} (iteration {iteration})" in requeued.stderr
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"


HOLD_LOCK = ("import sys, time; from train import run_lock; run_lock.acquire(sys.argv[1]); print('held', flush=True); "
             "time.sleep(600)")


def test_a_second_writer_stops_naming_the_holder_and_a_killed_holders_lock_is_taken(tmp_path):
    """A process holds a run directory's lock; another asking for it gets an error naming the holder's pid
    and host; once the holder is SIGKILLed the kernel has released the lock, and the next one takes it."""
    import socket

    from train import run_lock

    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        who = f"pid {holder.pid} on host {socket.gethostname()} (since "
        assert run_lock.holder(tmp_path).startswith(who)
        with pytest.raises(run_lock.RunLockedError, match=re.escape(f"{tmp_path.resolve()} is in use by {who}")):
            run_lock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert run_lock.holder(tmp_path) is None
    run_lock.acquire(tmp_path)
    try:
        assert run_lock.holder(tmp_path) == "this process"
        assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        run_lock.release(tmp_path)


def test_resume_auto_of_a_run_still_training_stops_before_touching_it(untrained_policy_dir, tmp_path):
    """What a scheduler's requeue does while the old process lingers: ``--resume auto`` on the same
    experiment. It stops with one line naming the holder, and the run directory is as it was (no second
    event file, no checkpoint renamed); the first run goes on and saves when stopped."""
    command = train_command(untrained_policy_dir, tmp_path, 10_000, "--save_interval", "1", "--resume", "auto")
    first = launch(command, tmp_path / "first.log", env=child_env())
    try:
        wait_until_training(first, tmp_path / "first.log")
        (run_dir,) = tmp_path.glob("APPO_Arith-v0/run_*")
        second = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=300)
        assert second.returncode == 1
        (line,) = [line for line in second.stderr.splitlines() if "error" in line]
        assert line == (f"train_math.py: error: {run_dir} is in use by pid {first.pid} on host "
                        f"{__import__('socket').gethostname()} (since " + line.split("(since ")[1])
        assert "one process writes a run at a time" in line
        assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
        assert not list(run_dir.glob("checkpoints/abandoned-*"))
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 75, (tmp_path / "first.log").read_text()[-3000:]


def test_env_survives_empty_non_utf8_and_huge_generations(tiny_tokenizer):
    """What a policy may emit: nothing, bytes that are not UTF-8 (decoded to U+FFFD), lone
    surrogates and NUL, a 200,000-digit \\boxed{}, a megabyte with no answer. Each step is graded
    (0, wrong or no answer) within the grader's time bound, and the env goes on."""
    invalid_utf8 = tiny_tokenizer.decode(tiny_tokenizer.convert_tokens_to_ids(["Ã", "ÿ", "Ĳ"]))
    assert "\ufffd" in invalid_utf8
    actions = ["", invalid_utf8 + " The answer is \\boxed{" + invalid_utf8 + "}", "\udcff\x00 \\boxed{\ud800}",
               "\\boxed{" + "9" * 200_000 + "}", "x" * 1_000_000]
    env = MathVectorEnv(num_envs=len(actions), arith={}, max_steps=2, max_step_chars=300_000,
                        max_solution_chars=300_000)
    env.reset(seed=0)
    started = time.perf_counter()
    obs, rewards, terminated, truncated, info = env.step(actions)
    assert time.perf_counter() - started < 20
    np.testing.assert_array_equal(rewards, 0.0)
    assert terminated.tolist() == [False, True, True, True, False]
    assert truncated.tolist() == [False, False, False, False, True]  # the megabyte was clipped, then too long
    assert info["correct"][terminated | truncated].tolist() == [0.0, 0.0, 0.0, 0.0]
    obs, rewards, terminated, truncated, _ = env.step(["The answer is \\boxed{0}."] * len(actions))
    assert terminated[0] and all(isinstance(o, str) for o in obs)


@pytest.fixture
def prm_proxy(untrained_policy_dir):
    """A served PRM (the untrained tiny policy read as a shepherd PRM, served as "tiny") behind a FaultProxy."""
    server = serving(ProcessRewardModel(untrained_policy_dir, device="cpu", check_labels=False))
    try:
        with FaultProxy(server.url) as proxy:
            yield proxy
    finally:
        stop(server)


def served_prm_command(policy_dir, logdir, prm_url: str, iterations: int, ranks: int, save_interval: int) -> list[str]:
    """APPO in steps with the default asynchronous rollouts, paid by the PRM at --prm_url (4 requests at
    start-up and rank: /health and /v1/models for the train and the eval env; then 2 per iteration and rank,
    one per env step); no retries, so that a dead server fails the run at once."""
    launcher = [*TORCHRUN, "--nproc_per_node", str(ranks)] if ranks > 1 else [sys.executable]
    return [*launcher, str(ROOT / "train_math.py"), "--model_name_or_path", str(policy_dir), "--logdir", str(logdir),
            "--algorithm_name", "APPO", "--action_level", "step", "--episode_length", "2", "--max_new_tokens", "8",
            "--n_rollout_threads", str(4 * ranks), "--eval_interval", "0", "--save_interval", str(save_interval),
            "--reward", "outcome:1.0,prm:0.2", "--prm_url", prm_url, "--prm_model_name", "tiny",
            "--service_retries", "0", "--dist_timeout", "60", "--num_env_steps", str(8 * ranks * iterations)]


def test_a_prm_server_dying_under_async_rollouts_leaves_a_state_that_resumes(untrained_policy_dir, tmp_path,
                                                                            prm_proxy):
    """The server stops answering in the 4th iteration's batch, which the rollout thread collects while
    the 3rd trains: with no checkpoint before the end (--save_interval 0), the run saves the state at the
    start of the 4th (iter_3, the env before that batch), names it in the command it prints, and that
    command finishes the run once the server is back."""
    prm_proxy.fail_from = 4 + 2 * 3
    command = served_prm_command(untrained_policy_dir, tmp_path, prm_proxy.url, iterations=5, ranks=1, save_interval=0)
    failed = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=300)
    assert failed.returncode == 1, failed.stderr[-3000:]
    line = failed.stderr.strip().splitlines()[-1]
    match = re.search(r"The state before the failure is saved; once the server is back, resume with: (.+)$", line)
    assert line.startswith("train_math.py: error: ") and match, failed.stderr[-3000:]
    resume = shlex.split(match[1])
    path = Path(resume[-1].removeprefix("--resume="))
    assert path.name == "iter_3" and checkpoint_files.invalid_reason(path) is None, line
    assert checkpoint_files.load(path).state["env_steps"] == 3 * 8  # the failed batch's steps are not in it
    prm_proxy.fail_from = None
    resumed = subprocess.run(resume, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert checkpoint_files.find_latest(path.parents[1]).name == "iter_5"


@pytest.mark.slow  # 25 s; a dead server in one process and a failing rank under torchrun run by default
def test_a_prm_server_dying_under_two_ranks_names_the_last_checkpoint(untrained_policy_dir, tmp_path, prm_proxy):
    """Two torchrun ranks cannot join a save once one has failed: the error names the last checkpoint
    written (one exists: the 3rd batch is collected after the first is saved) and --resume auto. Start-up
    lines come from rank 0 alone."""
    prm_proxy.fail_from = 2 * (4 + 2 * 2)  # from the 3rd batch on (the first requests of either rank's)
    command = served_prm_command(untrained_policy_dir, tmp_path, prm_proxy.url, iterations=5, ranks=2, save_interval=1)
    failed = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=300)
    assert failed.returncode != 0
    (run_dir,) = tmp_path.glob("APPO_Arith-v0/run_*")
    last = checkpoint_files.find_latest(run_dir)
    assert last is not None, failed.stderr[-3000:]
    assert ("[rank 0] train_math.py: error: " in failed.stderr and "Nothing was saved at the failure (its 2 ranks "
            f"cannot join a save); the last checkpoint is {last}. Once the server is back, launch the same command "
            "with --resume auto" in failed.stderr), failed.stderr[-3000:]
    assert failed.stderr.count("run directory ") == 1, failed.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Slow: SIGKILL at random moments
# ---------------------------------------------------------------------------------------------

def complete_checkpoints(logdir: Path) -> list[Path]:
    return sorted((p for p in logdir.glob("*/*/checkpoints/iter_*") if checkpoint_files.invalid_reason(p) is None),
                  key=checkpoint_files.iteration_of)


def kill_during_write(logdir: Path, process: subprocess.Popen, after_iteration: int) -> str | None:
    """SIGKILLs the process while it writes a checkpoint past ``after_iteration`` (its files are
    there, its manifest is not: the save sleeps there, see checkpoint_files.DELAY_ENV)."""
    def writing() -> Path | None:
        for scratch in logdir.glob(f"*/*/checkpoints/.tmp-iter_*-{process.pid}"):  # its own saves only
            number = int(scratch.name.split("-")[1].removeprefix("iter_"))
            if number > after_iteration and (scratch / "rng.pt").is_file():
                return scratch
        return None

    scratch = wait_for(writing, process, 120)
    process.kill()
    return f"while writing {scratch.name}" if scratch else None


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_from_the_last_complete_checkpoint(untrained_policy_dir, tmp_path):
    iterations, trials = 120, 15
    rng = random.Random(0)
    reference = subprocess.run(train_command(untrained_policy_dir, tmp_path / "reference", iterations,
                                             "--save_interval", "50"),
                               capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    logdir = tmp_path / "killed"
    command = train_command(untrained_policy_dir, logdir, iterations, "--save_interval", "1",
                            "--keep_checkpoints", "3", "--resume", "auto")
    results = []
    for trial in range(trials + 1):  # the last one runs to the end
        complete = complete_checkpoints(logdir)
        expected = complete[-1] if complete else None
        during_write = trial % 3 == 2 and trial < trials
        log = tmp_path / f"trial_{trial}.log"
        with open(log, "w") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT,
                                       env=child_env(checkpoint_delay=0.3 if during_write else 0.0))
            if trial == trials:
                process.wait(timeout=600)
                moment = f"none: ran to the end (exit {process.returncode})"
            elif during_write:
                start = checkpoint_files.iteration_of(expected) if expected else 0
                moment = kill_during_write(logdir, process, start + rng.randint(0, 2))
            else:  # at a random moment of start-up and training, or of training only
                after_start = trial % 3 == 0
                if after_start:
                    wait_for(lambda: "run directory" in log.read_text(), process, 120)
                delay = rng.uniform(0.0, 3.0) if after_start else rng.uniform(0.5, 10.0)
                wait_for(lambda: None, process, delay)
                moment = f"{delay:.1f} s after {'training started' if after_start else 'launch'}"
                moment = moment if process.poll() is None else None
                process.kill()
            process.wait(timeout=60)
        text = log.read_text()
        if trial < trials:
            assert moment is not None, f"trial {trial}: the run ended before the kill:\n{text[-2000:]}"
        resumed = re.search(r"resuming from (\S+) \(iteration (\d+)\)", text)
        if resumed:
            assert Path(resumed[1]) == expected, f"trial {trial} resumed from {resumed[1]}, newest complete: {expected}"
            start = f"resumed from {expected.name}"
        elif "no complete checkpoint" in text:
            assert expected is None, f"trial {trial} started afresh although {expected} is complete"
            start = "started afresh (no checkpoint yet)"
        else:
            start = "killed during start-up, before choosing a checkpoint"
        torn = [p for p in logdir.glob("*/*/checkpoints/iter_*") if checkpoint_files.invalid_reason(p) is not None]
        assert not torn, f"trial {trial} left torn checkpoints {torn}"
        now = complete_checkpoints(logdir)
        results.append((trial, moment, start))
        print(f"trial {trial:2d}: {start}; killed {moment}; newest complete checkpoint after: "
              f"{now[-1].name if now else '-'}")
    assert process.returncode == 0, text[-3000:]
    (run_dir,) = {p.parent.parent for p in complete_checkpoints(logdir)}
    (reference_dir,) = (tmp_path / "reference").glob("*/run_*")
    assert_same_training_state(reference_dir / "checkpoints" / f"iter_{iterations}",
                               run_dir / "checkpoints" / f"iter_{iterations}")
    scalars = deterministic_scalars(run_dir)
    assert [step for step, _ in scalars["train/reward"]] == list(range(iterations))
    assert scalars == deterministic_scalars(reference_dir)
    during = sum("while writing" in moment for _, moment, _ in results)
    resumes = sum(start.startswith("resumed") for _, _, start in results)
    print(f"{trials} SIGKILL trials ({during} during a checkpoint write) and a run to the end: {resumes} resumes, "
          "each from the newest complete checkpoint; no torn checkpoint; final weights, optimizer state and "
          "TensorBoard scalars identical to the run never killed")
