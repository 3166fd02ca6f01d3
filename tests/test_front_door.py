"""What a new user meets first: every mistake made before training starts is one line on stderr naming the
flag or file and the fix (exit code 1, no traceback); resuming continues the run as it was; budgets count
the env steps that run; the env's modes (token actions, Prefix-RL hand-off) are reachable from the flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import train_math
from event_files import read_scalars
from test_trainer import run_train_math
from train import builders

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*argv: str, cwd: Path = ROOT, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train_math.py"), *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def run_in_process(capsys: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    """``train_math.py ARGV`` as its ``__main__`` runs it (absl's parsing, then ``main``), in this process: what
    fails at start-up costs no interpreter and no torch import. Its exit code and output."""
    from train.flags import FLAGS

    FLAGS.unparse_flags()
    try:
        train_math.main(train_math.parse_flags(["train_math.py", *argv]))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        FLAGS.unparse_flags()
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["train_math.py", *argv], code, out, err)


def small(policy_dir: Path, logdir: Path, *extra: str) -> list[str]:
    """A few-second GRPO run on the untrained tiny policy: 8 envs in groups of 4, 8 new tokens."""
    return ["--model_name_or_path", str(policy_dir), "--logdir", str(logdir), "--n_rollout_threads", "8",
            "--group_size", "4", "--max_new_tokens", "8", "--eval_limit", "8", "--eval_batch_size", "8",
            "--noasync_rollouts", *extra]


def error_lines(stderr: str) -> list[str]:
    """The error lines among stderr's (model loading draws progress bars there too)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("train_math.py: error: ")]


def the_one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    (line,) = error_lines(result.stderr)
    return line


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, untrained_policy_dir) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("bad")
    broken = root / "broken.jsonl"
    broken.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": \n')
    empty = root / "empty.jsonl"
    empty.write_text("")
    checkpoint_like = root / "iter_3"
    (checkpoint_like / "policy").mkdir(parents=True)
    (checkpoint_like / "manifest.json").write_text("{}")
    no_tokenizer = root / "weights_only"
    no_tokenizer.mkdir()
    for name in os.listdir(untrained_policy_dir):
        if "token" not in name and name != "special_tokens_map.json":
            (no_tokenizer / name).symlink_to(Path(untrained_policy_dir) / name)
    return {
        "broken json line": ["--dataset_path", str(broken)],
        "empty dataset": ["--dataset_path", str(empty)],
        "unregistered env": ["--env_id", "Foo-v0"],
        "flag of another algorithm": ["--algorithm_name", "GRPO", "--oversample_factor", "2"],
        "kl with APPO": ["--algorithm_name", "APPO", "--kl_coef", "0.1"],
        "cuda on a cpu machine": ["--device", "cuda", "--model_name_or_path", str(untrained_policy_dir)],
        "checkpoint dir as model": ["--model_name_or_path", str(checkpoint_like)],
        "model without tokenizer": ["--model_name_or_path", str(no_tokenizer)],
        "steps reward on MATH": ["--dataset_path", str(broken), "--reward", "steps"],
        "unknown flag": ["--num_mini_batchs", "4"],
        "handoff without target": ["--handoff_steps", "1"],
        "implicit PRM as a reward": ["--reward", "outcome:1.0,implicit_prm:0.5"],
        "policy as PRM": ["--model_name_or_path", str(untrained_policy_dir),
                          "--prm_model_name_or_path", str(untrained_policy_dir)],
        "multi-token step tag": ["--model_name_or_path", str(untrained_policy_dir),
                                 "--prm_model_name_or_path", str(untrained_policy_dir), "--prm_step_tag", "STEP DONE"],
        "joint groups with APPO": ["--env_id", "Arith-Chain-v0", "--algorithm_name", "APPO", "--agent_groups", "joint"],
        "joint groups with TPPO": ["--env_id", "Arith-Chain-v0", "--algorithm_name", "TPPO", "--agent_groups", "joint"],
        "role flag on one agent": ["--reward_assignment", "individual"],
        "unimportable env module": ["--env_id", "no_such_workflows:X-v0"],
        "env kwarg the trainer sets": ["--env_kwargs", '{"group_size": 2}'],
        "env kwarg the env lacks": ["--env_kwargs", '{"digits": 1}'],
        "arith too small for its split": ["--env_kwargs", '{"arith": {"digits": 1, "max_ops": 1}}'],
        "env kwargs not an object": ["--env_kwargs", '[1, 2]'],
        "answer instruction without chat": ["--answer_instruction", "Box it."],
        "float16 training": ["--dtype", "float16"],
    }


