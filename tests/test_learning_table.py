"""bench/learning_table.py: the aggregation of hand-written histories against hand-computed numbers (the
table's start, best and final mean ± sd, env steps and minutes to +10 points; the CSV's lines; the plots),
every row's flags as train_math validates them, and (slow) a real two-row grid, run twice: the second
call trains nothing."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import learning_table
from train import flags as train_flags
from train.flags import config_from_flags

ROOT = Path(__file__).resolve().parents[1]


def history(*evaluations: tuple, **extra: float) -> list[dict[str, float]]:
    """Entries as the runner writes them, from (iteration, env_steps, seconds, accuracy) tuples."""
    return [{"iteration": i, "env_steps": steps, "seconds": seconds, "eval/accuracy": accuracy,
             "eval/mean_length": 30.0, "time/eval": 1.0, **extra} for i, steps, seconds, accuracy in evaluations]


RESULTS = {
    "grpo_outcome": {
        0: history((0, 0, 0.0, 0.30), (10, 1280, 60.0, 0.35), (20, 2560, 120.0, 0.42), (30, 3840, 180.0, 0.38)),
        1: history((0, 0, 0.0, 0.28), (10, 1280, 96.0, 0.38), (20, 2560, 150.0, 0.36), (30, 3840, 216.0, 0.46)),
    },
    "appo": {0: history((0, 0, 0.0, 0.25), (10, 1280, 50.0, 0.30), (20, 2560, 100.0, 0.33))},
    "rloo_prime": {  # seed 0 gains 0.3 - 0.2 = 0.09999999999999998 in floats: exactly 10 points
        0: history((0, 0, 0.0, 0.2), (5, 2560, 70.0, 0.3)),
        1: history((0, 0, 0.0, 0.2), (5, 2560, 86.0, 0.25)),
    },
    "prefix_rl": {0: history((0, 0, 0.0, 0.44), (10, 1280, 40.0, 0.50), **{"eval/solver/answer_correct": 0.5})},
    "target_alone": {0: history((0, 0, 0.0, 0.77))},
}


def test_table_and_csv_of_hand_written_histories(tmp_path):
    assert learning_table.write_tables(RESULTS, tmp_path, note="note line") == [tmp_path / "results.csv",
                                                                                 tmp_path / "table.md"]
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[0] == "note line"
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table if line.startswith("| ")}
    # start 0.30, 0.28; best 0.42, 0.46; final 0.38, 0.46 (sample sd); +10 at 2560 (120 s) and 1280 (96 s);
    # the end at 3840 env steps, 180 and 216 s
    assert rows["grpo_outcome"] == ("| grpo_outcome | 0 1 | 0.290 ± 0.014 | 0.440 ± 0.028 | 0.420 ± 0.057 | 1,920 | "
                                    "1.8 | 3,840 | 3.3 |")
    assert rows["appo"] == "| appo | 0 | 0.250 | 0.330 | 0.330 | - | - | 2,560 | 1.7 |"  # one seed: no sd
    assert rows["rloo_prime"] == ("| rloo_prime | 0 1 | 0.200 ± 0.000 | 0.275 ± 0.035 | 0.275 ± 0.035 | "
                                  "2,560 (1/2 seeds) | 1.2 (1/2 seeds) | 2,560 | 1.3 |")
    assert rows["prefix_rl"] == "| prefix_rl | 0 | 0.440 | 0.500 | 0.500 | - | - | 1,280 | 0.7 |"
    assert rows[f"target_alone: {learning_table.BASELINE_NOTES['target_alone']}"].endswith("| 0.770 |")
    assert rows[f"writer_untrained: {learning_table.BASELINE_NOTES['writer_untrained']}"].endswith("| 0.440 |")
    assert not any(name.startswith("solver_alone") for name in rows)  # no result, no line

    with open(tmp_path / "results.csv") as file:
        lines = list(csv.DictReader(file))
    assert len(lines) == 4 + 4 + 3 + 2 + 2 + 2 + 1  # one per (row, seed, evaluation)
    assert list(lines[0]) == [*learning_table.CSV_KEYS, "solver/answer_correct"]
    assert lines[0] == {"row": "grpo_outcome", "seed": "0", "iteration": "0", "env_steps": "0", "seconds": "0.0",
                        "accuracy": "0.3", "mean_length": "30.0", "solver/answer_correct": ""}
    assert [(line["row"], line["seed"], line["iteration"]) for line in lines][7:10] == [
        ("grpo_outcome", "1", "30"), ("appo", "0", "0"), ("appo", "0", "10")]
    assert lines[-1]["row"] == "target_alone" and lines[-2]["solver/answer_correct"] == "0.5"


def test_plots_of_hand_written_histories(tmp_path):
    pytest.importorskip("matplotlib")
    paths = learning_table.plot(RESULTS, tmp_path)
    assert paths == [tmp_path / "accuracy_vs_env_steps.png", tmp_path / "accuracy_vs_minutes.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert learning_table.plot({"target_alone": RESULTS["target_alone"]}, tmp_path / "none") == []  # no panel


def test_curve_is_the_mean_and_band_over_seeds():
    x, mean, low, high = learning_table.curve(RESULTS["grpo_outcome"], "seconds")
    assert x.tolist() == pytest.approx([0.0, 1.3, 2.25, 3.3])  # minutes, averaged over seeds
    assert mean.tolist() == pytest.approx([0.29, 0.365, 0.39, 0.42])
    assert low.tolist() == pytest.approx([0.28, 0.35, 0.36, 0.38])
    assert high.tolist() == pytest.approx([0.30, 0.38, 0.42, 0.46])


@pytest.mark.parametrize("row", [*learning_table.ROWS, *learning_table.BASELINES])
def test_every_row_passes_train_maths_checks(row, untrained_policy_dir, tmp_path):
    """Each row's flags parse and pass train_math's checks before any model loads; its iterations follow
    from the one budget (3072 env steps of 128 envs)."""
    args = learning_table.parse_args(["--env_steps", "3072", "--eval_interval", "4", "--out", str(tmp_path)])
    models = dict.fromkeys(("policy", "target", "team", "prm"), str(untrained_policy_dir))
    flags = learning_table.run_flags(row, 0, args, models)
    train_flags.FLAGS.unparse_flags()
    try:
        train_flags.FLAGS(["train_math", *flags, "--logdir", str(tmp_path)])
        config = config_from_flags(train_flags.FLAGS)
    finally:
        train_flags.FLAGS.unparse_flags()
    iterations = config.budget.num_iterations
    outcome_rows = ("grpo_outcome", "appo", "tppo", "rloo_outcome", "rloo_filter", "rloo_prime")
    if row in outcome_rows:  # the row's name, not the env's declared default (outcome + steps), sets its reward
        assert config.rewards.weights == {"outcome": 1.0}
    expected = {"grpo_outcome": 24, "rloo_outcome": 24, "rloo_filter": 6, "rloo_prime": 6, "chain": 8, "debate": 12,
                "target_alone": 1, "solver_alone": 1}
    assert iterations == expected.get(row, iterations)


def test_bad_arguments_name_the_value_and_the_fix(capsys):
    with pytest.raises(SystemExit):
        learning_table.parse_args(["--n_rollout_threads", "12"])
    assert "--n_rollout_threads=12" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learning_table.parse_args(["--seeds", "0", "0"])
    assert "repeats a seed" in capsys.readouterr().err


def test_a_logdir_that_trained_with_other_flags_is_refused(tmp_path):
    learning_table.check_same_command(tmp_path, ["--seed", "0"])
    learning_table.check_same_command(tmp_path, ["--seed", "1"])  # nothing trained yet (a failed start): replaced
    (tmp_path / "row" / "run_1" / "checkpoints" / "iter_2").mkdir(parents=True)
    learning_table.check_same_command(tmp_path, ["--seed", "1"])  # the same run: fine
    with pytest.raises(ValueError, match="holds a run of other flags: it ran --seed 1, this command asks for --seed 0"):
        learning_table.check_same_command(tmp_path, ["--seed", "0"])


def test_a_recorded_number_spelled_otherwise_is_the_same_run(tmp_path):
    """A bench that writes ``2e-5`` where an earlier one recorded ``2e-05`` asks for the same run."""
    learning_table.check_same_command(tmp_path, ["--lr", "2e-05", "--seed", "0"])
    (tmp_path / "row" / "run_1" / "checkpoints" / "iter_2").mkdir(parents=True)
    learning_table.check_same_command(tmp_path, ["--lr", "2e-5", "--seed", "0"])
    with pytest.raises(ValueError, match="holds a run of other flags"):
        learning_table.check_same_command(tmp_path, ["--lr", "3e-5", "--seed", "0"])
    with pytest.raises(ValueError, match="holds a run of other flags"):
        learning_table.check_same_command(tmp_path, ["--lr", "2e-5", "--seed", "0", "--val_only"])


@pytest.mark.slow
def test_a_small_grid_runs_end_to_end_and_a_second_call_skips_finished_runs(tiny_models, tmp_path):
    """Two rows (GRPO and the target alone), one seed, 4 iterations of 16 envs; the second call trains
    nothing (the runs' files are untouched) and writes the same table."""
    command = [sys.executable, "-m", "bench.learning_table", "--rows", "grpo_outcome", "target_alone", "--seeds", "0",
               "--env_steps", "64", "--n_rollout_threads", "16", "--eval_interval", "2", "--save_interval", "2",
               "--eval_limit", "20", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    history = json.loads((tmp_path / "runs" / "grpo_outcome" / "seed_0" / "history.json").read_text())
    assert [h["iteration"] for h in history] == [0, 2, 4]
    # env steps taken so far: asynchronous rollouts (the CPU default) count the batch generated in the background
    assert history[0]["env_steps"] == 0 < history[1]["env_steps"] < history[2]["env_steps"] == 64
    assert 0 <= history[0]["seconds"] < history[1]["seconds"] < history[2]["seconds"]
    table = (tmp_path / "table.md").read_text()
    assert "| grpo_outcome | 0 |" in table and "target_alone" in table
    with open(tmp_path / "results.csv") as file:
        assert [(line["row"], line["iteration"]) for line in csv.DictReader(file)] == [
            ("grpo_outcome", "0"), ("grpo_outcome", "2"), ("grpo_outcome", "4"), ("target_alone", "0")]
    runs = {path: path.stat().st_mtime_ns for path in (tmp_path / "runs").rglob("*") if path.is_file()}
    started = time.perf_counter()
    again = subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    assert time.perf_counter() - started < 30, again.stdout
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "runs").rglob("*") if path.is_file()} == runs
    assert (tmp_path / "table.md").read_text() == table
