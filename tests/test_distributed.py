"""Data parallelism for real: ``torchrun`` with 2 gloo ranks on this CPU against one process holding
all the envs (the same weights after the first iterations), the env split over processes, and a rank
that fails ending the job with its name."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from safetensors.numpy import load_file

from envs.vector import MathVectorEnv
from test_checkpoint import deterministic_scalars
from train.distributed import Ranks, shard

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def test_split_envs_draw_the_problems_and_group_ids_of_one_env():
    """Two envs of 2 groups each (offsets 0 and 2 of 4) step through the same problems and group ids as
    one env of 4 groups, although their groups end episodes at different times."""
    def env(num_envs: int, **split) -> MathVectorEnv:
        return MathVectorEnv(num_envs, group_size=2, autoreset_mode="SameStep", arith={}, max_steps=3, **split)

    whole, parts = env(8), [env(4, group_offset=0, total_groups=4), env(4, group_offset=2, total_groups=4)]
    seen = [[], []]
    for k, vec in enumerate([whole] + parts):
        obs, info = vec.reset(seed=3)
        rows = [info["problem_id"].tolist() + info["group_id"].tolist()]
        for step in range(12):  # episodes of 1-3 steps: groups restart at different times
            first = vec.group_offset * vec.group_size  # the same actions for the same global env
            lengths = [(step + first + i) % 3 for i in range(vec.num_envs)]
            obs, _, _, _, info = vec.step(["Step" if n else "The answer is \\boxed{1}" for n in lengths])
            rows.append(info["problem_id"].tolist() + info["group_id"].tolist())
        seen[min(k, 1)].append(rows)
    merged = [[*a[:4], *b[:4], *a[4:], *b[4:]] for a, b in zip(*seen[1])]
    assert seen[0][0] == merged


def test_shard_gives_whole_groups_and_refuses_an_uneven_split():
    assert [shard(16, 4, Ranks(rank, 2)) for rank in range(2)] == [(0, 8), (8, 8)]
    with pytest.raises(ValueError, match="do not split evenly over 2 ranks"):
        shard(12, 4, Ranks(0, 2))


def train(logdir: Path, policy_dir: Path, ranks: int, envs_per_rank: int, *extra: str,
          iterations: int = 3) -> subprocess.CompletedProcess:
    """APPO (a critic: every iteration updates even without reward), 3 iterations of 2 steps at the
    default lr (Adam moves each weight by about lr per step, so a gradient that is float noise in both
    runs can move a weight by lr either way: at lr 1e-3 one embedding entry of a token never sampled
    ended 2.1e-5 apart), held constant: a run resumed with a larger budget must take the steps a run of
    that budget takes, and a decayed lr would follow each budget's own line; ``ranks`` processes under
    torchrun, or one plain process."""
    flags = ["--model_name_or_path", str(policy_dir), "--logdir", str(logdir), "--algorithm_name", "APPO",
             "--noasync_rollouts", "--action_level", "step", "--episode_length", "2", "--max_new_tokens", "8",
             "--n_rollout_threads", str(ranks * envs_per_rank), "--eval_interval", "0", "--save_interval", "0",
             "--lr", "1e-4", "--warmup_iterations", "0", "--lr_schedule", "constant",
             "--num_env_steps", str(ranks * envs_per_rank * 2 * iterations), *extra]
    launcher = [*TORCHRUN, "--nproc_per_node", str(ranks)] if ranks > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*launcher, str(ROOT / "train_math.py"), *flags], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)


def final_weights(logdir: Path, iteration: int | None = None) -> dict[str, np.ndarray]:
    """Every tensor of the run's checkpoint after ``iteration`` (None: its last) (policy, adapters, value
    head), by file and name."""
    (run,) = logdir.glob("*_Arith-v0/run_*")
    last = max((run / "checkpoints").glob("iter_*"), key=lambda p: int(p.name.removeprefix("iter_")))
    chosen = last if iteration is None else run / "checkpoints" / f"iter_{iteration}"
    return {f"{file.relative_to(chosen)}:{name}": value for file in sorted(chosen.rglob("*.safetensors"))
            for name, value in load_file(file).items()}


@pytest.fixture(scope="module")
def one_process_full(untrained_policy_dir, tmp_path_factory) -> Path:
    """The logdir of full fine-tuning in one process, one row per micro-batch, 4 iterations with a checkpoint
    after each: the run that 2 ranks of full fine-tuning must match (after 3 iterations, and a run resumed at
    another number of ranks after 4). The lr is constant, so its first 3 iterations are a 3-iteration run's."""
    logdir = tmp_path_factory.mktemp("one_process_full")
    done = train(logdir, untrained_policy_dir, 1, 8, "--gradient_cp_steps", "16", "--save_interval", "1", iterations=4)
    assert done.returncode == 0, done.stderr[-4000:]
    return logdir


