"""bench/real_model_learning.py's arithmetic: the gain's split and its summary line (the runs themselves are
the bench's, and the real_model tests')."""

from __future__ import annotations

import pytest

from bench.real_model_learning import gain_split, parse_args, run_flags, summary


def evaluation(accuracy: float, readable: float, seconds: float = 0.0) -> dict[str, float]:
    return {"eval/accuracy": accuracy, "eval/readable": readable, "eval/accuracy_readable": accuracy / readable,
            "seconds": seconds}


def test_a_gain_splits_into_format_and_arithmetic_that_add_up():
    before, after = evaluation(0.1, 0.5), evaluation(0.3, 0.75)  # right among readable: 0.2 -> 0.4
    format_part, arithmetic = gain_split(before, after)
    assert format_part == pytest.approx(0.25 * 0.2) and arithmetic == pytest.approx(0.75 * 0.2)
    assert format_part + arithmetic == pytest.approx(0.3 - 0.1)


def test_the_summary_line_states_points_standard_errors_and_minutes():
    line = summary("lora", [evaluation(0.1, 0.5), evaluation(0.3, 0.75, seconds=3000)], n=500)
    # standard errors sqrt(.1 * .9 / 500) and sqrt(.3 * .7 / 500); the gain 0.2 over their hypotenuse is 8.16
    assert line.endswith("held-out accuracy 0.100 -> 0.300 (+20.0 points, 8.2 standard errors) in 50 minutes")
    assert "format +5.0, arithmetic +15.0 points" in line


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_the_arith_preset_is_a_train_math_command_that_resolves(mode, untrained_policy_dir, tmp_path):
    """Parsed and resolved by train_math's own flags (a misspelt flag or a bad --env_kwargs fails here)."""
    from test_train_math import parse

    flags = run_flags(mode, parse_args(["--model", str(untrained_policy_dir), "--iterations", "3"]))
    config = parse(*flags, "--logdir", str(tmp_path))
    assert config.budget.num_iterations == 3 and config.env.num_envs == 64 and config.env.group_size == 8
    assert config.env.user_kwargs["arith"]["digits"] == 1 and config.generation.temperature == 0.7
    assert config.model.lora_rank == (16 if mode == "lora" else 0) and config.env.prompt_template == "chat"


def test_the_math_preset_names_the_gpu_recipe():
    flags = run_flags("full", parse_args(["--task", "math"]))
    assert flags[1] == "Qwen/Qwen2.5-0.5B-Instruct" and "--lora_rank" not in flags
    assert flags[flags.index("--num_env_steps") + 1] == str(200 * 512)
