"""GRPO on a real instruct model, ours against ``trl.GRPOTrainer``: held-out accuracy per training minute.

    pip install -e ".[bench]"
    python -m bench.vs_trl_race [--model DIR] [--modes lora full] [--seeds 0 1] [--iterations 24]
                                [--ours_iterations N] [--eval_interval 8] [--eval_limit 500] [--threads 2]
                                [--out runs/vs_trl_race]

The task is ``bench.real_model_learning``'s arith preset: SmolLM2-135M-Instruct (``python -m models.smollm2``)
on sums of two or three one-digit numbers (``ARITH``), prompts under the model's chat template with the answer
instruction as train_math.py renders them, GRPO in groups of 8, 8 prompts an iteration, temperature 0.3, at most
128 new tokens, lr 2e-5 (full fine-tuning) or LoRA rank 16 at lr 1e-4, warmed up linearly over 2 updates then
constant, the verified-answer reward. Ours is that preset's train_math.py configuration
(``real_model_learning.run_flags``), built by ``train.builders.build_runner`` (``bench.vs_trl.OursSide``). TRL's
``GRPOTrainer`` (``bench.vs_trl.TRLSide``) takes its settings from the same parsed configuration
(``bench.vs_trl.trl_config``):

- the same model directory in float32 on the CPU, the same prompt texts in the same order (the problems our env
  draws for each iteration; TRL tokenizes a text prompt as our generator does) and the same reward object
  (``envs.rewards.OutcomeReward``, scoring a completion as our env scores a one-step solution);
- ``num_generations`` 8, 64 completions an optimizer step (``gradient_accumulation_steps`` 8 micro-batches of
  one group, as ours cuts its update into micro-batches of about one group), ``num_iterations`` 1 (our one epoch
  of one minibatch), ``epsilon`` 0.2 (our clip), ``beta`` 0 (no KL, no reference model), ``scale_rewards``
  "group", ``loss_type`` "dapo" (the token mean over the whole batch: our token-mean), ``max_grad_norm`` 1.0,
  temperature 0.3 without top-k or top-p, ``max_completion_length`` 128, ``mask_truncated_completions`` off on
  both sides;
- the optimizer: a fused AdamW without weight decay and our lr schedule (``train.builders.lr_factor``) on
  both sides. TRL's own "constant_with_warmup" would start at lr 0 and spend its first update on nothing;
- LoRA: the same ``peft`` configuration (``models.policy.LoraSettings``: rank 16, alpha 32, every linear layer).

What does not match: ours skips the forward and backward passes of groups whose rewards are all equal, and an
iteration where every group is so takes no optimizer step (its lr schedule does not advance); TRL computes those
groups and steps AdamW on a zero gradient, which its moments still turn into a move. Each side samples with its
own generator (ours: ``models.hf_generation.HFGenerator``; TRL: ``transformers`` ``generate``) from the same
distribution but not the same draws, so even at equal weights their batches differ.

Evaluation: at iteration 0 (the starting weights, the same for both sides: evaluated once), every
``--eval_interval`` iterations and after the last, each side's live weights (TRL's with its LoRA active) are
evaluated by one evaluator (``HeldOut``): ``train.evaluation`` on the first ``--eval_limit`` held-out problems
of the task, greedy, with our HF generator, exactly as train_math.py evaluates. Evaluation time is excluded
from both sides' minutes, which count each side's iterations only (ours: ``Runner.train_iteration``; TRL: from
resuming its loop to its next optimizer step's end). Loading the models is excluded; each side's first iteration
holds what its loop sets up on the way (TRL: ``train()``'s accelerator and dataloader; ours: AdamW's moments).

Both sides train ``--iterations`` iterations, unless ``--ours_iterations`` lets ours go on past TRL's samples
(on the problems its env draws next, the lr schedule of its own length): a race stopped at TRL's samples cannot
time a side that gets to TRL's final accuracy only later. The sides run one after the other (ours, then TRL) for
each mode and seed: both in memory at once would double the footprint of full fine-tuning. On a machine that
others share, the load each side met may differ.

Each side's finished run (a mode, a seed and its iterations) is kept in ``--out``/``races/`` with the settings it
ran at (the model known by its weights' digest), and a later invocation into the same ``--out`` at the same
settings reuses it, so seeds can be added one invocation at a time, on another machine too, and ours run longer
against TRL's kept side. Outputs in ``--out``: ``race.csv`` (one row per side, mode, seed and evaluation, and the
mean over seeds as seed "mean"), ``race.png`` (with matplotlib: accuracy against training minutes and against
samples, one panel pair per mode) and on stdout, per mode, the mean curves and the line
``<mode>: time to TRL's final accuracy: ours M1 min vs TRL M2 min (R x); ...``. TRL's final accuracy is the mean
over seeds of its last evaluation; M1 (M2) is the mean over seeds of ours' (TRL's) training minutes at the first
evaluation whose accuracy, averaged over seeds, is at least that (within 1e-9), and the line says at how many
samples each side got there; M1 is "not reached" if no evaluation of ours gets there; R = M1 / M2 ("n/a" when M1
is not reached). When TRL ends no higher than the start there is no accuracy to race to, and the line says so
instead.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import itertools
import statistics
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from bench.learning_table import keep_record, kept_record
from bench.real_model_learning import TASKS, default_model, model_identity, pyplot, run_flags
from bench.vs_trl import OursSide, Side, TRLSide, check_dependencies, parsed_config, quiet_libraries, trl_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from envs.rewards import RewardModel
    from models.policy import LanguagePolicy
    from train.config import RunConfig

TASK = TASKS["arith"]
SIDES = ("ours", "TRL")
AT_LEAST = 1e-9  # slack of "reached": accuracies averaged over seeds in other orders may differ in the last bit


@dataclass(frozen=True)
class Point:
    """One evaluation of one side's weights: after ``iteration`` iterations (``samples`` completions) and
    ``minutes`` of that side's training time."""

    side: str
    mode: str
    seed: str  # a seed, or "mean" over the seeds
    iteration: int
    samples: int
    minutes: float
    accuracy: float