EXPECTED = {
    "broken json line": ("--dataset_path", "broken.jsonl:2: invalid JSON"),
    "empty dataset": ("--dataset_path", "empty.jsonl"),
    "unregistered env": ("--env_id=Foo-v0", "not a registered gymnasium id"),
    "flag of another algorithm": ("--oversample_factor applies to RLOO",),
    "kl with APPO": ("--kl_coef applies to GRPO/TPPO/RLOO", "Drop it"),
    "cuda on a cpu machine": ("device='cuda'", "--device cpu"),
    "checkpoint dir as model": ("--model_name_or_path", "policy/"),
    "model without tokenizer": ("--model_name_or_path", "weights_only", "tokenizer"),
    "steps reward on MATH": ("'steps'", "Drop 'steps'"),
    "unknown flag": ("num_mini_batchs", "--helpfull"),
    "handoff without target": ("--handoff_steps", "'target'"),
    "implicit PRM as a reward": ("'implicit_prm' is not a --reward source", "--algorithm_name RLOO"),
    "policy as PRM": ("untrained_policy", "is not a Math-Shepherd PRM"),
    "multi-token step tag": ("--prm_step_tag", "STEP DONE"),
    "joint groups with APPO": ("--agent_groups applies to GRPO/RLOO", "--algorithm_name=APPO"),
    "joint groups with TPPO": ("--agent_groups applies to GRPO/RLOO", "--algorithm_name=TPPO"),
    "role flag on one agent": ("--reward_assignment", "--env_id=Arith-v0 has one agent"),
    "unimportable env module": ("'no_such_workflows'", "PYTHONPATH"),
    "env kwarg the trainer sets": ("--env_kwargs", "'group_size' is set by the trainer from --group_size"),
    "env kwarg the env lacks": ("--env_kwargs", "Arith-v0 takes no keyword ['digits']", "'arith'"),
    "arith too small for its split": ("--env_kwargs", "fewer than 1000 distinct problems", "num_test"),
    "env kwargs not an object": ("--env_kwargs", "must be a JSON object"),
    "answer instruction without chat": ("--answer_instruction", "--prompt_template chat"),
    "float16 training": ("dtype='float16' (--dtype)", "loss scaler", "--dtype bfloat16"),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_every_start_up_mistake_is_one_line_naming_the_flag(bad_inputs, case, tmp_path, capsys):
    """In this process; the tests below run the command line in a process of its own."""
    if case == "cuda on a cpu machine":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    line = the_one_error_line(run_in_process(capsys, *bad_inputs[case], "--logdir", str(tmp_path)))
    for part in EXPECTED[case]:
        assert part in line, line
    assert not list(tmp_path.iterdir()), "a run that never started must leave no directory behind"


def test_a_hub_dataset_without_the_datasets_package_fails_before_any_model_loads(untrained_policy_dir, tmp_path):
    """As where the datasets package is not installed (the import system is told it is absent)."""
    argv = ["train_math.py", "--model_name_or_path", str(untrained_policy_dir), "--dataset_path",
            "hf://HuggingFaceH4/MATH-500:test", "--logdir", str(tmp_path)]
    script = (f"import runpy, sys; sys.modules['datasets'] = None; sys.argv = {argv!r}; "
              f"runpy.run_path({str(ROOT / 'train_math.py')!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=ROOT)
    line = the_one_error_line(result)
    assert "--dataset_path" in line and "pip install datasets" in line
    assert "Loading weights" not in result.stderr and not list(tmp_path.iterdir())


def test_several_flag_errors_are_one_line_each(tmp_path):
    result = run_cli("--lr", "-1", "--top_p", "0", "--logdir", str(tmp_path))
    assert result.returncode == 1
    first, second = error_lines(result.stderr)
    assert "--lr=-1.0: must be > 0" in first and "--top_p" not in first
    assert "--top_p=0.0: must be in (0, 1]" in second


def test_a_build_failure_leaves_no_run_directory(untrained_policy_dir, tmp_path, monkeypatch, capsys):
    def not_a_prm(*args, **kwargs):
        raise ValueError("--prm_model_name_or_path=x is not a PRM")

    monkeypatch.setattr(builders, "build_runner", not_a_prm)
    with pytest.raises(SystemExit) as stopped:
        run_train_math(small(untrained_policy_dir, tmp_path))
    assert stopped.value.code == 1 and "is not a PRM" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nor an empty experiment directory


def test_ctrl_c_during_start_up_is_one_line(untrained_policy_dir, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(builders, "build_runner", interrupted)
    with pytest.raises(SystemExit) as stopped:
        run_train_math(small(untrained_policy_dir, tmp_path))
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip() == "train_math.py: error: interrupted during start-up; nothing was trained"


def hub_cache(hf_home: Path, policy_dir: Path) -> None:
    """HF_HOME holding org/tiny-math in the hub's layout: revision v1 is ``policy_dir``'s files, main a snapshot
    with a config only (no weights, no tokenizer)."""
    repo = hf_home / "hub" / "models--org--tiny-math"
    for ref, sha in (("main", "a" * 40), ("v1", "b" * 40)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
        snapshot = repo / "snapshots" / sha
        snapshot.mkdir(parents=True)
        for item in Path(policy_dir).iterdir():
            if ref == "v1" or item.name == "config.json":
                (snapshot / item.name).symlink_to(item)


def test_model_flags_take_hub_ids_resolved_offline_at_a_revision(untrained_policy_dir, tmp_path, monkeypatch, capsys):
    hf_home = tmp_path / "hf"
    hub_cache(hf_home, untrained_policy_dir)
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "train_math.py"), *argv, "--logdir", str(tmp_path / "runs")],
                              capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)

    trained = run(*small("org/tiny-math", tmp_path / "runs", "--revision", "v1", "--num_env_steps", "8",
                         "--eval_interval", "0"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    (policy,) = (tmp_path / "runs").glob("*/run_*/checkpoints/iter_1/policy")
    assert (policy / "model.safetensors").is_file() or list(policy.glob("*.safetensors"))

    # the mistakes in this process, the hub client pointed at the same cache (it reads these at each call)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    logdir = ("--logdir", str(tmp_path / "runs"))
    no_weights = the_one_error_line(run_in_process(capsys, "--model_name_or_path", "org/tiny-math", *logdir))
    assert "--model_name_or_path" in no_weights and "a" * 40 in no_weights  # main: a config alone
    absent = the_one_error_line(run_in_process(capsys, "--prm_model_name_or_path", "org/absent", *logdir))
    assert "--prm_model_name_or_path='org/absent'" in absent and "not in the Hugging Face cache" in absent


def test_chat_template_missing_is_one_line(untrained_policy_dir, tmp_path, capsys):
    line = the_one_error_line(run_in_process(capsys, *small(untrained_policy_dir, tmp_path,
                                                            "--prompt_template", "chat")))
    assert "has no chat template" in line and "--prompt_template default" in line
    assert not list(tmp_path.iterdir())


def events_of(run_dir: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in run_dir.glob("events.out.tfevents.*")}


def test_resuming_a_run_at_or_past_its_budget_changes_nothing(untrained_policy_dir, tmp_path, capsys):
    argv = small(untrained_policy_dir, tmp_path, "--num_env_steps", "32", "--eval_interval", "2",
                 "--save_interval", "2")
    run_dir = Path(run_train_math(argv))
    history = (run_dir / "eval_history.json").read_text()
    # the periodic save at iteration 4 came before the final evaluation: the final save still holds it
    assert json.loads((run_dir / "checkpoints" / "iter_4" / "trainer_state.json").read_text())["history"] == \
        json.loads(history)
    events = events_of(run_dir)
    for budget in ("32", "16"):  # the finished run again, then a smaller budget than it has done
        run_train_math([*argv, "--resume", "auto", "--num_env_steps", budget])
        assert "has trained 4 iterations" in capsys.readouterr().out
        assert events_of(run_dir) == events and (run_dir / "eval_history.json").read_text() == history
    assert [step for step, _ in read_scalars(run_dir)["eval/accuracy"]] == [0, 2, 4]


def test_a_checkpoint_from_before_the_new_flags_resumes(untrained_policy_dir, tmp_path):
    """flags.json of a checkpoint written before --revision/--prompt_template/--system_prompt existed (and
    holding a flag since removed): the new flags keep their defaults, the removed one is skipped."""
    argv = small(untrained_policy_dir, tmp_path, "--num_env_steps", "8", "--eval_interval", "0")
    run_dir = Path(run_train_math(argv))
    saved = run_dir / "checkpoints" / "iter_1" / "flags.json"
    old = {k: v for k, v in json.loads(saved.read_text()).items()
           if k not in ("revision", "prompt_template", "system_prompt")}
    saved.write_text(json.dumps({**old, "a_removed_flag": 1}))
    manifest = saved.parent / "manifest.json"  # as that trainer wrote it: the manifest lists each file's size
    listed = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**listed, "files": {**listed["files"], "flags.json": saved.stat().st_size}}))
    run_train_math(["--resume", str(saved.parent), "--num_env_steps", "16", "--logdir", str(tmp_path)])
    assert (run_dir / "checkpoints" / "iter_2" / "manifest.json").is_file()
    assert json.loads((run_dir / "checkpoints" / "iter_2" / "flags.json").read_text())["prompt_template"] == "default"


