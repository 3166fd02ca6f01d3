"""Rollout correction: ratios, truncated weights (TIS) and the mask band against hand-worked numbers, the weight
in the policy-gradient term, the gap logged every iteration, the flags, and the default batch left as collected
when every rollout option is off."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from absl import flags

from algorithms.base import make_algorithm
from algorithms.config import AlgorithmConfig
from algorithms.rollout_correction import gap_sums, log_ratio, truncated_weights, within_band
from event_files import read_scalars
from test_dynamic_sampling import episodic_buffer
from test_train_math import parse
from test_trainer import run_train_math
from train.config import RolloutConfig
from train.correction import GapMeter, corrected_targets

TRAINER = torch.tensor([[-1.0, -2.0, 0.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])  # the third position is padding


def test_log_ratio_per_token_sequence_and_geometric_mean():
    torch.testing.assert_close(log_ratio(TRAINER, SAMPLER, MASK, "token"), torch.tensor([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(log_ratio(TRAINER, SAMPLER, MASK, "sequence"), torch.tensor([[-0.5]]))
    torch.testing.assert_close(log_ratio(TRAINER, SAMPLER, MASK, "geometric"), torch.tensor([[-0.25]]))
    with pytest.raises(ValueError, match="rollout_is_level='tokens'"):
        log_ratio(TRAINER, SAMPLER, MASK, "tokens")


def test_truncated_weights_cap_the_ratio():
    weights = truncated_weights(torch.tensor([0.5, -1.0, math.log(3.0), 1000.0]), cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([math.exp(0.5), math.exp(-1.0), 2.0, 2.0]))


def test_the_band_keeps_ratios_within_its_ends():
    log_rho = torch.log(torch.tensor([[0.4], [1.0], [2.0], [2.5]]))
    assert within_band(log_rho, 0.5, 2.0).tolist() == [False, True, True, False]


def test_gap_sums_over_real_tokens():
    sums = gap_sums(TRAINER, SAMPLER, MASK)
    assert float(sums["abs_diff"]) == pytest.approx(1.5) and float(sums["tokens"]) == 2
    # k3 of rho = pi_t / pi_s: rho - 1 - log rho, for rho = e^0.5 and e^-1
    expected_kl = (math.exp(0.5) - 1 - 0.5) + (math.exp(-1.0) - 1 + 1.0)
    assert float(sums["kl"]) == pytest.approx(expected_kl, rel=1e-6)
    assert float(sums["max_ratio"]) == pytest.approx(math.exp(0.5))
    meter = GapMeter()
    meter.add(TRAINER, SAMPLER, MASK)
    meter.add(SAMPLER, SAMPLER, MASK)  # no gap: two more tokens
    stats = meter.stats()
    assert stats["rollout/logprob_abs_diff"] == pytest.approx(1.5 / 4)
    assert stats["rollout/logprob_kl"] == pytest.approx(expected_kl / 4, rel=1e-6)
    assert stats["rollout/max_ratio"] == pytest.approx(math.exp(0.5))


def corrected_buffer(trainer_shift: list[float], config: RolloutConfig):
    """Groups (1, 0) and (1, 1), actions of two tokens at log-probs (-0.5, -0.25); the trainer's log-probs are
    the sampler's plus ``trainer_shift[n]`` on each token of env n."""
    buffer = episodic_buffer([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    shift = torch.tensor(trainer_shift)[None, :, None, None] * buffer.token_mask()
    buffer.old_log_probs = buffer.rollout_log_probs + shift
    targets = make_algorithm("GRPO", AlgorithmConfig()).advantages(buffer)
    return buffer, targets, *corrected_targets(buffer, targets, config)


def test_tis_weights_each_token_by_its_capped_ratio():
    config = RolloutConfig(rollout_is=True, rollout_is_threshold=2.0)
    buffer, _, targets, stats = corrected_buffer([0.0, math.log(1.5), math.log(4.0), -1.0], config)
    expected = torch.tensor([1.0, 1.5, 2.0, math.exp(-1.0)])[:, None].expand(4, 2)
    torch.testing.assert_close(buffer.rollout_weights[0, :, 0], expected)
    assert targets.keep is None
    assert stats["rollout/is_weight_mean"] == pytest.approx(float(expected.mean()))
    assert stats["rollout/is_capped_share"] == pytest.approx(2 / 8)
    # the batch's ratio is taken against the trainer's log-probs; the weight multiplies the policy gradient
    batch = buffer.batch(torch.arange(4), 4, 8, targets)
    torch.testing.assert_close(batch.old_log_probs, buffer.old_log_probs[0, :, 0])
    scores = SimpleNamespace(log_probs=batch.old_log_probs.clone(), entropy=None, values=None)  # ratio 1
    loss, stats = make_algorithm("GRPO", AlgorithmConfig()).loss(scores, batch)
    z = 0.5 / (math.sqrt(0.5) + 1e-4)  # group 0's advantages (z, -z); group 1's are 0
    assert float(loss) == pytest.approx(-(1.0 * z - 1.5 * z) * 2 / 8, rel=1e-5)  # token mean of -w * A


def test_sequence_mask_drops_the_actions_outside_the_band():
    config = RolloutConfig(rollout_is=True, rollout_is_mode="mask", rollout_is_level="sequence",
                           rollout_is_threshold=2.0)
    # sequence ratios: e^0 = 1, (1.2)^2 = 1.44, 1.5^2 = 2.25 (out), e^(-2 * 0.2) = 0.67
    buffer, _, targets, stats = corrected_buffer([0.0, math.log(1.2), math.log(1.5), -0.2], config)
    assert targets.keep[0, :, 0].tolist() == [True, True, False, True]
    assert buffer.rollout_weights is None and stats == {"rollout/is_masked_share": 0.25}
    geometric = RolloutConfig(rollout_is=True, rollout_is_mode="mask", rollout_is_level="geometric",
                              rollout_is_threshold=1.4, rollout_is_threshold_lower=0.9)
    _, _, targets, _ = corrected_buffer([0.0, math.log(1.2), math.log(1.5), -0.2], geometric)
    assert targets.keep[0, :, 0].tolist() == [True, True, False, False]  # e^-0.2 = 0.82 < 0.9


def test_every_option_off_leaves_the_batch_as_collected():
    buffer = episodic_buffer([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    targets = make_algorithm("GRPO", AlgorithmConfig()).advantages(buffer)
    same, stats = corrected_targets(buffer, targets, RolloutConfig())
    assert same is targets and stats == {}
    assert buffer.old_log_probs is None and buffer.rollout_weights is None
    batch = buffer.batch(torch.arange(4), 4, 8, targets)
    assert batch.rollout_weights is None
    torch.testing.assert_close(batch.old_log_probs, buffer.rollout_log_probs[0, :, 0])


@pytest.mark.parametrize("argv, message", [
    (["--rollout_is", "--rollout_is_threshold", "0.5"], "< 1 would cut"),
    (["--rollout_is_threshold", "3"], "add --rollout_is"),
    (["--rollout_is_level", "sequence"], "add --rollout_is"),
    (["--rollout_is", "--rollout_is_threshold_lower", "0.5"], "band.s lower end of --rollout_is_mode mask"),
    (["--rollout_is", "--rollout_is_mode", "mask"], "use --rollout_is_level sequence or geometric"),
    (["--rollout_is", "--algorithm_name", "APPO"], "use --rollout_is_mode mask"),
    (["--rollout_is", "--rollout_is_mode", "mask", "--rollout_is_level", "sequence",
      "--rollout_is_threshold_lower", "1.5"], r"must be in \(0, 1\]"),
])
def test_meaningless_rollout_correction_flags_are_refused(argv, message):
    with pytest.raises((flags.Error, ValueError), match=message):
        parse(*argv)


def test_the_band_defaults_to_the_reciprocal_of_the_threshold():
    config = parse("--rollout_is", "--rollout_is_mode", "mask", "--rollout_is_level", "geometric",
                   "--rollout_is_threshold", "4")
    assert config.rollout.rollout_is_band == (0.25, 4.0)


@pytest.mark.parametrize("async_flag", ["--async_rollouts", "--noasync_rollouts"])
@pytest.mark.parametrize("correction", [[], ["--rollout_is"]], ids=["gap-only", "tis"])
def test_a_run_logs_the_sampler_trainer_gap(untrained_policy_dir, tmp_path, async_flag, correction):
    """The untrained policy's rewards are all 0: an entropy bonus makes the update forward every row anyway,
    where the gap is measured without --rollout_is."""
    run_dir = run_train_math(["--model_name_or_path", str(untrained_policy_dir), "--num_env_steps", "16",
                              "--n_rollout_threads", "8", "--group_size", "4", "--max_new_tokens", "6",
                              "--eval_interval", "0", "--logdir", str(tmp_path), "--save_interval", "0",
                              "--temperature", "1.0", "--entropy_coef", "0.01", async_flag, *correction])
    scalars = read_scalars(run_dir)
    gaps = [value for _, value in scalars["rollout/logprob_abs_diff"]]
    assert len(gaps) == 2 and gaps[0] < 1e-3  # the first batch: the sampler holds the trainer's weights
    if async_flag == "--async_rollouts":  # the second batch was sampled one update behind
        assert gaps[1] > gaps[0] and scalars["rollout/max_ratio"][1][1] > 1.0
    assert ("rollout/is_weight_mean" in scalars) == bool(correction)