# -------------------------------------------------------------------------------------------------
# One evaluator for both sides
# -------------------------------------------------------------------------------------------------

@dataclass
class ModelView:
    """What ``HFGenerator`` reads of a policy, over a bare HF model (TRL's, LoRA layers injected and active):
    the model, the tokenizer, the device, no role adapters, float32 without autocast."""

    causal_lm: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device = torch.device("cpu")
    role_adapters: tuple[str, ...] = ()

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class HeldOut:
    """Greedy accuracy of a model on the run's held-out problems: ``train.evaluation.evaluate_sets`` over the
    held-out envs train_math.py builds from ``config``, with an ``HFGenerator`` on the model."""

    def __init__(self, config: RunConfig, reward_model: RewardModel) -> None:
        from models.loading import load_tokenizer
        from models.prompting import build_template
        from train import builders
        from train.resolve import resolved

        config = resolved(config)
        env = config.env
        self.tokenizer = load_tokenizer(builders.model_dir(config.model, multi_agent=False))
        template = build_template(env.prompt_template, self.tokenizer, env.system_prompt, env.answer_instruction)
        train_env, self.envs = builders.build_envs(config, reward_model, self.tokenizer, template)
        train_env.close()
        self.sampling = builders.sampling_of(config.generation, env.action_level, self.tokenizer.eos_token or "")
        self.limit = config.budget.eval_limit

    def accuracy(self, model: LanguagePolicy | ModelView) -> tuple[float, float]:
        """(greedy held-out accuracy of ``model``'s current weights, the seconds it took)."""
        from models.hf_generation import HFGenerator
        from train.evaluation import evaluate_sets

        result = evaluate_sets(self.envs, HFGenerator(model), self.sampling, self.limit)
        return result["eval/accuracy"], result["time/eval"]

    def close(self) -> None:
        for env in self.envs.values():
            env.close()


def trl_model(trl: TRLSide, tokenizer: PreTrainedTokenizerBase) -> ModelView:
    """TRL's live model as the evaluator reads it (through a LoRA model's base, its adapter active)."""
    model = trl.trainer.model
    return ModelView(model.get_base_model() if hasattr(model, "get_base_model") else model, tokenizer)


# -------------------------------------------------------------------------------------------------
# The two sides from one configuration
# -------------------------------------------------------------------------------------------------

def race_flags(model: str, mode: str, seed: int, iterations: int, eval_limit: int, prompt_template: str,
               threads: int) -> list[str]:
    """train_math.py's flags for ours: the arith preset's (``real_model_learning.run_flags``), evaluated by the
    race (not the runner), on the CPU in float32, nothing saved."""
    preset = argparse.Namespace(task="arith", model=model, iterations=iterations, eval_interval=0,
                                eval_limit=eval_limit, seed=seed)
    return [*run_flags(mode, preset), "--prompt_template", prompt_template, "--torch_threads", str(threads),
            "--save_interval", "0", "--nosave_best", "--device", "cpu", "--dtype", "float32"]


