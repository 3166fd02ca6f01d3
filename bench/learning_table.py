"""Learning results on the built-in tiny models: one grid of ``python train_math.py`` runs, every row
trained for the same budget of env steps with several seeds, each run's held-out accuracy tracked
against env steps and wall time, so that rewards, algorithms and multi-agent set-ups compare on one
footing and the numbers can be reproduced by one command.

    python -m bench.learning_table [--rows grpo_outcome appo ...] [--seeds 0 1 2] [--env_steps 81920]
                                   [--eval_interval 100] [--eval_limit 1000] [--save_interval 50]
                                   [--n_rollout_threads 128] [--out runs/learning_table]

Rows (the flags each adds to train_math's defaults: GRPO, the tiny policy on Arith-v0, the verified outcome;
every row samples at temperature 1.0, groups of 8 and a constant lr, see ``GRID_SAMPLING``):

- grpo_outcome: the verified outcome alone (``--reward outcome:1.0``; Arith-v0's default adds the step reward).
- grpo_outcome_prm: the tiny PRM's step score beside the outcome (``--reward outcome:1.0,prm:0.2``).
- grpo_outcome_steps: the exact Arith process reward (``--reward outcome:1.0,steps:1.0``).
- appo, tppo: ``--algorithm_name APPO`` / ``TPPO`` (a critic; groups of 1).
- rloo_outcome: RLOO on the verified outcome alone: no implicit PRM (``--process_coef 0``), every group
  kept and none oversampled, so every env step is trained on.
- rloo_filter: PRIME's sampling without its PRM: prompts 4x oversampled and filtered to group accuracy in
  [0.2, 0.8], the outcome stream alone (``--process_coef 0``); the control for rloo_prime.
- rloo_prime: RLOO as PRIME runs it: the implicit PRM's token rewards as a second stream (weight 1, batch-normed),
  prompts 4x oversampled and filtered to group accuracy in [0.2, 0.8] (RLOO's defaults).
- prefix_rl: ``Arith-Prefix-v0``: the tiny policy writes a prefix of at most 12 tokens, the frozen tiny
  target finishes it (``--role_model solver=<target>``, 96 tokens), the writer is paid the team's
  verified answer; its accuracy is the team's.
- chain: ``Arith-Chain-v0`` (solver -> verifier -> refiner), individual credit; debate:
  ``Arith-Debate-v0`` (3 debaters x 2 rounds, majority vote), team credit; both on the tiny team model.

Baselines, evaluation only (one run whatever ``--seeds``: a frozen model's greedy accuracy does not depend
on the seed): target_alone, the tiny target on Arith-v0 (what the Prefix-RL team is measured against);
solver_alone, the tiny team model on Arith-v0 (the multi-agent rows' reference). The untrained writer is
prefix_rl's evaluation at iteration 0.

Iterations follow from the budget: ceil(env steps / (turns per episode x envs per iteration)), so a
multi-agent row (2-3 turns) or RLOO with oversampling runs fewer iterations than GRPO. ``--eval_interval``
is in iterations (train_math's flag); every run is also evaluated at iteration 0 and at its end.

Outputs in ``--out``: ``runs/<row>/seed_<s>/`` (train_math's logdir: TensorBoard, checkpoints, ``best``;
``train.log``; ``history.json`` once the run has finished), ``results.csv`` (one line per row, seed and
evaluation), ``table.md`` (start, best and final held-out accuracy, mean ± sd over seeds, and the env
steps and minutes each row took to gain 10 points over its start) and ``accuracy_vs_env_steps.png`` /
``accuracy_vs_minutes.png`` (one panel per comparison, the mean over seeds with its min-max band).
Minutes are the run's training wall time (the ``seconds`` of each evaluation: start-up excluded, kept
across resumes). Re-running the same command skips finished runs and continues a half-finished one from
its newest checkpoint (``--resume auto``; checkpoints every ``--save_interval`` iterations, only the
newest kept); Ctrl-C lets the current run finish its iteration and save first.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PREFIX_FLAGS = ("--env_id", "Arith-Prefix-v0", "--model_name_or_path", "{policy}", "--role_model", "solver={target}",
                "--reward_assignment", "individual", "--max_new_tokens", "12", "--target_max_new_tokens", "96")
OUTCOME = ("--reward", "outcome:1.0")
"""The verified outcome alone, stated rather than left to Arith-v0's declared default (outcome + steps), so
that a row keeps its meaning when the env's default changes."""
ROWS: dict[str, tuple[str, ...]] = {
    "grpo_outcome": OUTCOME,
    "grpo_outcome_prm": ("--prm_model_name_or_path", "{prm}", "--reward", "outcome:1.0,prm:0.2"),
    "grpo_outcome_steps": ("--reward", "outcome:1.0,steps:1.0"),
    "appo": ("--algorithm_name", "APPO", *OUTCOME),
    "tppo": ("--algorithm_name", "TPPO", *OUTCOME),
    "rloo_outcome": ("--algorithm_name", "RLOO", *OUTCOME, "--process_coef", "0", "--oversample_factor", "1",
                     "--accuracy_lower_bound", "0", "--accuracy_upper_bound", "1"),
    "rloo_filter": ("--algorithm_name", "RLOO", *OUTCOME, "--process_coef", "0"),
    "rloo_prime": ("--algorithm_name", "RLOO", *OUTCOME),
    "prefix_rl": PREFIX_FLAGS,
    "chain": ("--env_id", "Arith-Chain-v0", "--reward_assignment", "individual"),
    "debate": ("--env_id", "Arith-Debate-v0", "--reward_assignment", "team"),
}
"""Trained rows: name -> the flags added to train_math's; {policy}, {target}, {team}, {prm}: the tiny models."""
GRID_SAMPLING = ("--temperature", "1.0", "--lr_schedule", "constant")
GRID_GROUPS = ("--group_size", "8")
"""Every trained row samples at temperature 1.0 with a constant lr, and the rows that compare samples within
a group (GRPO, RLOO) do so in groups of 8: GRPO's usual setting, kept fixed so that rows compare like with
like (train_math's defaults, 0.5, 4 and an lr decayed over the run, are tuned for the default run; a decayed
lr would also make each evaluation's step size depend on ``--env_steps``)."""
CRITIC_ROWS = ("appo", "tppo")
"""Rows whose algorithm has a critic and groups of 1."""
BASELINES: dict[str, tuple[str, ...]] = {
    "target_alone": ("--model_name_or_path", "{target}", "--max_new_tokens", "96"),
    "solver_alone": ("--model_name_or_path", "{team}"),
}
"""Evaluation-only rows: the model's accuracy at iteration 0 of a one-iteration run."""
BASELINE_RUN = ("--num_env_steps", "8", "--n_rollout_threads", "8", "--eval_interval", "1", "--save_interval", "0")
"""One iteration of 8 envs, evaluated at iteration 0 (kept) and at its end (dropped)."""
COMPARISONS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("outcome vs process rewards (GRPO)", ("grpo_outcome", "grpo_outcome_prm", "grpo_outcome_steps"), ()),
    ("algorithms", ("grpo_outcome", "appo", "tppo", "rloo_outcome"), ()),
    ("PRIME (RLOO)", ("rloo_outcome", "rloo_filter", "rloo_prime"), ()),
    ("Prefix-RL (team accuracy)", ("prefix_rl",), ("target_alone", "writer_untrained")),
    ("multi-agent", ("chain", "debate"), ("solver_alone",)),
)
"""Plot panels: (title, rows drawn as curves, baselines drawn as horizontal lines)."""
GAIN = 0.10  # "+10 points" over a run's start
GROUP_SIZE = 8  # GRPO's and RLOO's default group: --n_rollout_threads must be a multiple of it
COMMAND_FILE, HISTORY_FILE, LOG_FILE = "command.json", "history.json", "train.log"
CSV_KEYS = ("row", "seed", "iteration", "env_steps", "seconds", "accuracy", "mean_length")

