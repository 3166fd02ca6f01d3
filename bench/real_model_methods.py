"""The project's own methods against their controls on a real pretrained model, through ``train_math.py``.

    python -m bench.real_model_methods --method prefix_rl|prime|prime_dynamic|prime_filter_truncated|prime_min_form
                                       |prime_min_form_step|workflow [--seeds 0 1] [--iterations N]
                                       [--eval_interval N] [--eval_limit 500] [--margin 1.5]
                                       [--model DIR] [--out DIR] [--rows ROW ...] [--keep DIR]

SmolLM2-135M-Instruct (``python -m models.smollm2``) under its chat template on the real-model bench's task
(``bench.real_model_learning.ARITH``: sums of two or three one-digit numbers, 500 held out; Prefix-RL's rows
take ``PREFIX_ARITH``, below), full fine-tuning at lr 2e-5 (Prefix-RL's writer and the workflow's roles: LoRA),
sampling at temperature 0.3, 8 prompts x 8 samples an iteration, both cores to one process.
Every run is evaluated greedily on the held-out problems at its start, every ``--eval_interval`` iterations
and at its end. Methods, each beside its control:

- ``prefix_rl``: Prefix-RL (``Arith-Prefix-v0``). The writer, a LoRA adapter (``LORA``: the papers train an
  adapter), writes at most ``PREFIX_TOKENS`` tokens; a frozen
  target, SmolLM2-135M-Instruct in a directory of its own (``<out>/target``, its weights hashed before and
  after every run), continues the solution for at most ``TARGET_TOKENS`` greedily; the writer is paid the
  verified answer of prefix and continuation (``--reward_assignment individual``), and its loss holds a KL to
  its reference (``PREFIX_KL``, k3 as verl's low_var_kl). Controls, evaluated only
  (``--val_only``): ``target_alone``, the target solving alone with the team's whole budget
  (``PREFIX_TOKENS + TARGET_TOKENS`` tokens), and ``writer_alone``, each seed's trained writer (its last
  checkpoint) solving alone with the same budget: what the target adds to the writer's prefix.
  The task, ``PREFIX_ARITH``: sums of three one-digit numbers, train and held-out problems of the one form.
  The team of the untrained writer and the target is right on about a seventh of them (weak, not at zero: a
  group of 8 often holds a right and a wrong answer, so the writer has a signal from the start).
- ``prime``: PRIME (RLOO with the implicit PRM, started from the reference model and updated online,
  ``--prime_update before``, ``--prime_norm batch_norm``, its stream weighted 1:1 with the outcome's, 4x
  oversampling and the [0.2, 0.8] prompt filter: the defaults) against ``rloo_filter``, the paper's control:
  the same RLOO, oversampling and filter with the outcome alone (``--process_coef 0``); ``rloo``, plain RLOO
  without oversampling or filter, beside them. The implicit PRM's learning rate is ``PRM_LR``.
- ``prime_dynamic``: PRIME with its code's sampling (``DYNAMIC``: each prompt drawn once, ``--filter_groups``
  generating rounds of 8 prompts x 8 samples until 8 groups with a right and a wrong answer are in the batch)
  and 4 implicit-PRM steps a batch (``--implicit_prm_num_mini_batch 4``, PRIME's run script's), against
  ``rloo_dynamic``, the same sampling with the outcome alone. An iteration trains 64 samples and generates as
  many rounds as it takes, so the two rows generate different numbers of samples in their ``--iterations``:
  the control trains ``--margin`` times as many iterations and is compared at its first evaluation whose
  generated samples reach PRIME's at its end (as the GRPO row is at the debate's tokens, below).
- ``prime_filter_truncated``: the same pair with PRIME's README's truncation filter on both
  (``FILTER_TRUNCATED``: ``--filter_truncated``, a group holding an answer cut at ``--max_new_tokens`` is not
  kept either), ``rloo_filter_truncated`` its control: no answer that never stopped trains the policy or the
  implicit PRM, which otherwise can learn to pay tokens past the answer.
- ``prime_min_form``: ``prime_dynamic`` with PURE's min-form credit (``--process_credit_assignment min_form``: each
  response's process rewards weighted towards its lowest, so that its process return does not grow with its
  length) against the same control, ``rloo_dynamic`` (whose outcome-only run is the same, and kept runs of it are
  reused).
- ``prime_min_form_step``: ``prime_min_form`` over steps, as PURE weighs them (``--prime_granularity step``: each
  step's summed rewards, a step ending at a blank line), against the same control.
- ``workflow``: a debate (``Arith-Debate-v0``: 3 debaters x 2 rounds, each round's answers shown to every
  debater in the next, majority vote over the last round), one LoRA adapter per debater on the shared base
  (``--noshare_policy``, rank 16, lr 1e-4, as the real-model bench's LoRA mode), each debater paid its own
  verified answer every round (``--reward_assignment individual``), GRPO over PettingLLMs' AT-GRPO groups (a
  message z-scored among the messages its debater said at that round of that problem: ``--agent_groups
  at_grpo``); 4 problems x 8 debates an iteration, ``WORKFLOW_SAMPLES`` = 6 messages each. Controls:
  ``grpo_equal_tokens``, the single agent (one LoRA adapter, the same rank and lr) trained with GRPO, compared
  at equal generated tokens (below); ``single_majk``, the untrained single agent's maj@6 (``--eval_samples 6``
  at the training temperature, 0.3): a vote over as many samples per problem as the debate says; and
  ``workflow_untrained``, the debate before training: the ``workflow`` row's first evaluation (greedy; a LoRA
  adapter starts as the base, so every seed's is the same debate), read off its history, not run again.

Comparisons are at equal generated samples: each row's ``env_steps`` counts every sample generated
(oversampled ones included), and each run gets ``--iterations`` x ``SAMPLES_PER_ITERATION`` of them (so an
oversampling row runs a quarter of the iterations, the debate a third: each of its iterations generates 192
messages, and its ``env_steps`` counts 2 a debate, its turns). The GRPO row is compared at equal generated
tokens instead: train_math logs the tokens the rollouts generated (``generated_tokens``: every role's, in each
evaluation's history entry), the GRPO row trains ``--margin`` times the debate's samples (its answers may
be shorter than the debaters' messages, and shorten as it learns), and its evaluation compared is, per seed,
the first whose generated tokens reach the debate's at its end (a line per seed says where, and how many
tokens that was; its curve goes on beyond): it evaluates every third of ``--eval_interval``, which bounds how
far past them that is (the dynamic-sampling control evaluates every half). Where the run ended short, its last
evaluation is compared and the comparison line names the ratio instead of "equal generated tokens" (run again
with a larger ``--margin`` in another ``--out``).

Per comparison one line ends ``METHOD A -> B vs CONTROL A -> C at equal samples (+D points, Z standard
errors)`` (``at equal generated tokens`` for the GRPO row): A the start, B and C the two-seed means of the
final accuracies (the row's metric: greedy accuracy, maj@6 for ``single_majk``), D = B - C, and Z = D over the
standard error of that difference, each mean's standard error the larger of the binomial one
(sqrt(sum p(1-p)/n) / seeds) and the spread of the seeds (their sd / sqrt(seeds)).

Outputs in ``--out``: ``runs/<row>/seed_<s>/`` (train_math's logdir and ``train.log``), ``curve.csv`` (one
line per row, seed and evaluation), ``curve_samples.png`` (``curve_tokens.png`` for the workflow) and
``curve_minutes.png`` (with matplotlib). Runs that finished are reused; an interrupted one continues from its
last checkpoint. A run's outputs are large (checkpoints); its evaluation history is small: with ``--keep DIR``
each finished run's history is kept in ``DIR/<row>_seed_<s>.json`` with the settings and the commit it ran at,
and reused from there at the same settings (refused at others), so a bench longer than one sitting can be run a
row and a seed at a time (``--rows``) and its kept runs carried to another machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from bench.learning_table import ROOT, Results, keep_record, kept_record, newest_run_dir, train_math_history
from bench.real_model_learning import (ARITH, MICRO_BATCH_TOKENS, default_model, model_identity, pyplot,
                                      standard_error, weights_digest)

PREFIX_TOKENS, TARGET_TOKENS = 32, 128  # Prefix-RL's writer budget (the paper's 32-64 tokens) and the target's
PREFIX_KL = 0.05  # the writer's KL to its reference (the loss's low_var_kl term), as Prefix-RL's PPO code keeps one
PRM_LR = 4e-5  # PRIME's paper: the PRM at twice the policy's lr (1e-6 against 5e-7)
SAMPLES_PER_ITERATION = 64  # 8 prompts x 8 samples
DEBATERS, ROUNDS = 3, 2  # Arith-Debate-v0's
WORKFLOW_SAMPLES = DEBATERS * ROUNDS  # messages a debate says per problem: the single agent's k for maj@k
DEBATES = 32  # 4 problems x 8 debates an iteration (groups of 8 per debater and round)
PREFIX_ARITH = {**ARITH, "min_ops": 2}
"""Prefix-RL's task: sums of three one-digit numbers (1,000 distinct), 500 held out and 500 to train on, both
drawn from the one form. The shared task's held-out set takes all 100 two-number sums, a form its training set
never holds: a writer trained there learns prefixes for three numbers and is tested on two."""


def task_flags(arith: dict[str, object]) -> tuple[str, ...]:
    """The real-model bench's task (``arith``) and GRPO settings (bench.real_model_learning), shared by every
    row."""
    return ("--env_kwargs", json.dumps({"arith": arith}), "--prompt_template", "chat", "--reward", "outcome:1.0",
            "--temperature", "0.3", "--group_size", "8", "--lr", "2e-5", "--lr_schedule", "constant",
            "--warmup_iterations", "2", "--torch_threads", "2", "--noasync_rollouts",
            "--micro_batch_tokens", str(MICRO_BATCH_TOKENS), "--keep_checkpoints", "1", "--save_interval", "5",
            "--nosave_best")


@dataclass(frozen=True)
class Row:
    """One row: its train_math flags ({model}, {target}: the model directories; {writer}: the seed's trained
    writer), the samples each of its iterations generates, the envs it steps (None: one per sample) and the env
    steps an episode takes, whether it only evaluates (``--val_only``), and whether it depends on the seed (a
    frozen model's greedy accuracy does not: one run, counted once in the standard errors). ``overrides``: flags
    that replace the task's and the bench's (absl keeps a repeated flag's last value); ``budget``: its generated
    samples relative to ``--iterations`` x 64 (``--margin`` where None); ``eval_density``: its evaluations
    per ``--eval_interval``; ``metric``: the history's key compared; ``equal_at``: the history's count
    (``generated_tokens`` or ``env_steps``) at which it is compared with the trained row (module docstring);
    ``arith``: its task; ``start_of``: the row is that row's first
    evaluation (its weights before training), read off its history instead of run (``flags`` empty)."""

    flags: tuple[str, ...]
    samples_per_iteration: int = SAMPLES_PER_ITERATION
    envs_per_iteration: int | None = None
    turns: int = 1
    val_only: bool = False
    seeded: bool = True
    overrides: tuple[str, ...] = ()
    budget: float | None = 1.0
    eval_density: int = 1
    metric: str = "eval/accuracy"
    equal_at: str | None = None
    arith: dict[str, object] = field(default_factory=lambda: ARITH)
    start_of: str | None = None


@dataclass(frozen=True)
class Method:
    """A trained row and its controls, the first control the one it must beat; ``x``: the curves' axis of
    compute, ``env_steps`` (generated samples) or ``generated_tokens``."""

    trained: str
    controls: tuple[str, ...]
    x: str = "env_steps"


PREFIX_TEAM = ("--env_id", "Arith-Prefix-v0", "--role_model", "solver={target}", "--reward_assignment", "individual",
               "--max_new_tokens", str(PREFIX_TOKENS), "--target_max_new_tokens", str(TARGET_TOKENS),
               "--n_rollout_threads", "64", "--kl_coef", str(PREFIX_KL), "--kl_loss_type", "low_var_kl")
ALONE = ("--max_new_tokens", str(PREFIX_TOKENS + TARGET_TOKENS), "--n_rollout_threads", "64")
RLOO = ("--algorithm_name", "RLOO", "--max_new_tokens", "128", "--n_rollout_threads", "64")
SINGLE = ("--model_name_or_path", "{model}", "--max_new_tokens", "128", "--n_rollout_threads", "64")
DEBATE = ("--model_name_or_path", "{model}", "--env_id", "Arith-Debate-v0", "--noshare_policy",
          "--reward_assignment", "individual", "--agent_groups", "at_grpo", "--max_new_tokens", "128",
          "--n_rollout_threads", str(DEBATES))
# PRIME's code's sampling: every prompt once, rounds of generation until the batch holds 8 groups with a right and
# a wrong answer (of 8: accuracies 0.125 to 0.875)
DYNAMIC = ("--oversample_factor", "1", "--filter_groups", "--accuracy_lower_bound", "0.1", "--accuracy_upper_bound",
           "0.9")
# ... and its README's truncation filter: a group in which an answer ran to --max_new_tokens is dropped as well
FILTER_TRUNCATED = (*DYNAMIC, "--filter_truncated")
LORA = ("--lora_rank", "16", "--lr", "1e-4")  # the real-model bench's LoRA mode
# a held-out batch of 32 debates generates 96 messages a round, its second round's prompts holding the first's
DEBATE_OVERRIDES = (*LORA, "--eval_batch_size", "32")


def dynamic_prime(sampling: tuple[str, ...], *options: str) -> Row:
    """PRIME with ``sampling`` (rounds of generation, so a count of samples per iteration it does not fix), 4
    implicit-PRM steps a batch and ``options``."""
    return Row(("--model_name_or_path", "{model}", *RLOO, *sampling, "--implicit_prm_lr", str(PRM_LR),
                "--implicit_prm_num_mini_batch", "4", *options))


def dynamic_control(sampling: tuple[str, ...]) -> Row:
    """``dynamic_prime``'s control: the same sampling with the outcome alone, trained ``--margin`` times PRIME's
    iterations and evaluated twice as often (where it reaches PRIME's samples is found within half an interval)."""
    return Row(("--model_name_or_path", "{model}", *RLOO, *sampling, "--process_coef", "0"), budget=None,
               eval_density=2, equal_at="env_steps")


ROWS: dict[str, Row] = {
    "prefix_rl": Row(("--model_name_or_path", "{model}", *PREFIX_TEAM), turns=2, overrides=LORA, arith=PREFIX_ARITH),
    "target_alone": Row(("--model_name_or_path", "{target}", *ALONE), val_only=True, seeded=False, arith=PREFIX_ARITH),
    "writer_alone": Row(("--model_name_or_path", "{writer}", *ALONE), val_only=True, arith=PREFIX_ARITH),
    "prime": Row(("--model_name_or_path", "{model}", *RLOO, "--implicit_prm_lr", str(PRM_LR)), 4 * 64),
    "rloo_filter": Row(("--model_name_or_path", "{model}", *RLOO, "--process_coef", "0"), 4 * 64),
    "rloo": Row(("--model_name_or_path", "{model}", *RLOO, "--process_coef", "0", "--oversample_factor", "1",
                 "--accuracy_lower_bound", "0", "--accuracy_upper_bound", "1")),
    "prime_dynamic": dynamic_prime(DYNAMIC),
    "rloo_dynamic": dynamic_control(DYNAMIC),
    "prime_filter_truncated": dynamic_prime(FILTER_TRUNCATED),
    "rloo_filter_truncated": dynamic_control(FILTER_TRUNCATED),
    "prime_min_form": dynamic_prime(DYNAMIC, "--process_credit_assignment", "min_form"),
    "prime_min_form_step": dynamic_prime(DYNAMIC, "--process_credit_assignment", "min_form", "--prime_granularity",
                                         "step"),
    "workflow": Row(DEBATE, DEBATES * WORKFLOW_SAMPLES, DEBATES, ROUNDS, overrides=DEBATE_OVERRIDES),
    "workflow_untrained": Row((), val_only=True, seeded=False, start_of="workflow"),
    # evaluated 3 times as often: where it reaches the debate's tokens is found within a third of an interval
    "grpo_equal_tokens": Row(SINGLE, overrides=LORA, budget=None, eval_density=3, equal_at="generated_tokens"),
    "single_majk": Row((*SINGLE, "--eval_samples", str(WORKFLOW_SAMPLES), "--eval_temperature", "0.3"),
                       val_only=True, metric=f"eval/maj_at_{WORKFLOW_SAMPLES}"),
}
METHODS = {"prefix_rl": Method("prefix_rl", ("target_alone", "writer_alone")),
           "prime": Method("prime", ("rloo_filter", "rloo")),
           "prime_dynamic": Method("prime_dynamic", ("rloo_dynamic",)),
           "prime_filter_truncated": Method("prime_filter_truncated", ("rloo_filter_truncated",)),
           "prime_min_form": Method("prime_min_form", ("rloo_dynamic",)),
           "prime_min_form_step": Method("prime_min_form_step", ("rloo_dynamic",)),
           "workflow": Method("workflow", ("grpo_equal_tokens", "single_majk", "workflow_untrained"),
                              x="generated_tokens")}
CSV_KEYS = ("row", "seed", "iteration", "env_steps", "generated_tokens", "minutes", "metric", "accuracy",
            "standard_error", "readable", "mean_length")
X_LABELS = {"env_steps": "generated samples", "generated_tokens": "generated tokens", "minutes": "training minutes"}


def target_copy(model: Path, out: Path) -> Path:
    """``out/target``: the frozen target's own copy of ``model`` (made once)."""
    target = out / "target"
    if not target.is_dir():
        shutil.copytree(model, target)
    return target


def writer_dir(out: Path, seed: int) -> Path:
    """The Prefix-RL writer of ``seed`` as its run ended: the policy of its last checkpoint."""
    logdir = out / "runs" / "prefix_rl" / f"seed_{seed}"
    checkpoints = sorted(newest_run_dir(logdir).glob("checkpoints/iter_*"), key=lambda p: int(p.name.split("_")[1]))
    if not checkpoints:
        raise FileNotFoundError(f"no checkpoint of the Prefix-RL writer under {logdir}: its run did not finish")
    return checkpoints[-1] / "policy"


def row_flags(row: str, seed: int, args: argparse.Namespace, models: dict[str, str]) -> list[str]:
    """train_math's flags for one row and seed (its logdir and --resume aside): ``--iterations`` x
    ``SAMPLES_PER_ITERATION`` generated samples times the row's budget, evaluated at the same sample counts in
    every row."""
    spec = ROWS[row]
    flags = [flag.format(**models) for flag in spec.flags] + list(task_flags(spec.arith)) + [
        "--seed", str(seed), "--eval_limit", str(args.eval_limit), "--eval_batch_size", str(min(args.eval_limit, 250)),
        "--experiment_name", row, *spec.overrides]
    if spec.val_only:
        return flags + ["--val_only"]
    budget = args.margin if spec.budget is None else spec.budget
    iterations = round(budget * args.iterations * SAMPLES_PER_ITERATION) // spec.samples_per_iteration
    interval = max(1, args.eval_interval * SAMPLES_PER_ITERATION // (spec.samples_per_iteration * spec.eval_density))
    envs = spec.envs_per_iteration or spec.samples_per_iteration
    return flags + ["--num_env_steps", str(iterations * envs * spec.turns), "--eval_interval", str(interval)]


def kept_path(keep: Path, row: str, seed: int) -> Path:
    return keep / f"{row}_seed_{seed}.json"


def kept_settings(row: str, seed: int, args: argparse.Namespace) -> dict[str, object]:
    """What a kept run must share with this invocation to be reused: the model's weights and the row's
    flags, its model directories named by their placeholders (the target's copy and the writer's checkpoint live
    in ``--out``)."""
    placeholders = {"model": "{model}", "target": "{target}", "writer": "{writer}"}
    return {"model": model_identity(args.model), "flags": row_flags(row, seed, args, placeholders)}


def kept_history(keep: Path, row: str, seed: int, args: argparse.Namespace) -> list[dict[str, float]] | None:
    """The evaluation history of ``row`` and ``seed`` kept in ``keep`` by an earlier invocation, None if there is
    none; raises if it ran at other settings (another ``--keep`` keeps both)."""
    record = kept_record(kept_path(keep, row, seed), kept_settings(row, seed, args), "run", "--keep")
    return None if record is None else record["history"]


def keep_history(keep: Path, row: str, seed: int, args: argparse.Namespace, history: list[dict[str, float]]) -> None:
    """Writes one finished run's history, the settings it ran at and the commit it ran on into ``keep``."""
    keep_record(kept_path(keep, row, seed), kept_settings(row, seed, args), commit=source_commit(), history=history)


def source_commit() -> str:
    """The repository's HEAD commit ("unknown" outside a git checkout), with "+changes" if files differ from it."""
    def git(*command: str) -> str:
        done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    head = git("rev-parse", "HEAD")
    return (head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")) or "unknown"


def run_method(args: argparse.Namespace) -> Results:
    """{row: {seed: evaluation history}} of ``--rows`` (default: the method's rows); raises if a run changed
    the target's weights. With ``--keep``, a run kept there is reused and a finished one kept."""
    models = {"model": args.model, "target": str(target_copy(Path(args.model), args.out))}
    digest = weights_digest(Path(models["target"]))
    results: Results = {}
    for row in args.rows:
        start_of = ROWS[row].start_of
        if start_of is not None:  # parse_args put its row before it
            first_seed = next(iter(results[start_of]))
            results[row] = {first_seed: results[start_of][first_seed][:1]}
            continue
        results[row] = {}
        for seed in args.seeds if ROWS[row].seeded else args.seeds[:1]:
            kept = kept_history(args.keep, row, seed, args) if args.keep else None
            if kept is not None:
                results[row][seed] = kept
                continue
            seed_models = {**models, "writer": str(writer_dir(args.out, seed)) if row == "writer_alone" else ""}
            flags = row_flags(row, seed, args, seed_models)
            results[row][seed] = train_math_history(flags, args.out / "runs" / row / f"seed_{seed}")
            if args.keep:
                keep_history(args.keep, row, seed, args, results[row][seed])
    if weights_digest(Path(models["target"])) != digest:
        raise RuntimeError(f"the frozen target's weights in {models['target']} changed during the runs")
    print(f"frozen target {models['target']}: weights sha256 {digest[:16]} before and after the runs", flush=True)
    return results


def at_least(history: list[dict[str, float]], key: str, count: float) -> list[dict[str, float]]:
    """``history`` up to its first evaluation whose ``key`` is at or past ``count`` (all of it if none is)."""
    for index, evaluation in enumerate(history):
        if evaluation[key] >= count:
            return history[:index + 1]
    return history


def align_at(results: Results, trained: str) -> tuple[Results, dict[str, dict[int, float]]]:
    """``results`` with the history of seed s of each row compared at a count (``Row.equal_at``) cut at the
    trained row's count at the end of seed s (``at_least``), and {row: {seed: its count there over the trained
    row's}}."""
    aligned, ratios = dict(results), {}
    for row in (name for name in results if ROWS[name].equal_at):
        key = ROWS[row].equal_at
        if set(results[row]) != set(results[trained]):
            raise ValueError(f"{row} ran seeds {sorted(results[row])} and {trained} {sorted(results[trained])}: "
                             f"a comparison at equal {X_LABELS[key]} pairs each seed's runs")
        aligned[row], ratios[row] = {}, {}
        for seed, history in results[row].items():
            count = results[trained][seed][-1][key]
            aligned[row][seed] = at_least(history, key, count)
            ratios[row][seed] = aligned[row][seed][-1][key] / count
    return aligned, ratios


def mean_and_error(histories: dict[int, list[dict[str, float]]], n: int,
                   metric: str = "eval/accuracy") -> tuple[float, float]:
    """(the seeds' mean final ``metric``, its standard error: the larger of the binomial one and the seeds'
    spread, sd / sqrt(seeds))."""
    finals = [history[-1][metric] for history in histories.values()]
    k = len(finals)
    binomial = math.sqrt(sum(standard_error(p, n) ** 2 for p in finals)) / k
    spread = statistics.stdev(finals) / math.sqrt(k) if k > 1 else 0.0
    return statistics.fmean(finals), max(binomial, spread)


def difference(method: str, control: str, results: Results, n: int) -> tuple[float, float]:
    """(the method's mean final metric minus the control's, that difference in standard errors)."""
    (b, b_error), (c, c_error) = (mean_and_error(results[row], n, ROWS[row].metric) for row in (method, control))
    error = math.hypot(b_error, c_error)
    return b - c, (b - c) / error if error else math.inf


def comparison(method: str, control: str, results: Results, n: int, basis: str = "equal samples") -> str:
    """``METHOD A -> B vs CONTROL A' -> C at BASIS (+D points, Z standard errors)``, each row's own metric."""
    start, end = {}, {}
    for row in (method, control):
        metric = ROWS[row].metric
        start[row] = statistics.fmean(history[0][metric] for history in results[row].values())
        end[row] = mean_and_error(results[row], n, metric)[0]
    gain, z = difference(method, control, results, n)
    return (f"{method} {start[method]:.3f} -> {end[method]:.3f} vs {control} {start[control]:.3f} -> "
            f"{end[control]:.3f} at {basis} ({100 * gain:+.1f} points, {z:.1f} standard errors)")


def comparisons(method: Method, results: Results, n: int) -> list[str]:
    """The method's lines: one per row compared at a count and seed (where it was compared), then one per
    control that ``results`` holds (none without the trained row)."""
    if method.trained not in results:
        return []
    aligned, ratios = align_at(results, method.trained)
    lines = []
    for row, by_seed in ratios.items():
        key = ROWS[row].equal_at
        for seed, ratio in by_seed.items():
            compared = aligned[row][seed][-1]
            lines.append(f"{row} seed {seed}: compared at iteration {compared['iteration']}, "
                         f"{compared[key]:,.0f} {X_LABELS[key]} ({ratio:.2f}x {method.trained}'s)")
    for control in (row for row in method.controls if row in results):
        basis = "equal samples"
        if ROWS[control].equal_at:
            short, key = min(ratios[control].values()), ROWS[control].equal_at
            basis = (("equal samples" if key == "env_steps" else f"equal {X_LABELS[key]}") if short >= 1 else
                     f"{short:.2f}x {method.trained}'s {X_LABELS[key]} (short of equal: raise --margin)")
        lines.append(comparison(method.trained, control, aligned, n, basis))
    return lines


def curve_rows(results: Results, n: int) -> list[dict[str, object]]:
    """One CSV row per row, seed and evaluation; ``accuracy`` is the row's metric, named in ``metric``
    (``generated_tokens`` empty in a history logged before train_math counted them)."""
    return [{"row": row, "seed": seed, "iteration": h["iteration"], "env_steps": h["env_steps"],
             "generated_tokens": h.get("generated_tokens", ""), "minutes": round(h["seconds"] / 60, 2),
             "metric": ROWS[row].metric, "accuracy": h[ROWS[row].metric],
             "standard_error": round(standard_error(h[ROWS[row].metric], n), 4),
             "readable": h.get("eval/readable", ""), "mean_length": round(h["eval/mean_length"], 1)}
            for row, by_seed in results.items() for seed, history in by_seed.items() for h in history]


def plot(rows: list[dict[str, object]], x: str, path: Path, title: str) -> Path | None:
    """Held-out accuracy (each row's metric) against ``x`` (a key of ``X_LABELS``), one line per row and seed;
    an evaluation-only row is a horizontal line."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(6.5, 4))
    trained = [row for row in rows if not ROWS[str(row["row"])].val_only]
    right = max((float(row[x]) for row in trained), default=1.0)
    for index, name in enumerate(dict.fromkeys(str(row["row"]) for row in rows)):
        metric = ROWS[name].metric
        shown = name if metric == "eval/accuracy" else f"{name} ({metric.split('/')[-1]})"
        for seed in dict.fromkeys(row["seed"] for row in rows if row["row"] == name):
            mine = [row for row in rows if row["row"] == name and row["seed"] == seed]
            xs, ys = [float(row[x]) for row in mine], [float(row["accuracy"]) for row in mine]
            if ROWS[name].val_only:
                xs, ys = [0.0, right], [ys[0], ys[0]]
            axes.plot(xs, ys, color=f"C{index}", marker="" if ROWS[name].val_only else "o",
                      linestyle="--" if ROWS[name].val_only else "-", label=f"{shown} seed {seed}")
    axes.set(xlabel=X_LABELS[x], ylabel="held-out accuracy (greedy unless named)", title=title)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=tuple(METHODS), required=True)
    parser.add_argument("--model", default=None, help="Model directory or hub id (default: SmolLM2-135M-Instruct "
                        "in the cache, from python -m models.smollm2).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=16, help="Budget in iterations of 64 generated samples "
                        "(an oversampling row runs a quarter as many iterations of four times the samples, the "
                        "debate a third as many of 192 messages).")
    parser.add_argument("--eval_interval", type=int, default=8, help="Evaluate every this many iterations of 64 "
                        "samples (and at the start and end).")
    parser.add_argument("--eval_limit", type=int, default=500, help="Held-out problems per evaluation.")
    parser.add_argument("--margin", type=float, default=1.5, help="A row compared at the trained row's generated "
                        "tokens or samples (the workflow's GRPO row, the dynamic-sampling control) trains this many "
                        "times the trained row's budget, so that its count reaches the trained row's (compared "
                        "there).")
    parser.add_argument("--rows", nargs="+", choices=tuple(ROWS), default=None, help="Run these of the method's "
                        "rows only (default: all of them); comparisons are printed for the controls given beside "
                        "the trained row.")
    parser.add_argument("--out", type=Path, default=Path("runs/real_model_methods"))
    parser.add_argument("--keep", type=Path, default=None, help="Directory of finished runs' histories: a run kept "
                        "there at the same settings is reused instead of run, and a run that finishes is kept "
                        "there (as ROW_seed_S.json, with its settings and commit), so that rows and seeds can be "
                        "added one invocation at a time, on another machine too.")
    args = parser.parse_args(argv)
    method = METHODS[args.method]
    rows = (method.trained, *method.controls)
    foreign = [row for row in args.rows or () if row not in rows]
    if foreign:
        parser.error(f"--rows {' '.join(foreign)}: not rows of --method {args.method}; its rows are "
                     f"{' '.join(rows)}")
    args.rows = [row for row in rows if args.rows is None or row in args.rows]  # the trained row first
    for row in args.rows:
        if ROWS[row].start_of not in (None, *args.rows):
            parser.error(f"--rows {row} is read off the first evaluation of {ROWS[row].start_of}: give --rows "
                         f"{ROWS[row].start_of} too")
    if args.margin < 1:
        parser.error(f"--margin {args.margin} is below 1: a row compared at the trained row's tokens or samples "
                     "would train less than the trained row and could not reach them; give 1 or more")
    args.model = args.model or default_model()
    args.out = args.out.resolve()
    args.keep = args.keep.resolve() if args.keep else None
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    method = METHODS[args.method]
    results = run_method(args)
    rows = curve_rows(results, args.eval_limit)
    with open(args.out / "curve.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_KEYS)
        writer.writeheader()
        writer.writerows(rows)
    x_name = "tokens" if method.x == "generated_tokens" else "samples"
    for x, name in ((method.x, f"curve_{x_name}.png"), ("minutes", "curve_minutes.png")):
        plot(rows, x, args.out / name, f"{args.method} on SmolLM2-135M-Instruct")
    for line in comparisons(method, results, args.eval_limit):
        print(line, flush=True)


if __name__ == "__main__":
    main()
