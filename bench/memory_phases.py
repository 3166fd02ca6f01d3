"""Where a real-model run's resident memory goes, phase by phase: evaluation, generation, scoring, the update,
checkpoints.

    python -m bench.memory_phases [--mode full|lora] [--iterations 1] [--eval_limit 250] [--mixed]
                                  [-- extra train_math flags]

Builds the run as ``python train_math.py`` does (``train.builders.build_runner``, ``train.host.set_up``) with
``bench.real_model_learning``'s arith flags (SmolLM2-135M-Instruct, GRPO 8 x 8 at temperature 0.3, 128 new
tokens), evaluating at the start and the end. A thread samples this process's resident set every few
milliseconds and charges each sample to the phase running then; the process's own peak (``ru_maxrss``, which
no sample can miss by more than the few pages the kernel syncs lazily, or the highest sample where that is
higher) is charged to the phase during which it rose. ``--mixed`` pays each sample a fixed
pseudo-random bonus drawn from its text (``bench.vs_trl.TextHashOutcome``), so every group holds differing
rewards and the update trains on all 64 samples: the shape a run reaches once it learns, at its first
iteration.

Prints one row per phase: its calls, the resident set when it first began, the highest sample in it and its
rise over its start, then the process's peak and the phase that reached it, beside the floor that
weights, gradients and AdamW states take. GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

GB = 1e9
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


def peak_resident_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Phase:
    """One phase's calls, the resident set when it first began, the highest one sampled in it, and its wall
    and CPU seconds (this process's CPU time: on shared cores the steadier of the two)."""

    calls: int = 0
    start: int = 0
    peak: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0


@dataclass
class PhaseMeter:
    """Charges resident-set samples to the innermost phase running (``phase``), from a sampling thread."""

    interval: float = 0.01
    phases: dict[str, Phase] = field(default_factory=dict)
    stack: list[str] = field(default_factory=lambda: ["start-up"])
    peak_phase: str = "start-up"  # the innermost phase running when the process's peak resident set last rose
    known_peak: int = 0  # that peak
    passes: list[int] = field(default_factory=list)  # positions each update micro-batch forwarded, padding included

    def __post_init__(self) -> None:
        self.phases["start-up"] = Phase(1, resident_bytes(), resident_bytes())
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.stop.wait(self.interval):
            self.record(self.stack[-1], resident_bytes())

    def record(self, name: str, resident: int) -> None:
        """A resident-set reading taken in phase ``name``: its peak, and the process's when it is above the peak
        known (the kernel updates ``ru_maxrss`` lazily, so a reading can run a few pages ahead of it)."""
        phase = self.phases[name]
        phase.peak = max(phase.peak, resident)
        if resident > self.known_peak:
            self.known_peak, self.peak_phase = resident, name

    def charge_peak(self) -> None:
        """Charges a rise of the process's peak since the last look to the innermost phase running."""
        peak = peak_resident_bytes()
        if peak > self.known_peak:
            self.known_peak, self.peak_phase = peak, self.stack[-1]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.charge_peak()
        now = resident_bytes()
        entry = self.phases.setdefault(name, Phase(start=now))
        entry.calls += 1
        self.record(name, now)
        self.stack.append(name)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            entry.seconds += time.perf_counter() - wall
            entry.cpu_seconds += time.process_time() - cpu
            self.record(name, resident_bytes())
            self.charge_peak()
            self.stack.pop()

    def wrap(self, owner: object, method: str, name: str) -> None:
        """``owner.method`` runs as phase ``name`` from now on."""
        inner: Callable = getattr(owner, method)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            with self.phase(name):
                return inner(*args, **kwargs)

        setattr(owner, method, timed)

    def count_passes(self, learner) -> None:
        """Records the positions each of ``learner``'s micro-batches forwards (``forwarded_positions``)."""
        from algorithms.buffer import forwarded_positions
        from models.packing import distinct_rows, token_lengths, token_rows

        parallel_module = learner.parallel_module

        def counted(prompts, actions, *args, **kwargs):
            distinct, _ = distinct_rows(token_rows(prompts))
            self.passes.append(forwarded_positions(list(map(len, distinct)), token_lengths(actions)))
            return parallel_module(prompts, actions, *args, **kwargs)

        learner.parallel_module = counted

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def floor_bytes(policy) -> int:
    """What the trained weights take with their gradients and AdamW's two moments (4 x their bytes), plus the
    frozen ones."""
    trained = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in policy.parameters() if not p.requires_grad)
    return 4 * trained + frozen