Results = dict[str, dict[int, list[dict[str, float]]]]  # row -> seed -> evaluation history


# -------------------------------------------------------------------------------------------------
# Running train_math (shared with bench/multi_agent_learning.py)
# -------------------------------------------------------------------------------------------------

def train_math_history(flags: Sequence[str], logdir: Path) -> list[dict[str, float]]:
    """The evaluation history of ``python train_math.py FLAGS --logdir LOGDIR --resume auto``.

    A run that finished before is read back from ``LOGDIR/history.json``; otherwise the run starts, or
    continues from its newest checkpoint, its output going to ``LOGDIR/train.log``, and its history is
    read from its last checkpoint's ``trainer_state.json`` (a ``--val_only`` run's from its
    ``eval_history.json``) and kept in ``history.json``. A LOGDIR that holds a run of other flags is refused."""
    logdir = logdir.resolve()  # train_math runs in the repository root
    logdir.mkdir(parents=True, exist_ok=True)
    check_same_command(logdir, list(flags))
    finished = logdir / HISTORY_FILE
    if finished.is_file():
        return json.loads(finished.read_text())
    run_to_the_end([*flags, "--logdir", str(logdir), "--resume", "auto"], logdir / LOG_FILE)
    if "--val_only" in flags:  # one evaluation, no checkpoint: the history train_math wrote at its end
        history = json.loads((newest_run_dir(logdir) / "eval_history.json").read_text())
    else:
        history = json.loads((newest_checkpoint(logdir) / "trainer_state.json").read_text())["history"]
    finished.write_text(json.dumps(history, indent=1))
    return history