def trl_side(config: RunConfig, prompts: list, reward_model: RewardModel, threads: int, out_dir: Path) -> TRLSide:
    """TRL's trainer at ``config``'s settings: full fine-tuning or its LoRA, our lr schedule."""
    from train.builders import lora_settings, lr_factor

    learning, iterations = config.learning, config.budget.num_iterations
    lora = lora_settings(config.model.lora_rank)

    def lr_lambda(step: int) -> float:
        return lr_factor(step, learning.warmup_iterations, learning.lr_schedule, iterations)

    return TRLSide(config.model.name_or_path, prompts, reward_model, trl_config(config, out_dir), threads,
                   peft_config=lora.peft_config() if lora is not None else None, lr_lambda=lr_lambda)


# -------------------------------------------------------------------------------------------------
# The race
# -------------------------------------------------------------------------------------------------

def run_side(side: Side, model: Any, held_out: HeldOut, mode: str, seed: int, iterations: int, eval_interval: int,
             start: float) -> list[Point]:
    """Trains ``side`` for ``iterations`` iterations; ``model`` (its live weights) is evaluated after every
    ``eval_interval``-th and the last. ``start``: the accuracy at iteration 0 (the shared starting weights)."""
    samples_per_iteration, seconds = TASK.samples_per_iteration, 0.0
    points = [Point(side.name, mode, str(seed), 0, 0, 0.0, start)]
    for iteration in range(1, iterations + 1):
        result = side.step()
        seconds += result.seconds
        print(f"{mode} seed {seed} {side.name:<4} iteration {iteration:3d}: {result.seconds:7.1f} s, reward "
              f"{result.mean_reward:.3f}, {result.mean_tokens:.0f} tokens, zero-advantage {result.zero_advantage:.2f}",
              flush=True)
        if iteration % eval_interval == 0 or iteration == iterations:
            accuracy, eval_seconds = held_out.accuracy(model)
            points.append(Point(side.name, mode, str(seed), iteration, iteration * samples_per_iteration,
                                seconds / 60, accuracy))
            print(f"{mode} seed {seed} {side.name:<4} held-out accuracy {accuracy:.3f} after {seconds / 60:.1f} "
                  f"training minutes (evaluated in {eval_seconds:.0f} s)", flush=True)
    return points


def race(mode: str, seed: int, args: argparse.Namespace, out_dir: Path,
         kept: dict[str, list[Point]]) -> dict[str, list[Point]]:
    """Ours, then TRL, from the same starting weights on the same problems: each side's evaluations, ``kept``'s
    sides (from an earlier invocation) reused, the others run and kept in ``args.out`` as each finishes."""
    from envs.rewards import OutcomeReward
    from train.resolve import resolved

    def config_of(iterations: int) -> RunConfig:
        return resolved(parsed_config(race_flags(args.model, mode, seed, iterations, args.eval_limit,
                                                 args.prompt_template, args.threads)))

    config = config_of(args.iterations)
    reward_model = OutcomeReward()  # one object scores both sides
    held_out = HeldOut(config, reward_model)
    points = dict(kept)
    try:
        ours = OursSide(config_of(args.ours_iterations), reward_model, out_dir / "ours")
        try:
            prompts = ours.upcoming_prompts(args.iterations)  # TRL's: the first of ours'
            start = next(iter(kept.values()))[0].accuracy if kept else held_out.accuracy(ours.runner.policy)[0]
            print(f"{mode} seed {seed}: held-out accuracy at the start {start:.3f}", flush=True)
            if "ours" not in kept:
                points["ours"] = keep_side(args, mode, seed, "ours", run_side(
                    ours, ours.runner.policy, held_out, mode, seed, args.ours_iterations, args.eval_interval, start))
        finally:
            ours.close()
        del ours
        gc.collect()  # ours' weights and AdamW states go before TRL's arrive
        if "TRL" not in kept:
            trl = trl_side(config, prompts, reward_model, args.threads, out_dir / "trl")
            try:
                points["TRL"] = keep_side(args, mode, seed, "TRL", run_side(
                    trl, trl_model(trl, held_out.tokenizer), held_out, mode, seed, args.iterations, args.eval_interval,
                    start))
            finally:
                trl.close()
    finally:
        held_out.close()
    return points