def run_flags(args: argparse.Namespace) -> list[str]:
    """train_math's flags: the real-model bench's arith task, ``args.iterations`` of it, evaluated at the start
    and the end, then ``args.extra``."""
    from bench.real_model_learning import parse_args, run_flags as bench_flags

    bench = parse_args(["--modes", args.mode, "--iterations", str(args.iterations), "--eval_interval",
                        str(args.iterations), "--eval_limit", str(args.eval_limit)])
    return [*bench_flags(args.mode, bench), *args.extra]


def measure(args: argparse.Namespace) -> tuple[PhaseMeter, int, float]:
    """Runs the run under a ``PhaseMeter``; returns it, the floor in bytes and the run's seconds."""
    from tensorboardX import SummaryWriter

    from train import builders, host
    from train.flags import FLAGS, config_from_flags

    meter = PhaseMeter()
    with tempfile.TemporaryDirectory() as scratch:
        FLAGS(["memory_phases", *run_flags(args), "--logdir", scratch])
        config = config_from_flags(FLAGS)
        host.set_up(config.model)  # as train_math.py does
        writer = SummaryWriter(scratch)
        runner = builders.build_runner(config, Path(scratch), writer)
        if args.mixed:
            from bench.vs_trl import reward_every_group

            reward_every_group(runner)
        for owner, method, name in ((runner, "evaluate", "evaluation"), (runner.rollouts, "next", "generation"),
                                    (runner.learner, "score", "scoring"), (runner.learner, "train", "update"),
                                    (runner, "sync_generator", "sync"), (runner.checkpointer, "save", "checkpoint"),
                                    (runner.checkpointer, "save_best", "checkpoint")):
            meter.wrap(owner, method, name)
        meter.count_passes(runner.learner)
        started = time.perf_counter()
        with meter.phase("other"):
            runner.run()
        seconds = time.perf_counter() - started
        runner.close()
        writer.close()
    meter.close()
    return meter, floor_bytes(runner.policy), seconds


def report(meter: PhaseMeter, floor: int, seconds: float) -> str:
    lines = ["| phase | calls | resident at its start GB | peak sampled GB | rise GB | wall s | CPU s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, phase in meter.phases.items():
        if name != "other":
            lines.append(f"| {name} | {phase.calls} | {phase.start / GB:.2f} | {phase.peak / GB:.2f} | "
                         f"{(phase.peak - phase.start) / GB:+.2f} | {phase.seconds:.1f} | {phase.cpu_seconds:.1f} |")
    if meter.passes:
        lines.append(f"\nupdate: {len(meter.passes)} micro-batches, the largest forwarding {max(meter.passes)} "
                     "positions (padding included)")
    meter.charge_peak()
    lines.append(f"\npeak resident set {meter.known_peak / GB:.2f} GB, reached in: {meter.peak_phase}; "
                 f"weights + gradients + AdamW floor {floor / GB:.2f} GB; {seconds:.0f} s")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("full", "lora"), default="full")
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--eval_limit", type=int, default=250, help="Held-out problems per evaluation.")
    parser.add_argument("--mixed", action="store_true", help="Every group trains (module docstring).")
    parser.add_argument("extra", nargs="*", help="train_math.py flags after --, which override the bench's")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(report(*measure(args)), flush=True)


if __name__ == "__main__":
    main()