def same_values(recorded: list[str], flags: list[str]) -> bool:
    """Whether two flag lists say the same, numbers compared by value (``2e-05`` is ``2e-5``)."""
    def value(token: str) -> str | float:
        try:
            return float(token)
        except ValueError:
            return token
    return len(recorded) == len(flags) and all(value(a) == value(b) for a, b in zip(recorded, flags))



def same_settings(recorded: dict[str, object], settings: dict[str, object]) -> bool:
    """Whether two settings say the same, flag lists compared by ``same_values``."""
    def same(a: object, b: object) -> bool:
        return same_values(a, b) if isinstance(a, list) and isinstance(b, list) else a == b
    return recorded.keys() == settings.keys() and all(same(recorded[key], settings[key]) for key in settings)


def kept_record(path: Path, settings: dict[str, object], what: str, option: str) -> dict | None:
    """The record of a finished ``what`` that ``keep_record`` wrote to ``path``, None if there is none; raises if
    it ran at other settings (another ``option`` keeps both)."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if not same_settings(record["settings"], settings):
        raise ValueError(f"{path} holds a {what} of {record['settings']}, not of {settings}: give another "
                         f"{option}, or delete it to run again")
    print(f"reusing the finished {what} kept in {path}", flush=True)
    return record


def keep_record(path: Path, settings: dict[str, object], **record: object) -> None:
    """Writes a finished run's ``record`` with the ``settings`` it ran at (what ``kept_record`` reuses it at)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, **record}, indent=1))


def check_same_command(logdir: Path, flags: list[str]) -> None:
    """Records the run's flags in ``LOGDIR/command.json``; raises if a run of other flags has already
    trained there (a checkpoint or a finished history; a run that never got that far is replaced)."""
    recorded = logdir / COMMAND_FILE
    before = json.loads(recorded.read_text()) if recorded.is_file() else None
    if before is not None and same_values(before, flags):
        return
    if before is not None and ((logdir / HISTORY_FILE).is_file() or any(logdir.glob("*/run_*/checkpoints/iter_*"))):
        raise ValueError(f"{logdir} holds a run of other flags: it ran {shlex.join(before)}, this command asks "
                         f"for {shlex.join(flags)}. Pass another --out (or --logdir), or delete {logdir} to start over")
    recorded.write_text(json.dumps(flags))


def run_to_the_end(flags: list[str], log_file: Path) -> None:
    """Runs ``python train_math.py FLAGS`` to its end, its output appended to ``log_file``. Interrupted
    (Ctrl-C, SIGTERM, SIGHUP), it passes the run one SIGINT, so that the run finishes its iteration and
    saves a checkpoint, waits for that, and raises KeyboardInterrupt. Raises RuntimeError when the run
    fails or was stopped before its end."""
    command = [sys.executable, str(ROOT / "train_math.py"), *flags]
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    with open(log_file, "a") as log, terminations_interrupt():
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        # a session of its own: a Ctrl-C in the terminal reaches only this process, which passes it on once
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                                   env={**os.environ, "PYTHONPATH": path}, start_new_session=True)
        try:
            out, _ = process.communicate()
        except KeyboardInterrupt:
            process.send_signal(signal.SIGINT)
            log.write(process.communicate()[0])
            raise KeyboardInterrupt(f"the run in {log_file.parent} saved a checkpoint after its current iteration "
                                    "(see train.log there); the same command continues it") from None
        log.write(out)
    if process.returncode:
        tail = "".join(log_file.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{shlex.join(command)} failed with exit code {process.returncode}; the end of "
                           f"{log_file}:\n{tail}")
    stopped = [line for line in out.splitlines() if line.startswith("stopped by")]
    if stopped:
        raise RuntimeError(f"{shlex.join(command)} was stopped before its end ({stopped[0]}); run the same command "
                           "again to continue it")