def mean_curve(points: Sequence[Point], side: str, mode: str) -> list[Point]:
    """``side``'s evaluations in ``mode`` averaged over the seeds, evaluation by evaluation (seed "mean")."""
    mine = [point for point in points if point.side == side and point.mode == mode]
    iterations = sorted({point.iteration for point in mine})
    curve = []
    for iteration in iterations:
        at = [point for point in mine if point.iteration == iteration]
        curve.append(Point(side, mode, "mean", iteration, at[0].samples, statistics.mean(p.minutes for p in at),
                           statistics.mean(p.accuracy for p in at)))
    return curve


def first_at(curve: Sequence[Point], target: float) -> Point | None:
    """The first evaluation of ``curve`` whose accuracy is at least ``target`` (within ``AT_LEAST``); None if none
    is."""
    return next((point for point in curve if point.accuracy >= target - AT_LEAST), None)


def race_line(ours: Sequence[Point], trl: Sequence[Point]) -> str:
    """``time to TRL's final accuracy: ours M1 min vs TRL M2 min (R x); ...`` of two mean curves (module
    docstring)."""
    target, start = trl[-1].accuracy, trl[0].accuracy
    if target <= start + AT_LEAST:  # both "reach" it at minute 0: nothing to time
        return (f"time to TRL's final accuracy: none to time, TRL's final accuracy {target:.3f} is not above the "
                f"start's {start:.3f}")
    ours_at, trl_at = first_at(ours, target), first_at(trl, target)
    if ours_at is None:
        ours_text, ratio, where = "not reached", "n/a", f" (ours evaluated to {ours[-1].samples} samples)"
    else:
        ours_text, ratio = f"{ours_at.minutes:.1f} min", f"{ours_at.minutes / trl_at.minutes:.2f} x"
        where = f", reached at {ours_at.samples} samples by ours, {trl_at.samples} by TRL"
    return (f"time to TRL's final accuracy: ours {ours_text} vs TRL {trl_at.minutes:.1f} min ({ratio}); TRL's final "
            f"accuracy {target:.3f}{where}")


def side_path(out: Path, mode: str, seed: int, side: str, iterations: int) -> Path:
    return out / "races" / f"{mode}_seed_{seed}_{side}_{iterations}_iterations.json"


def side_iterations(args: argparse.Namespace) -> dict[str, int]:
    """{side: the iterations it trains}."""
    return {"ours": args.ours_iterations, "TRL": args.iterations}


def side_settings(args: argparse.Namespace, side: str) -> dict[str, object]:
    """What a side's finished run must share with this invocation to be reused."""
    return {"model": model_identity(args.model), "iterations": side_iterations(args)[side],
            "eval_interval": args.eval_interval, "eval_limit": args.eval_limit, "threads": args.threads,
            "prompt_template": args.prompt_template}


def keep_side(args: argparse.Namespace, mode: str, seed: int, side: str, points: list[Point]) -> list[Point]:
    """Writes one side's evaluations in one race to ``args.out`` with the settings they ran at; returns them."""
    keep_record(side_path(args.out, mode, seed, side, side_iterations(args)[side]), side_settings(args, side),
                points=[asdict(point) for point in points])
    return points


def finished_sides(out: Path, mode: str, seed: int, args: argparse.Namespace) -> dict[str, list[Point]]:
    """{side: its evaluations} of the sides of the race of ``mode`` and ``seed`` that an earlier invocation
    finished into ``out`` at these iterations; raises if one ran at other settings (another ``--out`` keeps
    both)."""
    kept = {}
    for side, iterations in side_iterations(args).items():
        record = kept_record(side_path(out, mode, seed, side, iterations), side_settings(args, side),
                             f"{side} side", "--out")
        if record is not None:
            kept[side] = [Point(**point) for point in record["points"]]
    return kept


# -------------------------------------------------------------------------------------------------
# Report
# -------------------------------------------------------------------------------------------------

