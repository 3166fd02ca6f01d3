"""bench.memory_phases builds the real-model bench's run as train_math.py does and charges its resident memory to
phases: run here on the tiny policy, one iteration."""

from bench import memory_phases
from train.flags import FLAGS


def test_a_tiny_run_is_charged_to_its_phases_and_the_peak_is_named(untrained_policy_dir):
    args = memory_phases.parse_args(["--mixed", "--eval_limit", "8", "--", "--model_name_or_path",
                                     str(untrained_policy_dir), "--max_new_tokens", "8",
                                     "--prompt_template", "default"])
    FLAGS.unparse_flags()
    try:
        meter, floor, seconds = memory_phases.measure(args)
    finally:
        FLAGS.unparse_flags()
    assert meter.phases["evaluation"].calls == 2  # at the start and at the end
    assert meter.phases["generation"].calls == 1 and meter.phases["update"].calls == 1
    assert meter.passes, "the update's micro-batches were not counted"
    assert meter.known_peak >= max(phase.peak for phase in meter.phases.values()) > 0
    assert floor > 0 and seconds > 0
    report = memory_phases.report(meter, floor, seconds)
    assert f"reached in: {meter.peak_phase}" in report and "| update | 1 |" in report