@contextlib.contextmanager
def terminations_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does (in the main thread; handlers restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def newest_run_dir(logdir: Path) -> Path:
    """The newest run directory (``<experiment>/run_<time>``) under ``logdir``."""
    runs = sorted(logdir.glob("*/run_*"), key=lambda path: path.name)
    if not runs:
        raise RuntimeError(f"train_math.py left no run directory under {logdir}; see {logdir / LOG_FILE}")
    return runs[-1]


def newest_checkpoint(logdir: Path) -> Path:
    """The newest complete checkpoint of the newest run under ``logdir`` (``<experiment>/run_<time>``)."""
    from train import checkpoint_files

    for run_dir in sorted(logdir.glob("*/run_*"), key=lambda path: path.name, reverse=True):
        latest = checkpoint_files.find_latest(run_dir)
        if latest is not None:
            return latest
    raise RuntimeError(f"train_math.py left no complete checkpoint under {logdir}; see {logdir / LOG_FILE}")


# -------------------------------------------------------------------------------------------------
# The grid
# -------------------------------------------------------------------------------------------------

def tiny_model_paths(rows: Sequence[str]) -> dict[str, str]:
    """{policy, target, team, prm}: the built tiny models' directories, when a row names one."""
    wanted = {**ROWS, **BASELINES}
    if not any("{" in flag for row in rows for flag in wanted[row]):
        return {}
    from models.tiny import shipped_models

    models = shipped_models()
    return {kind: str(getattr(models, kind)) for kind in ("policy", "target", "team", "prm")}


def run_flags(row: str, seed: int, args: argparse.Namespace, models: dict[str, str]) -> list[str]:
    """The train_math flags of one run of ``row`` (its logdir and --resume aside)."""
    common = ["--seed", str(seed), "--eval_limit", str(args.eval_limit), "--keep_checkpoints", "1",
              "--experiment_name", row]
    if row in BASELINES:
        extra = [*BASELINES[row], *BASELINE_RUN]
    else:
        groups = () if row in CRITIC_ROWS else GRID_GROUPS
        extra = [*ROWS[row], *GRID_SAMPLING, *groups, "--num_env_steps", str(args.env_steps),
                 "--n_rollout_threads", str(args.n_rollout_threads),
                 "--eval_interval", str(args.eval_interval), "--save_interval", str(args.save_interval)]
    return common + [flag.format(**models) if "{" in flag else flag for flag in extra]


def run_grid(args: argparse.Namespace) -> Results:
    """Every selected row for every seed (baselines: the first seed only), one run at a time."""
    models = tiny_model_paths(args.rows)
    results: Results = {}
    for row in args.rows:
        for seed in args.seeds[:1] if row in BASELINES else args.seeds:
            history = train_math_history(run_flags(row, seed, args, models), args.out / "runs" / row / f"seed_{seed}")
            results.setdefault(row, {})[seed] = history[:1] if row in BASELINES else history
            last = history[-1]
            print(f"{row} seed {seed}: accuracy {history[0]['eval/accuracy']:.3f} -> {last['eval/accuracy']:.3f} "
                  f"({last['env_steps']} env steps, {last['seconds'] / 60:.1f} min)", flush=True)
    return results


# -------------------------------------------------------------------------------------------------
# Aggregation
# -------------------------------------------------------------------------------------------------

def accuracies(history: list[dict[str, float]]) -> list[float]:
    return [entry["eval/accuracy"] for entry in history]


def first_gain(history: list[dict[str, float]], gain: float = GAIN) -> dict[str, float] | None:
    """The first evaluation at least ``gain`` above the run's start (its iteration-0 evaluation), or None."""
    start = history[0]["eval/accuracy"]
    return next((entry for entry in history if entry["eval/accuracy"] - start >= gain - 1e-9), None)


def mean_sd(values: Sequence[float], digits: int = 3) -> str:
    """"mean ± sd" (sample standard deviation over seeds); the value alone for one seed."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def to_gain(histories: dict[int, list[dict[str, float]]]) -> tuple[str, str]:
    """(env steps, minutes) to +10 points over the start, means over the seeds that got there ("k/n seeds"
    when not all did; "-" when none did)."""
    reached = [entry for entry in map(first_gain, histories.values()) if entry is not None]
    if not reached:
        return "-", "-"
    partial = f" ({len(reached)}/{len(histories)} seeds)" if len(reached) < len(histories) else ""
    steps = np.mean([entry["env_steps"] for entry in reached])
    minutes = np.mean([entry["seconds"] for entry in reached]) / 60
    return f"{steps:,.0f}{partial}", f"{minutes:.1f}{partial}"


def table_row(row: str, histories: dict[int, list[dict[str, float]]]) -> str:
    """row | seeds | start | best | final | to +10 points (env steps, minutes) | at the end (env steps, minutes)."""
    runs = [histories[seed] for seed in sorted(histories)]
    steps, minutes = to_gain(histories)
    end_steps = np.mean([h[-1]["env_steps"] for h in runs])
    end_minutes = np.mean([h[-1]["seconds"] for h in runs]) / 60
    cells = [row, " ".join(map(str, sorted(histories))), mean_sd([accuracies(h)[0] for h in runs]),
             mean_sd([max(accuracies(h)) for h in runs]), mean_sd([accuracies(h)[-1] for h in runs]), steps, minutes,
             f"{end_steps:,.0f}", f"{end_minutes:.1f}"]
    return f"| {' | '.join(cells)} |"


def baseline_values(results: Results) -> dict[str, list[float]]:
    """Each baseline's accuracy per seed: the evaluation-only rows, and the untrained writer (prefix_rl's
    iteration 0)."""
    values = {row: [h[0]["eval/accuracy"] for h in results[row].values()] for row in BASELINES if row in results}
    if "prefix_rl" in results:
        values["writer_untrained"] = [h[0]["eval/accuracy"] for h in results["prefix_rl"].values()]
    return values


BASELINE_NOTES = {
    "target_alone": "the tiny target alone on Arith-v0 (no prefix)",
    "writer_untrained": "prefix_rl at iteration 0: the target finishing the untrained writer's prefixes",
    "solver_alone": "the tiny team model alone on Arith-v0 (the multi-agent rows' reference)",
}


def table_markdown(results: Results) -> str:
    """The per-row table of trained rows, then the baselines'."""
    lines = ["| row | seeds | start | best | final | env steps to +10 points | minutes to +10 points | env steps | "
             "minutes |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [table_row(row, results[row]) for row in ROWS if row in results]
    baselines = baseline_values(results)
    if baselines:
        lines += ["", "| baseline (evaluation only) | accuracy |", "| --- | --- |"]
        lines += [f"| {name}: {BASELINE_NOTES[name]} | {mean_sd(values)} |" for name, values in baselines.items()]
    return "\n".join(lines) + "\n"


def csv_rows(results: Results) -> list[dict[str, object]]:
    """One dict per (row, seed, evaluation): CSV_KEYS, then every other ``eval/`` metric (PRM score, each
    role's), named without the prefix."""
    lines = []
    for row in (name for name in (*ROWS, *BASELINES) if name in results):
        for seed in sorted(results[row]):
            for entry in results[row][seed]:
                line = {"row": row, "seed": seed, "iteration": entry["iteration"], "env_steps": entry["env_steps"],
                        "seconds": round(entry["seconds"], 3)}
                line.update({key.removeprefix("eval/"): value for key, value in entry.items()
                             if key.startswith("eval/")})
                lines.append(line)
    return lines


def write_csv(results: Results, path: Path) -> None:
    lines = csv_rows(results)
    extra = sorted({key for line in lines for key in line} - set(CSV_KEYS))
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[*CSV_KEYS, *extra], restval="")
        writer.writeheader()
        writer.writerows(lines)