def test_a_run_resumed_with_a_larger_budget_trains_at_the_new_budgets_lr(untrained_policy_dir, tmp_path):
    """A finished run's linear decay leaves the optimizer's lr at 0. Resumed with a budget of one more
    iteration it trains that iteration at the new budget's lr (a third of --lr at step 2 of 3), so the
    weights move; at the saved lr of 0 Adam would leave every one of them as it was."""
    argv = small(untrained_policy_dir, tmp_path, "--algorithm_name", "APPO", "--group_size", "1",  # a critic: APPO
                 "--lr_schedule", "linear", "--warmup_iterations", "0", "--eval_interval", "0")  # always updates
    run_dir = Path(run_train_math([*argv, "--num_env_steps", "16"]))  # 2 iterations of 8 envs
    run_train_math([*argv, "--num_env_steps", "24", "--resume", "auto"])
    before, after = (load_file(run_dir / "checkpoints" / f"iter_{n}" / "policy" / "model.safetensors") for n in (2, 3))
    moved = sum(int((before[name] != after[name]).sum()) for name in before)
    assert moved > 0.5 * sum(tensor.numel() for tensor in before.values()), moved


def test_resume_from_a_path_keeps_the_checkpoints_flags(untrained_policy_dir, tmp_path):
    run_dir = Path(run_train_math(small(untrained_policy_dir, tmp_path, "--num_env_steps", "16", "--lr", "5e-5",
                                        "--eval_interval", "0", "--seed", "7")))
    first = run_dir / "checkpoints" / "iter_2"
    run_train_math(["--resume", str(first), "--num_env_steps", "32", "--logdir", str(tmp_path)])
    flags = json.loads((run_dir / "checkpoints" / "iter_4" / "flags.json").read_text())
    assert (flags["lr"], flags["seed"], flags["n_rollout_threads"], flags["num_env_steps"]) == (5e-5, 7, 8, 32)