def report(points: list[Point], modes: Sequence[str], out: Path) -> list[Point]:
    """Prints each mode's mean curves and race line; writes ``race.csv`` and ``race.png``; returns the means."""
    means = [point for mode in modes for side in SIDES for point in mean_curve(points, side, mode)]
    with open(out / "race.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[field.name for field in fields(Point)])
        writer.writeheader()
        writer.writerows(asdict(point) for point in [*points, *means])
    for mode in modes:
        ours, trl = (mean_curve(points, side, mode) for side in SIDES)
        print(f"\n{mode}, mean over seeds: {'iteration':>9} {'samples':>8} {'ours min':>9} {'ours acc':>9} "
              f"{'TRL min':>8} {'TRL acc':>8}")
        for mine, theirs in itertools.zip_longest(ours, trl):  # ours may run past TRL's samples
            trl_columns = f"{theirs.minutes:8.1f} {theirs.accuracy:8.3f}" if theirs else ""
            print(f"{'':{len(mode) + 22}}{mine.iteration:9d} {mine.samples:8d} {mine.minutes:9.1f} "
                  f"{mine.accuracy:9.3f} {trl_columns}")
        print(f"{mode}: {race_line(ours, trl)}", flush=True)
    plot(points, means, modes, out / "race.png")
    return means


def plot(points: Sequence[Point], means: Sequence[Point], modes: Sequence[str], path: Path) -> Path | None:
    """Per mode, held-out accuracy against training minutes and against samples: each side's mean over seeds
    (a line) and its seeds (dots)."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(len(modes), 2, figsize=(10, 3.5 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        for side, colour in zip(SIDES, ("tab:blue", "tab:orange")):
            mean = [point for point in means if point.side == side and point.mode == mode]
            seeds = [point for point in points if point.side == side and point.mode == mode]
            for ax, x in zip(row, ("minutes", "samples")):
                ax.plot([getattr(p, x) for p in mean], [p.accuracy for p in mean], marker="o", color=colour,
                        label=f"{side} (mean)")
                ax.scatter([getattr(p, x) for p in seeds], [p.accuracy for p in seeds], color=colour, alpha=0.35,
                           s=12)
                ax.set(xlabel=f"training {x}" if x == "minutes" else "samples", ylabel="held-out greedy accuracy",
                       title=f"{mode}")
        row[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Model directory (default: SmolLM2-135M-Instruct in the cache, "
                        "from python -m models.smollm2).")
    parser.add_argument("--modes", nargs="+", choices=tuple(TASK.modes), default=list(TASK.modes))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="One race per seed and mode.")
    parser.add_argument("--iterations", type=int, default=TASK.iterations, help="GRPO iterations per side.")
    parser.add_argument("--ours_iterations", type=int, default=None, help="GRPO iterations of ours (default: "
                        "--iterations): more lets ours go on past TRL's samples to TRL's final accuracy.")
    parser.add_argument("--eval_interval", type=int, default=TASK.eval_interval,
                        help="Evaluate both sides every this many iterations (and after the last).")
    parser.add_argument("--eval_limit", type=int, default=500, help="Held-out problems per evaluation.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of both sides and the evaluator.")
    parser.add_argument("--prompt_template", choices=("chat", "default"), default="chat",
                        help="chat for an instruct model; default for a model without a chat template (the tiny one).")
    parser.add_argument("--out", type=Path, default=Path("runs/vs_trl_race"))
    args = parser.parse_args(argv)
    for name in ("iterations", "eval_interval", "eval_limit", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    args.ours_iterations = args.iterations if args.ours_iterations is None else args.ours_iterations
    if args.ours_iterations < args.iterations:
        parser.error(f"--ours_iterations={args.ours_iterations} must be >= --iterations={args.iterations}: both "
                     "sides train TRL's samples")
    args.model = args.model or default_model()
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model={args.model} is not a model directory (no config.json): run python -m models.smollm2 "
                     "for the default, or pass one")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not all(side_path(args.out, mode, seed, "TRL", args.iterations).is_file() for mode in args.modes
               for seed in args.seeds):
        check_dependencies("hf")  # TRL's side to run needs it (kept sides rebuild the report without)
    quiet_libraries()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    points: list[Point] = []
    with tempfile.TemporaryDirectory() as scratch:
        for mode in args.modes:
            for seed in args.seeds:
                kept = finished_sides(args.out, mode, seed, args)
                sides = kept if len(kept) == len(SIDES) else race(mode, seed, args, Path(scratch) / f"{mode}_{seed}",
                                                                  kept)
                points += [point for side in SIDES for point in sides[side]]
    report(points, args.modes, args.out)


if __name__ == "__main__":
    main()