def curve(histories: dict[int, list[dict[str, float]]], x: str) -> tuple[np.ndarray, ...]:
    """(x, mean, min, max) over seeds at each iteration every seed evaluated; x is averaged over seeds
    ("seconds" is given in minutes)."""
    common = sorted(set.intersection(*({e["iteration"] for e in h} for h in histories.values())))
    by_iteration = [[next(e for e in h if e["iteration"] == i) for h in histories.values()] for i in common]
    scale = 60.0 if x == "seconds" else 1.0
    xs = np.array([np.mean([e[x] for e in entries]) / scale for entries in by_iteration])
    ys = np.array([[e["eval/accuracy"] for e in entries] for entries in by_iteration])
    return xs, ys.mean(axis=1), ys.min(axis=1), ys.max(axis=1)


COLORS = {name: f"C{index % 10}" for index, name in enumerate([*ROWS, *BASELINES, "writer_untrained"])}
"""One colour per row in every panel (names that share one never share a panel)."""


def plot(results: Results, out: Path) -> list[Path]:
    """accuracy_vs_env_steps.png and accuracy_vs_minutes.png: a panel per comparison with results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baselines = {name: float(np.mean(values)) for name, values in baseline_values(results).items()}
    panels = [(title, [r for r in rows if r in results], [b for b in lines if b in baselines])
              for title, rows, lines in COMPARISONS]
    panels = [panel for panel in panels if panel[1]]
    if not panels:
        return []
    columns = min(3, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    paths = []
    for x, label, name in (("env_steps", "env steps", "env_steps"), ("seconds", "training wall minutes", "minutes")):
        figure, axes = plt.subplots(rows_of_panels, columns, figsize=(5.5 * columns, 4 * rows_of_panels),
                                    squeeze=False)
        for axis, (title, rows, lines) in zip(axes.flat, panels):
            for row in rows:
                xs, mean, low, high = curve(results[row], x)
                seeds = len(results[row])
                axis.plot(xs, mean, marker=".", color=COLORS[row], label=f"{row} ({seeds} seed{'s' * (seeds > 1)})")
                axis.fill_between(xs, low, high, color=COLORS[row], alpha=0.2)
            for line in lines:
                axis.axhline(baselines[line], linestyle="--", color=COLORS[line], label=line)
            axis.set(title=title, xlabel=label, ylabel="held-out accuracy")
            axis.legend(fontsize="small")
        for axis in axes.flat[len(panels):]:
            axis.set_visible(False)
        figure.tight_layout()
        path = out / f"accuracy_vs_{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


def write_tables(results: Results, out: Path, note: str = "") -> list[Path]:
    """results.csv and table.md (``note`` above the table) in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(results, out / "results.csv")
    (out / "table.md").write_text(f"{note}\n\n{table_markdown(results)}" if note else table_markdown(results))
    return [out / "results.csv", out / "table.md"]