def assert_same_training(two: dict[str, np.ndarray], one: dict[str, np.ndarray], iterations: int) -> np.ndarray:
    """Weights of two runs on the same samples, apart by float noise at most: Adam moves a weight by about
    lr (1e-4) per step whatever its gradient's size, so a gradient that is float noise in both runs
    (|g| ~ 1e-9, where the order of the adds shows) may move it by up to lr either way; a real difference
    (a sample, a normalisation) would move most weights apart. Returns every weight's difference."""
    assert two.keys() == one.keys()
    apart = np.concatenate([np.abs(two[key] - one[key]).ravel() for key in one])
    assert np.quantile(apart, 0.9999) <= 1e-6 and apart.max() <= 2 * 1e-4 * iterations, np.sort(apart)[-5:]
    return apart


@pytest.mark.parametrize("mode", [
    "fsdp",
    pytest.param("ddp", marks=pytest.mark.slow),  # DDP's all-reduce runs by default in the LoRA case
    "lora",
], ids=["fsdp_full", "ddp_full", "ddp_lora"])
def test_two_ranks_train_the_weights_one_process_trains(untrained_policy_dir, tmp_path, mode, request):
    """FSDP2 (full fine-tuning's default), DDP of the same, and DDP of LoRA adapters."""
    extra = {"fsdp": ("--data_parallel", "fsdp"), "ddp": ("--data_parallel", "ddp"), "lora": ("--lora_rank", "4")}[mode]
    started = time.monotonic()
    # One row per micro-batch on both sides: each row's forward then has the same shapes, so the runs differ
    # only in the order the rows' gradients are added (the all-reduce adds two partial sums).
    split = train(tmp_path / "two", untrained_policy_dir, 2, 4, "--gradient_cp_steps", "8", *extra)
    assert split.returncode == 0, split.stderr[-4000:]
    if mode == "lora":
        whole_dir = tmp_path / "one"
        whole = train(whole_dir, untrained_policy_dir, 1, 8, "--gradient_cp_steps", "16", *extra)
        assert whole.returncode == 0, whole.stderr[-4000:]
    else:  # in one process the data-parallel mode means nothing: the shared full fine-tuning run
        whole_dir = request.getfixturevalue("one_process_full")
    two, one = final_weights(tmp_path / "two"), final_weights(whole_dir, iteration=3)
    initial = load_file(untrained_policy_dir / "model.safetensors")
    moved = max(float(np.abs(one[k] - initial[k.split(":")[1]]).max()) for k in one
                if k.startswith("policy/model.safetensors") and k.split(":")[1] in initial)
    assert moved > 1e-4, "training did not move the weights: the comparison would be empty"
    apart = assert_same_training(two, one, iterations=3)
    # Adam hides the gradient's scale; the logged losses and pre-clip gradient norms show it (the policy loss
    # is float noise about 0 here, |loss| < 1e-6: advantages are normalised and the ratio starts at 1).
    scalars = [deterministic_scalars(next((logdir / "APPO_Arith-v0").glob("run_*"))) for logdir in
               (tmp_path / "two", whole_dir)]
    for tag in ("grad/norm", "loss/policy_loss", "loss/value_loss", "train/reward", "train/step_reward",
                "train/action_tokens", "train/trained_samples", "train/env_steps"):
        steps, values = zip(*scalars[0][tag])
        first_three = [(step, value) for step, value in scalars[1][tag] if step < 3]
        assert steps == (0, 1, 2) and steps == tuple(s for s, _ in first_three), tag
        np.testing.assert_allclose(values, [v for _, v in first_three], rtol=1e-5, atol=2e-6, err_msg=tag)
    print(f"[{mode}] 2 ranks vs 1 process after 3 iterations: 99.99% of {apart.size} weights "
          f"within {np.quantile(apart, 0.9999):.1e}, all within {apart.max():.1e} (moved up to {moved:.1e}); "
          f"{time.monotonic() - started:.0f} s")


