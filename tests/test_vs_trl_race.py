"""bench/vs_trl_race.py: time to TRL's final accuracy on hand-written curves (reached, not reached, nothing to
time, reached by TRL before its end, reached by ours past TRL's samples), the mean over seeds, the race's flags as
train_math reads them, each side's finished run kept and reused (refused at other settings, ours' longer run
beside its shorter one), and (slow, with TRL installed) a race on the tiny policy end to end, run again from its
kept sides, and ours run on past TRL's samples against TRL's kept side."""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.vs_trl_race import (Point, finished_sides, first_at, keep_side, mean_curve, parse_args, race_flags,
                              race_line)

ROOT = Path(__file__).resolve().parents[1]


def curve(side: str, *evaluations: tuple[float, float], seed: str = "mean") -> list[Point]:
    """A side's evaluations every 8 iterations of 64 samples, from (minutes, accuracy) pairs."""
    return [Point(side, "full", seed, 8 * i, 512 * i, minutes, accuracy)
            for i, (minutes, accuracy) in enumerate(evaluations)]


TRL = curve("TRL", (0.0, 0.2), (25.0, 0.25), (50.0, 0.45), (75.0, 0.5))


def test_the_time_to_an_accuracy_is_the_first_evaluation_at_or_above_it():
    ours = curve("ours", (0.0, 0.2), (10.0, 0.3), (20.0, 0.5), (30.0, 0.6))
    assert first_at(ours, 0.5) == ours[2] and first_at(ours, 0.3).minutes == 10.0
    assert first_at(ours, 0.61) is None
    assert first_at(curve("ours", (0.0, 0.1), (5.0, 0.3)), 0.1 + 0.2).minutes == 5.0  # 0.30000000000000004


def test_race_line_when_ours_gets_there_first():
    ours = curve("ours", (0.0, 0.2), (10.0, 0.3), (20.0, 0.5), (30.0, 0.6))
    # TRL ends at 0.5, first reached at its last evaluation (75 min); ours has 0.5 at 20 min: 20 / 75 = 0.27
    assert race_line(ours, TRL) == ("time to TRL's final accuracy: ours 20.0 min vs TRL 75.0 min (0.27 x); "
                                    "TRL's final accuracy 0.500, reached at 1024 samples by ours, 1536 by TRL")


def test_race_line_when_ours_gets_there_past_trls_samples():
    ours = curve("ours", (0.0, 0.2), (10.0, 0.3), (20.0, 0.4), (30.0, 0.45), (40.0, 0.55), (50.0, 0.6))
    assert race_line(ours, TRL) == ("time to TRL's final accuracy: ours 40.0 min vs TRL 75.0 min (0.53 x); "
                                    "TRL's final accuracy 0.500, reached at 2048 samples by ours, 1536 by TRL")


def test_race_line_when_ours_never_gets_there():
    ours = curve("ours", (0.0, 0.2), (10.0, 0.3), (20.0, 0.45), (30.0, 0.49))
    assert race_line(ours, TRL) == ("time to TRL's final accuracy: ours not reached vs TRL 75.0 min (n/a); TRL's "
                                    "final accuracy 0.500 (ours evaluated to 1536 samples)")


def test_trl_reaching_its_final_accuracy_before_its_end_counts_from_there():
    trl = curve("TRL", (0.0, 0.2), (25.0, 0.5), (50.0, 0.4), (75.0, 0.5))
    ours = curve("ours", (0.0, 0.2), (10.0, 0.3), (20.0, 0.5), (30.0, 0.6))
    assert race_line(ours, trl).startswith("time to TRL's final accuracy: ours 20.0 min vs TRL 25.0 min (0.80 x)")


@pytest.mark.parametrize("final", [0.2, 0.15])
def test_nothing_to_time_when_trl_ends_no_higher_than_the_start(final):
    trl = curve("TRL", (0.0, 0.2), (25.0, 0.1), (50.0, final))
    ours = curve("ours", (0.0, 0.2), (10.0, 0.3), (20.0, 0.4))
    assert race_line(ours, trl) == ("time to TRL's final accuracy: none to time, TRL's final accuracy "
                                    f"{final:.3f} is not above the start's 0.200")


def test_the_mean_curve_averages_minutes_and_accuracy_over_seeds_per_evaluation():
    points = [*curve("ours", (0.0, 0.2), (10.0, 0.3), seed="0"), *curve("ours", (0.0, 0.2), (14.0, 0.4), seed="1"),
              *curve("TRL", (0.0, 0.2), (30.0, 0.1), seed="0")]
    mean = mean_curve(points, "ours", "full")
    assert [(p.seed, p.iteration, p.samples, p.minutes) for p in mean] == [("mean", 0, 0, 0.0), ("mean", 8, 512, 12.0)]
    assert [p.accuracy for p in mean] == pytest.approx([0.2, 0.35])


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_the_race_flags_are_the_arith_preset_evaluated_by_the_race(mode, untrained_policy_dir):
    from test_train_math import parse

    config = parse(*race_flags(str(untrained_policy_dir), mode, 1, 3, 16, "default", 1))
    assert config.budget.num_iterations == 3 and config.budget.eval_interval == 0 and config.budget.seed == 1
    assert config.env.num_envs == 64 and config.env.group_size == 8 and config.generation.temperature == 0.3
    assert config.generation.max_new_tokens == 128 and config.learning.warmup_iterations == 2
    assert config.model.lora_rank == (16 if mode == "lora" else 0) and config.env.prompt_template == "default"
    assert config.learning.lr == (1e-4 if mode == "lora" else 2e-5) and config.logging.save_interval == 0


