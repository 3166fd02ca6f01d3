"""Cut-off answers: DAPO's soft overlong penalty against the paper's numbers, completions cut at the token limit
masked from the loss (TRL's mask_truncated_completions), their flags, and runs of train_math with each."""

from __future__ import annotations

import pytest
import torch
from absl import flags

from algorithms.base import make_algorithm
from algorithms.config import AlgorithmConfig
from envs.rewards import OverlongPenalty
from event_files import read_scalars
from test_dynamic_sampling import episodic_buffer
from test_train_math import parse
from test_trainer import run_train_math
from train.config import RolloutConfig
from train.correction import corrected_targets


def test_overlong_penalty_is_linear_over_the_buffer_as_in_dapo():
    # DAPO's setting: 20480 tokens at most, the last 4096 the buffer (eq. 13)
    dapo = OverlongPenalty(max_length=20480, buffer_length=4096)
    assert dapo([100, 16384, 17408, 18432, 20480]).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    halved = OverlongPenalty(max_length=64, buffer_length=16, penalty_factor=0.5)
    assert halved([48, 52, 64]).tolist() == [0.0, -0.125, -0.5]


def test_overlong_buffer_must_lie_within_the_limit():
    with pytest.raises(ValueError, match="buffer_length=0"):
        OverlongPenalty(max_length=64, buffer_length=0)
    with pytest.raises(ValueError, match="buffer_length=65"):
        OverlongPenalty(max_length=64, buffer_length=65)


def test_masked_truncated_completions_leave_the_loss_but_not_the_baseline():
    # groups (1, 0) and (1, 1); envs 1 and 3 were cut at the limit
    buffer = episodic_buffer([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    targets = make_algorithm("GRPO", AlgorithmConfig()).advantages(buffer)
    masked, stats = corrected_targets(buffer, targets, RolloutConfig(mask_truncated_completions=True))
    assert masked.keep[0, :, 0].tolist() == [True, False, True, False] and stats == {}
    assert masked.advantages is targets.advantages  # env 0 keeps the advantage its cut partner gave it
    assert targets.advantages[0, 0, 0] > 0
    trained = [batch.index.tolist() for minibatch in buffer.minibatches(masked, 1, 1) for batch in minibatch]
    assert sorted(trained[0]) == [0, 2]


@pytest.mark.parametrize("argv, message", [
    (["--overlong_buffer", "--overlong_buffer_len", "65"], "longer than --max_new_tokens=64"),
    (["--overlong_buffer_len", "8"], "add --overlong_buffer"),
    (["--overlong_penalty_factor", "0.5"], "add --overlong_buffer"),
    (["--overlong_buffer", "--action_level", "token"], "every action is one token"),
    (["--mask_truncated_completions", "--action_level", "token"], "every action is one token"),
])
def test_meaningless_cut_off_flags_are_refused(argv, message):
    with pytest.raises((flags.Error, ValueError), match=message):
        parse(*argv)


def run_cut_off(untrained_policy_dir, tmp_path, *options: str) -> dict:
    run_dir = run_train_math(["--model_name_or_path", str(untrained_policy_dir), "--num_env_steps", "16",
                              "--n_rollout_threads", "8", "--group_size", "4", "--max_new_tokens", "6",
                              "--eval_interval", "0", "--logdir", str(tmp_path), "--save_interval", "0", *options])
    return read_scalars(run_dir)


def test_a_run_pays_the_overlong_penalty_by_action_length(untrained_policy_dir, tmp_path):
    """A buffer as long as the limit: an action of L tokens is paid -L / 6, so the mean penalty is -(mean
    action length) / 6."""
    scalars = run_cut_off(untrained_policy_dir, tmp_path, "--overlong_buffer", "--overlong_buffer_len", "6")
    for (_, penalty), (_, tokens) in zip(scalars["train/reward/overlong"], scalars["train/action_tokens"]):
        assert penalty == pytest.approx(-tokens / 6)
    assert len(scalars["train/reward/overlong"]) == 2


def test_a_run_masks_the_truncated_completions(untrained_policy_dir, tmp_path):
    scalars = run_cut_off(untrained_policy_dir, tmp_path, "--mask_truncated_completions")
    trained = dict(scalars.get("train/trained_samples", []))
    for step, share in scalars["rollout/truncated_share"]:
        assert trained.get(step, 0.0) == pytest.approx(8 * (1 - share))