@pytest.mark.parametrize("first, then", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_a_checkpoint_resumes_at_another_number_of_ranks(untrained_policy_dir, tmp_path, one_process_full, first,
                                                        then):
    """2 iterations on ``first`` ranks, then 2 more on ``then`` ranks from its checkpoint, train what 4
    iterations in one process do: the envs' episodes are split anew and every draw is the same. One row per
    micro-batch on every side (see the test above)."""
    resumed = tmp_path / "resumed"
    for ranks, iterations in ((first, 2), (then, 4)):
        done = train(resumed, untrained_policy_dir, ranks, 8 // ranks, "--gradient_cp_steps", str(16 // ranks),
                     "--resume", "auto", "--save_interval", "1", iterations=iterations)
        assert done.returncode == 0, done.stderr[-4000:]
    assert_same_training(final_weights(resumed), final_weights(one_process_full), iterations=4)


@pytest.mark.slow  # 2 ranks against one process (30 s); one process's implicit PRM runs by default (test_checkpoint)
def test_rloo_and_its_implicit_prm_train_the_same_on_two_ranks(untrained_policy_dir, tmp_path):
    """PRIME's two streams: the implicit PRM's gradients are summed over ranks too, and over the micro-batches
    that ``--micro_batch_tokens`` cuts. Every group kept (the filter's quota is per rank, so a filtering run keeps
    other groups than one process would)."""
    rloo = ("--algorithm_name", "RLOO", "--group_size", "4", "--oversample_factor", "1", "--accuracy_lower_bound",
            "0", "--accuracy_upper_bound", "1", "--action_level", "solution", "--episode_length", "1",
            "--implicit_prm_lr", "1e-4", "--num_env_steps", "24")  # 3 iterations of one step
    split = train(tmp_path / "two", untrained_policy_dir, 2, 4, *rloo, "--gradient_cp_steps", "4",
                  "--micro_batch_tokens", "64")  # the PRM's step too in micro-batches of their own on each rank
    assert split.returncode == 0, split.stderr[-4000:]
    whole = train(tmp_path / "one", untrained_policy_dir, 1, 8, *rloo, "--gradient_cp_steps", "8")
    assert whole.returncode == 0, whole.stderr[-4000:]
    two, one = final_weights(tmp_path / "two"), final_weights(tmp_path / "one")
    initial = load_file(untrained_policy_dir / "model.safetensors")
    prm = {k.split(":")[1].removeprefix("model."): value for k, value in one.items() if k.startswith("implicit_prm")}
    moved = max(float(np.abs(value - initial[name]).max()) for name, value in prm.items() if name in initial)
    assert moved > 1e-4, "the implicit PRM did not train: the comparison would be empty"
    assert_same_training(two, one, iterations=3)
    scalars = [deterministic_scalars(next(logdir.glob("RLOO_Arith-v0/run_*"))) for logdir in
               (tmp_path / "two", tmp_path / "one")]
    for tag in ("loss/implicit_prm", "implicit_prm/heldout_accuracy", "train/trained_samples"):
        np.testing.assert_allclose([v for _, v in scalars[0][tag]], [v for _, v in scalars[1][tag]], rtol=1e-5,
                                   err_msg=tag)


@pytest.mark.slow  # 25 s; DDP of LoRA adapters (ddp_lora above) and role adapters in one process run by default
def test_role_adapters_train_under_ddp(untrained_policy_dir, tmp_path):
    """A LoRA adapter per role of the chain, DDP on 2 ranks: one forward per role's rows inside one DDP
    call, every adapter in the one all-reduce; the checkpoint holds all three."""
    chain = ("--env_id", "Arith-Chain-v0", "--noshare_policy", "--lora_rank", "4", "--kl_coef", "0.05",
             "--action_level", "solution", "--algorithm_name", "GRPO", "--group_size", "2", "--episode_length", "3",
             "--num_env_steps", "48")
    done = train(tmp_path, untrained_policy_dir, 2, 4, *chain)
    assert done.returncode == 0, done.stderr[-4000:]
    (state,) = tmp_path.glob("GRPO_Arith-Chain-v0/run_*/checkpoints/iter_2/train_state")
    keys = dcp.FileSystemReader(state).read_metadata().state_dict_metadata
    assert {role for role in ("solver", "verifier", "refiner") if any(f".{role}." in key for key in keys)} == {
        "solver", "verifier", "refiner"}


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (their RANK environment variable)."""
    workers = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{launcher.pid}\n" not in status.read_text():
                continue
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except OSError:  # the process ended meanwhile
            continue
        rank = [item[5:] for item in environ if item.startswith(b"RANK=")]
        if rank:
            workers[int(rank[0])] = int(status.parent.name)
    return workers


def checkpoints(logdir: Path) -> list[Path]:
    return sorted(logdir.glob("APPO_Arith-v0/run_*/checkpoints/iter_*"), key=lambda p: int(p.name[5:]))


def launch(logdir: Path, policy_dir: Path, iterations: int, *torchrun_flags: str) -> subprocess.Popen:
    """2 ranks x 4 envs of APPO for ``iterations`` iterations, a checkpoint after each, resuming the
    newest one when restarted."""
    flags = ["--model_name_or_path", str(policy_dir), "--logdir", str(logdir), "--algorithm_name", "APPO",
             "--noasync_rollouts", "--action_level", "step", "--episode_length", "2", "--max_new_tokens", "8",
             "--n_rollout_threads", "8", "--eval_interval", "0", "--save_interval", "1", "--dist_timeout", "30",
             "--num_env_steps", str(16 * iterations), "--resume", "auto"]
    return subprocess.Popen([*TORCHRUN, "--nproc_per_node", "2", *torchrun_flags, str(ROOT / "train_math.py"), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def kill_rank_after_a_checkpoint(launcher: subprocess.Popen, logdir: Path, rank: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and launcher.poll() is None and not checkpoints(logdir):
        time.sleep(0.1)
    assert checkpoints(logdir), "no checkpoint was written"
    os.kill(worker_pids(launcher)[rank], 9)


def test_a_killed_rank_ends_the_job_naming_it(untrained_policy_dir, tmp_path):
    launcher = launch(tmp_path, untrained_policy_dir, 1000)
    try:
        kill_rank_after_a_checkpoint(launcher, tmp_path, rank=1)
        killed = time.monotonic()
        _, err = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    assert time.monotonic() - killed < 60, "the surviving rank waited longer than --dist_timeout"
    assert "rank      : 1" in err or "rank: 1" in err, err[-3000:]


@pytest.mark.slow  # the default run kills a rank in the test above; this one restarts the job (40 s)
def test_max_restarts_and_resume_auto_recover_from_a_killed_rank(untrained_policy_dir, tmp_path, monkeypatch):
    # torchrun's agent shares its rendezvous store with the workers by default, and a restarted round then
    # reads the killed round's gloo addresses: the README says to set this.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    launcher = launch(tmp_path, untrained_policy_dir, 8, "--max-restarts", "1")
    try:
        kill_rank_after_a_checkpoint(launcher, tmp_path, rank=1)
        out, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert checkpoints(tmp_path)[-1].name == "iter_8"


@pytest.mark.slow  # 2 ranks against one process (about a minute on 2 idle cores)
def test_a_role_on_its_own_base_trains_the_same_on_two_ranks(untrained_policy_dir, smaller_policy_dir, tmp_path):
    """The chain with its verifier on another base (LoRA) beside the policy (full fine-tuning): DDP of the whole
    team on 2 ranks trains every model's weights as one process does. The entropy bonus gives every row a
    gradient (the untrained roles' equal rewards leave no advantage)."""
    chain = ("--env_id", "Arith-Chain-v0", "--role_base_model", f"verifier={smaller_policy_dir}",
             "--role_lora_rank", "verifier=4", "--entropy_coef", "0.01", "--action_level", "solution",
             "--algorithm_name", "GRPO", "--group_size", "2", "--episode_length", "3", "--num_env_steps", "48")
    runs = {}
    for ranks, cp_steps in ((2, 12), (1, 24)):  # one row per micro-batch on both sides
        done = train(tmp_path / str(ranks), untrained_policy_dir, ranks, 8 // ranks, *chain,
                     "--gradient_cp_steps", str(cp_steps))
        assert done.returncode == 0, done.stderr[-4000:]
        (last,) = (tmp_path / str(ranks)).glob("GRPO_Arith-Chain-v0/run_*/checkpoints/iter_2")
        runs[ranks] = {f"{file.relative_to(last)}:{name}": value for file in sorted(last.rglob("*.safetensors"))
                       for name, value in load_file(file).items()}
    member = {key.split(":")[1]: value for key, value in runs[1].items() if key.startswith("members/verifier/")}
    initial = load_file(smaller_policy_dir / "model.safetensors")
    assert any(not np.array_equal(member[name], initial[name]) for name in initial), "the member never trained"
    assert_same_training(runs[2], runs[1], iterations=2)