@pytest.mark.parametrize("algorithm, extra", [("GRPO", ["--async_rollouts"]), ("RLOO", ["--oversample_factor", "2"])])
def test_env_steps_taken_equal_the_budget(untrained_policy_dir, tmp_path, algorithm, extra):
    """Asynchronous rollouts take no batch beyond the last iteration; RLOO's oversampled envs count."""
    argv = small(untrained_policy_dir, tmp_path, "--num_env_steps", "64", "--eval_interval", "0",
                 "--algorithm_name", algorithm, *extra)
    argv.remove("--noasync_rollouts")
    run_dir = Path(run_train_math(argv))
    state = json.loads(next((run_dir / "checkpoints").glob("iter_*")).joinpath("trainer_state.json").read_text())
    assert state["env_steps"] == 64
    assert read_scalars(run_dir)["train/env_steps"][-1][1] == 64


def test_token_level_actions_train_from_the_command_line(untrained_policy_dir, tmp_path):
    run_dir = Path(run_train_math(small(untrained_policy_dir, tmp_path, "--algorithm_name", "TPPO", "--group_size", "1",
                                        "--action_level", "token", "--episode_length", "3", "--num_env_steps", "48",
                                        "--eval_interval", "0")))
    scalars = read_scalars(run_dir)
    assert [value for _, value in scalars["train/action_tokens"]] == [1.0, 1.0]
    assert scalars["train/env_steps"][-1][1] == 48


def test_prefix_rl_hands_the_prefix_to_the_target(untrained_policy_dir, tmp_path):
    run_dir = Path(run_train_math(small(untrained_policy_dir, tmp_path, "--handoff_steps", "1", "--reward", "target",
                                        "--target_model_name_or_path", str(untrained_policy_dir),
                                        "--target_num_samples", "2", "--target_temperature", "1.0",
                                        "--target_max_new_tokens", "8", "--num_env_steps", "8",
                                        "--eval_interval", "0")))
    assert "train/reward/target" in read_scalars(run_dir)


def test_a_changed_lora_rank_on_resume_is_one_line(untrained_policy_dir, tmp_path, capsys):
    argv = small(untrained_policy_dir, tmp_path, "--num_env_steps", "16", "--eval_interval", "0", "--lora_rank", "4")
    run_train_math(argv)
    with pytest.raises(SystemExit) as stopped:
        run_train_math([*argv, "--resume", "auto", "--num_env_steps", "32", "--lora_rank", "8"])
    assert stopped.value.code == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert "lora" in line.lower(), line


def test_a_second_interrupt_stops_at_once_in_one_line(untrained_policy_dir, tmp_path, monkeypatch, capsys):
    def second_signal(self, exit_after_stop=False):
        raise KeyboardInterrupt("second SIGINT: stopping without saving")

    monkeypatch.setattr("train.runner.Runner.run", second_signal)
    with pytest.raises(SystemExit) as stopped:
        run_train_math(small(untrained_policy_dir, tmp_path, "--eval_interval", "0"))
    assert stopped.value.code == 130
    assert error_lines(capsys.readouterr().err) == ["train_math.py: error: second SIGINT: stopping without saving; "
                                                    "the last checkpoint is none"]