def test_each_sides_finished_run_is_reused_at_its_settings_and_refused_at_others(untrained_policy_dir, tmp_path):
    args = parse_args(["--model", str(untrained_policy_dir), "--iterations", "8", "--out", str(tmp_path)])
    ours, trl = curve("ours", (0.0, 0.2), (3.0, 0.4), seed="1"), curve("TRL", (0.0, 0.2), (8.0, 0.3), seed="1")
    assert finished_sides(tmp_path, "full", 1, args) == {}
    assert keep_side(args, "full", 1, "TRL", trl) == trl
    assert finished_sides(tmp_path, "full", 1, args) == {"TRL": trl}  # a side is kept as it finishes
    keep_side(args, "full", 1, "ours", ours)
    assert finished_sides(tmp_path, "full", 1, args) == {"ours": ours, "TRL": trl}
    assert finished_sides(tmp_path, "full", 0, args) == {} and finished_sides(tmp_path, "lora", 1, args) == {}
    copy = shutil.copytree(untrained_policy_dir, tmp_path / "copy")  # the same weights in another directory
    assert finished_sides(tmp_path, "full", 1, parse_args(["--model", str(copy), "--iterations", "8"])) == {
        "ours": ours, "TRL": trl}
    # ours trained longer is another run beside the shorter one; TRL's side, at the same iterations, is reused
    longer = parse_args(["--model", str(untrained_policy_dir), "--iterations", "8", "--ours_iterations", "24",
                         "--out", str(tmp_path)])
    assert finished_sides(tmp_path, "full", 1, longer) == {"TRL": trl}
    other = parse_args(["--model", str(untrained_policy_dir), "--iterations", "8", "--eval_interval", "2",
                        "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="'eval_interval': 8.*another --out"):
        finished_sides(tmp_path, "full", 1, other)


def test_ours_cannot_train_fewer_iterations_than_trl(untrained_policy_dir):
    assert parse_args(["--model", str(untrained_policy_dir), "--iterations", "8"]).ours_iterations == 8
    with pytest.raises(SystemExit):
        parse_args(["--model", str(untrained_policy_dir), "--iterations", "8", "--ours_iterations", "4"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed: pip install -e '.[bench]'")
def test_a_tiny_race_runs_both_modes_end_to_end(tiny_models, tmp_path):
    """Two iterations a side on the trained tiny policy, evaluated on 8 held-out problems after each."""
    command = [sys.executable, "-m", "bench.vs_trl_race", "--model", str(tiny_models.policy), "--prompt_template",
               "default", "--modes", "full", "lora", "--seeds", "0", "--iterations", "2", "--eval_interval", "1",
               "--eval_limit", "8", "--threads", "1", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for mode in ("full", "lora"):
        assert f"{mode}: time to TRL's final accuracy: " in done.stdout  # timed, or why there is nothing to time
    with open(tmp_path / "race.csv") as handle:
        rows = list(csv.DictReader(handle))
    seeds = [(r["mode"], r["side"], r["iteration"], r["samples"]) for r in rows if r["seed"] == "0"]
    assert seeds == [(mode, side, str(i), str(64 * i)) for mode in ("full", "lora") for side in ("ours", "TRL")
                     for i in range(3)]
    start = {(r["mode"], r["side"]): float(r["accuracy"]) for r in rows if r["iteration"] == "0"}
    assert start[("full", "ours")] == start[("full", "TRL")]  # one evaluation of the shared starting weights
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 and float(r["minutes"]) >= 0.0 for r in rows)
    assert {r["seed"] for r in rows} == {"0", "mean"}
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("reusing the finished") == 4 and " ours iteration " not in again.stdout
    with open(tmp_path / "race.csv") as handle:
        assert list(csv.DictReader(handle)) == rows
    longer = subprocess.run([*command[:command.index("--modes")], "--modes", "lora", "--ours_iterations", "3",
                             *command[command.index("--seeds"):]], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert longer.returncode == 0, longer.stdout[-3000:] + longer.stderr[-3000:]
    assert "reusing the finished TRL side" in longer.stdout and " TRL  iteration " not in longer.stdout
    assert " ours iteration   3: " in longer.stdout
    with open(tmp_path / "race.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r["seed"] == "0"]
    assert [(r["side"], r["iteration"]) for r in rows] == [*(("ours", str(i)) for i in range(4)),
                                                           *(("TRL", str(i)) for i in range(3))]