# -------------------------------------------------------------------------------------------------
# Command line
# -------------------------------------------------------------------------------------------------

def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from train.flags import FLAGS as TRAIN_FLAGS  # train_math's defaults (absl flag definitions only)

    default = lambda name: TRAIN_FLAGS[name].default  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=[*ROWS, *BASELINES], choices=[*ROWS, *BASELINES], metavar="ROW",
                        help=f"rows to run (default: all): {', '.join([*ROWS, *BASELINES])}")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--env_steps", type=positive, default=default("num_env_steps"),
                        help="env steps each trained run takes (train_math's --num_env_steps)")
    parser.add_argument("--eval_interval", type=positive, default=default("eval_interval"), help="in iterations")
    parser.add_argument("--eval_limit", type=positive, default=default("eval_limit"),
                        help="held-out problems per evaluation (the first ones of the Arith test split)")
    parser.add_argument("--save_interval", type=positive, default=50,
                        help="checkpoint every this many iterations: a half-finished run resumes from the newest")
    parser.add_argument("--n_rollout_threads", type=positive, default=default("n_rollout_threads"))
    parser.add_argument("--out", type=Path, default=Path("runs") / "learning_table")
    args = parser.parse_args(argv)
    if args.n_rollout_threads % GROUP_SIZE:
        parser.error(f"--n_rollout_threads={args.n_rollout_threads}: the GRPO and RLOO rows sample groups of "
                     f"{GROUP_SIZE}; pass a multiple of {GROUP_SIZE}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))} repeats a seed; give each once")
    args.out = args.out.resolve()
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    plots = importlib.util.find_spec("matplotlib") is not None
    if not plots:  # said before hours of runs, not after them
        print("bench/learning_table.py: matplotlib is not installed: writing the CSV and the table, no plots "
              "(pip install -e '.[bench]')", file=sys.stderr)
    try:
        results = run_grid(args)
    except KeyboardInterrupt as interrupt:
        print(f"bench/learning_table.py: interrupted: {interrupt}", file=sys.stderr)
        raise SystemExit(130) from None
    note = (f"`python -m bench.learning_table {shlex.join(sys.argv[1:] if argv is None else argv)}`: "
            f"{args.env_steps:,} env steps per trained run, {args.n_rollout_threads} envs per iteration, held-out "
            f"greedy accuracy on the first {args.eval_limit} Arith test problems every {args.eval_interval} "
            "iterations; mean ± sd over seeds; minutes of training wall time.")
    for path in [*write_tables(results, args.out, note), *(plot(results, args.out) if plots else [])]:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
