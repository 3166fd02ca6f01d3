"""The loss-side options against values worked out by hand from their papers' equations: clip-higher and
dual-clip, the four loss aggregations (Dr. GRPO's among them), GSPO's sequence-level ratio, the KL estimators
in the loss and in the reward, REINFORCE++ and its baseline variant; the default loss unchanged bit for bit;
the flags that combine into nothing refused before torch loads."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from absl import flags

from algorithms.base import make_algorithm
from algorithms.buffer import Batch, RolloutBuffer, StepRecord
from algorithms.losses import aggregate, clipped_surrogate, importance_log_ratio, kl_estimate
from algorithms.config import AlgorithmConfig
from algorithms.reinforce_pp import reinforce_pp_returns
from envs.modes import LossAgg
from event_files import read_scalars
from test_train_math import parse
from test_trainer import run_train_math


def fixed_batch(per_token_advantages: bool) -> tuple[Batch, SimpleNamespace]:
    """Four actions of 5, 3, 4 and 1 tokens (float32, seeded), half of a minibatch, with policy scores."""
    generator = torch.Generator().manual_seed(0)
    size, width = 4, 5
    lengths = torch.tensor([5, 3, 4, 1])

    def draw(sampler, *shape):
        return sampler(*shape, generator=generator, dtype=torch.float32)

    old = -draw(torch.rand, size, width) * 2
    new = (old + 0.4 * draw(torch.randn, size, width)).requires_grad_()
    ref = old + 0.3 * draw(torch.randn, size, width)
    advantages = (draw(torch.randn, size, width) if per_token_advantages
                  else torch.tensor([1.0, -0.5, 0.25, -1.5], dtype=torch.float32))
    values = draw(torch.randn, size, width)
    batch = Batch(index=torch.arange(size), agents=torch.zeros(size, dtype=torch.long), prompt_ids=[[1]] * size,
                  critic_prompt_ids=None, action_ids=torch.zeros(size, width, dtype=torch.long), action_lengths=lengths,
                  token_mask=torch.arange(width)[None] < lengths[:, None], old_log_probs=old, old_values=values,
                  ref_log_probs=ref, advantages=advantages, returns=draw(torch.randn, size, width),
                  num_samples=size, num_tokens=int(lengths.sum()), minibatch_samples=2 * size,
                  minibatch_tokens=2 * int(lengths.sum()))
    scores = SimpleNamespace(log_probs=new, entropy=draw(torch.rand, size, width),
                             values=(values + 0.1).requires_grad_())
    return batch, scores


@pytest.mark.parametrize("name, per_token, settings, loss, gradient_sum", [
    ("GRPO", False, {}, -0.10796257108449936, 0.0035758912563323975),
    ("GRPO", False, {"kl_coef": 0.05, "entropy_coef": 0.01}, -0.10798383504152298, 0.006702527403831482),
    ("GRPO", False, {"loss_agg_mode": "seq_mean"}, 0.09864512085914612, 0.17010347545146942),
    ("RLOO", True, {}, 0.14448922872543335, 0.15917007625102997),
    ("TPPO", True, {}, 0.34088370203971863, 0.15917007625102997),
])
def test_default_settings_give_the_loss_of_before_bit_for_bit(name, per_token, settings, loss, gradient_sum):
    """The figures are what the loss gave on this batch before clip-higher, dual-clip, GSPO, the KL estimators
    and the new aggregations existed (float32, exact equality)."""
    batch, scores = fixed_batch(per_token)
    value, stats = make_algorithm(name, AlgorithmConfig(**settings)).loss(scores, batch)
    value.backward()
    assert value.item() == loss
    assert scores.log_probs.grad.sum().item() == gradient_sum
    assert stats["clip_fraction"] == stats["clip_fraction_low"] + stats["clip_fraction_high"]
    assert "dual_clip_fraction" not in stats


def test_clip_higher_by_hand():
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with eps_low 0.2, eps_high 0.28 (DAPO's values)."""
    ratio = torch.tensor([1.3, 1.3, 0.7, 0.7, 1.1], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    out = clipped_surrogate(ratio.log(), advantages, 0.2, 0.28)
    # 1.3 * 1 is held at 1.28; 1.3 * -1: min(-1.3, -1.28) = -1.3, unclipped; 0.7 * 1: min(0.7, 0.8) = 0.7;
    # 0.7 * -1: min(-0.7, -0.8) = -0.8, held by the lower bound; 1.1 * 2 within both bounds
    torch.testing.assert_close(out.loss, torch.tensor([-1.28, 1.3, -0.7, 0.8, -2.2], dtype=torch.float64))
    assert out.clipped_high.tolist() == [1, 0, 0, 0, 0] and out.clipped_low.tolist() == [0, 0, 0, 1, 0]
    symmetric = clipped_surrogate(ratio.log(), advantages, 0.2)
    torch.testing.assert_close(symmetric.loss, torch.tensor([-1.2, 1.3, -0.7, 0.8, -2.2], dtype=torch.float64))


def test_dual_clip_bounds_the_loss_of_negative_advantages_by_hand():
    """Dual-clip (Ye et al. 2020), c = 3: where A < 0 the loss is min(max(-r A, -clip(r) A), -c A)."""
    log_ratio = torch.tensor([5.0, 2.0, 5.0], dtype=torch.float64).log().requires_grad_()
    advantages = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64)
    out = clipped_surrogate(log_ratio, advantages, 0.2, clip_ratio_c=3.0)
    # r = 5, A = -1: 5 > 3, held at 3; r = 2: 2 stays; r = 5, A = 1: the upper clip, -1.2
    torch.testing.assert_close(out.loss, torch.tensor([3.0, 2.0, -1.2], dtype=torch.float64))
    assert out.dual_clipped.tolist() == [1, 0, 0] and out.clipped_high.tolist() == [0, 0, 1]
    out.loss.sum().backward()
    # a held loss has no gradient; r = 2 gives d(-r A)/d log r = -A r = 2
    torch.testing.assert_close(log_ratio.grad, torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4), ("seq-mean-token-mean", (2 + 4) / 2), ("seq-mean-token-sum", (6 + 4) / 2),
    ("seq-mean-token-sum-norm", (6 + 4) / 2 / 8), ("token_mean", 2.5), ("seq_mean", 3.0),  # the earlier spellings
])
def test_loss_aggregations_by_hand(mode, expected):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], dtype=torch.float64)  # 9: padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert aggregate(loss, mask, mode, scale_factor=8).item() == pytest.approx(expected)


def test_dr_grpo_aggregation_needs_its_fixed_length():
    with pytest.raises(ValueError, match="scale_factor >= 1"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm")


def test_gspo_sequence_ratio_by_hand():
    """GSPO (Zheng et al. 2025): s_i = exp(mean_t log-ratio), clipped per sequence. Action 1: log-ratios 0.1 and
    0.3, s = e^0.2 = 1.2214 > 1.2 with A = 1: both tokens held at 1.2 (token-level, only the second would be).
    Action 2: one token, s = e^-0.4 = 0.6703 with A = 1: unclipped."""
    old = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]], dtype=torch.float64)
    new = (old + torch.tensor([[0.1, 0.3], [-0.4, 7.0]], dtype=torch.float64)).requires_grad_()  # 7.0: padding
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    advantages = torch.ones(2, 1, dtype=torch.float64)
    log_ratio = importance_log_ratio(new, old, mask, "sequence")
    torch.testing.assert_close(log_ratio * mask, torch.tensor([[0.2, 0.2], [-0.4, 0.0]], dtype=torch.float64))
    out = clipped_surrogate(log_ratio, advantages, 0.2)
    s2 = math.exp(-0.4)
    torch.testing.assert_close(out.loss * mask, torch.tensor([[-1.2, -1.2], [-s2, 0.0]], dtype=torch.float64))
    assert (out.clipped_high * mask).tolist() == [[1.0, 1.0], [0.0, 0.0]]
    token_level = clipped_surrogate(importance_log_ratio(new, old, mask, "token"), advantages, 0.2)
    assert token_level.clipped_high[0].tolist() == [0.0, 1.0]
    aggregate(out.loss, mask, "token-mean").backward()
    # the held action has no gradient; action 2's token: d(-s A)/d log pi = -s (GSPO-token), over 3 tokens
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0], [-s2 / 3, 0.0]], dtype=torch.float64))


def test_gspo_token_gradient_is_gspos_with_one_advantage_per_action():
    """With a sequence-level advantage and seq-mean-token-mean, the GSPO-token form's gradient equals that of
    GSPO's objective written directly, -mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log-ratio)."""
    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 4, generator=generator, dtype=torch.float64)
    shift = 0.2 * torch.randn(3, 4, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
    advantages = torch.tensor([[0.7], [-1.1], [0.4]], dtype=torch.float64)
    new = (old + shift).requires_grad_()
    log_ratio = importance_log_ratio(new, old, mask, "sequence")
    aggregate(clipped_surrogate(log_ratio, advantages, 0.2).loss, mask, "seq-mean-token-mean").backward()
    direct = (old + shift).requires_grad_()
    s = torch.exp(((direct - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    (-torch.minimum(s * advantages, s.clamp(0.8, 1.2) * advantages)).mean().backward()
    torch.testing.assert_close(new.grad * mask, direct.grad * mask)


def test_kl_estimators_by_hand():
    """pi(y) = 0.5, ref(y) = 0.25, d = log ref - log pi = -log 2: k1 = log 2, k2 = (log 2)^2 / 2,
    k3 = e^d - 1 - d = 0.5 - 1 + log 2; low_var_kl = k3 here, and 10 where pi(y) = e^-30, ref(y) = 1
    (d clamped to 20, e^20 - 21 clamped to 10) while k3 is e^30 - 31."""
    log_pi = torch.tensor([math.log(0.5), -30.0], dtype=torch.float64)
    log_ref = torch.tensor([math.log(0.25), 0.0], dtype=torch.float64)
    log2 = math.log(2.0)
    assert kl_estimate(log_pi, log_ref, "k1")[0].item() == pytest.approx(log2)
    assert kl_estimate(log_pi, log_ref, "k2")[0].item() == pytest.approx(log2**2 / 2)
    assert kl_estimate(log_pi, log_ref, "k3").tolist() == pytest.approx([log2 - 0.5, math.exp(30) - 31])
    assert kl_estimate(log_pi, log_ref, "low_var_kl").tolist() == pytest.approx([log2 - 0.5, 10.0])


def test_kl_loss_type_sets_the_loss_term():
    batch, scores = fixed_batch(False)
    loss = {kind: make_algorithm("GRPO", AlgorithmConfig(kl_coef=0.5, kl_loss_type=kind)).loss(scores, batch)
            for kind in ("k1", "k2", "k3")}
    plain, _ = make_algorithm("GRPO", AlgorithmConfig()).loss(scores, batch)
    for kind, (value, stats) in loss.items():
        estimate = kl_estimate(scores.log_probs, batch.ref_log_probs, kind)
        mask = batch.token_mask.float()
        expected_kl = (estimate * mask).sum() / mask.sum()
        torch.testing.assert_close(stats["kl_ref"], expected_kl.detach())
        torch.testing.assert_close(value, plain + 0.5 * expected_kl * batch.weight(LossAgg.TOKEN_MEAN))


def one_step_buffer(rewards: list[float], lengths: list[int], log_probs: list[list[float]], ref: list[list[float]],
                    group_ids: list[int]) -> RolloutBuffer:
    """One step of len(rewards) single-agent episodes, each ending at once with its reward."""
    count, width = len(rewards), max(lengths)
    buffer = RolloutBuffer(1, count, 1, width)
    buffer.add(StepRecord(step=0, envs=list(range(count)), agents=[0] * count, prompt_ids=[[1]] * count,
                          action_ids=[[5] * n for n in lengths],
                          rollout_log_probs=[row[:n] for row, n in zip(log_probs, lengths)],
                          group_ids=torch.tensor(group_ids), texts=["x"] * count))
    done = np.ones(count, dtype=bool)
    buffer.add_step_results(0, np.array(rewards, dtype=np.float32)[:, None], done, ~done,
                            np.array(rewards, dtype=np.float32))
    buffer.ref_log_probs = torch.tensor(ref, dtype=torch.float32)[None, :, None, :]
    return buffer


def test_grpo_with_the_kl_in_the_reward_by_hand():
    """k1 per token, summed over the episode and times beta = 0.1, comes off its reward before the group's
    centring (--scale_rewards none): KL sums 0.5 + 0 and 0 + 0, 1.0 and 0.2."""
    buffer = one_step_buffer([1.0, 0.0, 1.0, 0.0], [2, 2, 1, 1], log_probs=[[-1.0, -1.0]] * 4,
                             ref=[[-1.5, -1.0], [-1.0, -1.0], [-2.0, 0.0], [-1.2, 0.0]], group_ids=[0, 0, 1, 1])
    config = AlgorithmConfig(kl_coef=0.1, use_kl_in_reward=True, kl_penalty="k1", scale_rewards="none")
    targets = make_algorithm("GRPO", config).advantages(buffer)
    returns = [1.0 - 0.05, 0.0, 1.0 - 0.1, 0.0 - 0.02]
    expected = [returns[0] - (returns[0] + returns[1]) / 2, returns[1] - (returns[0] + returns[1]) / 2,
                returns[2] - (returns[2] + returns[3]) / 2, returns[3] - (returns[2] + returns[3]) / 2]
    torch.testing.assert_close(targets.advantages.flatten(), torch.tensor(expected))
    torch.testing.assert_close(targets.stats["kl_reward"], torch.tensor([0.5, 0.0, 0.0, 0.0, 1.0, 0.2]))
    assert make_algorithm("GRPO", config).needs_reference and not config.kl_in_loss


def test_reinforce_pp_returns_by_hand():
    """Episode 1: 3 tokens, reward 1 at its last, KL penalties 0.1, 0.2, 0; episode 2: 2 tokens, reward 0,
    penalties 0.05, 0.05. gamma 1: G = [1 - 0.3, 1 - 0.2, 1] and [-0.1, -0.05]; with both in one group the
    mean reward 0.5 comes off at each last token: [0.2, 0.3, 0.5] and [-0.6, -0.55]. gamma 0.5, no penalty:
    [0.25, 0.5, 1]."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    penalty = torch.tensor([[0.1, 0.2, 0.0], [0.05, 0.05, 0.3]], dtype=torch.float64)  # 0.3: padding
    torch.testing.assert_close(reinforce_pp_returns(rewards, mask, 1.0, kl_penalty=penalty),
                               torch.tensor([[0.7, 0.8, 1.0], [-0.1, -0.05, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(reinforce_pp_returns(rewards, mask, 1.0, torch.tensor([4, 4]), penalty),
                               torch.tensor([[0.2, 0.3, 0.5], [-0.6, -0.55, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(reinforce_pp_returns(rewards, mask, 0.5),
                               torch.tensor([[0.25, 0.5, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("name", ["REINFORCE_PP", "REINFORCE_PP_BASELINE"])
def test_reinforce_pp_normalises_returns_over_the_batch(name):
    """Four episodes, two groups; k1 KL in the reward with beta 0.1. The advantages are the returns-to-go of
    ``reinforce_pp_returns`` standardised over every real token of the batch (unbiased std)."""
    lengths, rewards, group_ids = [2, 1, 3, 1], [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1]
    log_probs = [[-1.0, -1.0, -1.0]] * 4
    ref = [[-1.5, -1.0, 0.0], [-1.2, 0.0, 0.0], [-1.0, -1.1, -1.3], [-0.5, 0.0, 0.0]]
    buffer = one_step_buffer(rewards, lengths, log_probs, ref, group_ids)
    config = AlgorithmConfig(kl_coef=0.1, use_kl_in_reward=True)
    targets = make_algorithm(name, config).advantages(buffer)
    kl = [[0.5, 0.0], [0.2], [0.0, 0.1, 0.3], [-0.5]]  # k1 = log pi - log ref
    means = {0: 0.5, 1: 0.5} if name == "REINFORCE_PP_BASELINE" else {0: 0.0, 1: 0.0}
    returns = []
    for episode, tokens in enumerate(kl):
        final = rewards[episode] - means[group_ids[episode]]
        returns += [final - 0.1 * sum(tokens[t:]) for t in range(len(tokens))]
    returns = np.array(returns)
    expected = (returns - returns.mean()) / (returns.std(ddof=1) + 1e-8)
    mask = buffer.token_mask()
    torch.testing.assert_close(targets.advantages[mask], torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize("argv, message", [
    (["--clip_ratio_c", "1.0"], "--clip_ratio_c=1.0 must be > 1"),
    (["--clip_ratio_low", "1.0"], "--clip_ratio_low=1.0 must be in"),
    (["--algorithm_name", "APPO", "--importance_sampling_level", "sequence"], "applies to GRPO/RLOO"),
    (["--algorithm_name", "REINFORCE_PP", "--critic", "on"], "critic-free"),
    (["--algorithm_name", "REINFORCE_PP_BASELINE", "--value_coef", "0.25"], "applies to APPO/TPPO"),
    (["--algorithm_name", "REINFORCE_PP_BASELINE", "--group_size", "1"], "group_size=1 must be >= 2"),
    (["--kl_penalty", "k3", "--kl_coef", "0.1"], "--kl_penalty is the estimator of the KL in the reward"),
    (["--use_kl_in_reward", "--kl_coef", "0.1", "--kl_loss_type", "k2"], "--kl_loss_type is the estimator of the KL"),
    (["--kl_loss_type", "k2"], "--kl_coef is 0"),
    (["--loss_scale_factor", "100"], "--loss_scale_factor divides seq-mean-token-sum-norm"),
    (["--algorithm_name", "APPO", "--loss_agg_mode", "seq-mean-token-sum"], "applies to"),
])
def test_combinations_that_mean_nothing_are_refused(argv, message):
    with pytest.raises((flags.Error, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(*argv)


def test_the_kl_in_the_reward_left_to_the_algorithm_is_its_default():
    """``use_kl_in_reward`` left None (the option's default) is REINFORCE++'s token penalty and GRPO's loss term."""
    assert make_algorithm("REINFORCE_PP", AlgorithmConfig(kl_coef=0.1)).config.use_kl_in_reward is True
    grpo = make_algorithm("GRPO", AlgorithmConfig(kl_coef=0.1)).config
    assert grpo.use_kl_in_reward is False and grpo.kl_in_loss
    assert make_algorithm("REINFORCE_PP", AlgorithmConfig(use_kl_in_reward=False)).config.use_kl_in_reward is False


def test_the_recipes_resolve():
    """Dr. GRPO, DAPO's loss, GSPO and REINFORCE++ as flags reach the algorithm's settings; the fixed length defaults
    to --max_new_tokens, the KL in the reward to on for REINFORCE++ only."""
    from train.builders import algorithm_config

    def losses(*argv: str) -> AlgorithmConfig:
        return algorithm_config(parse(*argv))

    dr_grpo = losses("--scale_rewards", "none", "--loss_agg_mode", "seq-mean-token-sum-norm", "--max_new_tokens", "48")
    assert (dr_grpo.scale_rewards, dr_grpo.loss_agg_mode, dr_grpo.loss_scale_factor) == (
        "none", "seq-mean-token-sum-norm", 48)
    assert losses("--loss_agg_mode", "seq_mean").loss_agg_mode == "seq-mean-token-mean"  # the earlier spelling
    dapo = losses("--clip_ratio_low", "0.2", "--clip_ratio_high", "0.28", "--loss_agg_mode", "token-mean")
    assert (dapo.clip_low, dapo.clip_high, dapo.clip_ratio_c, dapo.loss_scale_factor) == (0.2, 0.28, None, None)
    gspo = losses("--algorithm_name", "RLOO", "--importance_sampling_level", "sequence", "--clip_param", "0.0004")
    assert gspo.importance_sampling_level == "sequence" and gspo.clip_low == gspo.clip_high == 0.0004
    assert losses("--algorithm_name", "REINFORCE_PP", "--group_size", "1", "--kl_coef", "0.01").use_kl_in_reward
    assert not losses("--kl_coef", "0.01").use_kl_in_reward


def test_what_each_option_changes_reaches_tensorboard(untrained_policy_dir, tmp_path):
    """REINFORCE++-baseline with its KL in the reward, clip-higher, dual-clip and GSPO's ratio: one iteration logs
    the clip fractions apart, the dual clip's and the reward's KL estimate."""
    run_dir = run_train_math(["--algorithm_name", "REINFORCE_PP_BASELINE", "--kl_coef", "0.05",
                              "--clip_ratio_high", "0.28", "--clip_ratio_c", "3", "--importance_sampling_level",
                              "sequence", "--model_name_or_path", str(untrained_policy_dir), "--num_env_steps", "8",
                              "--n_rollout_threads", "8", "--group_size", "4", "--max_new_tokens", "6",
                              "--eval_interval", "0", "--save_interval", "0", "--nosave_best",
                              "--logdir", str(tmp_path)])
    scalars = read_scalars(run_dir)
    for key in ("loss/clip_fraction_low", "loss/clip_fraction_high", "loss/dual_clip_fraction",
                "train/kl_reward_mean"):
        assert len(scalars[key]) == 1, key
    assert "loss/kl_ref" not in scalars  # the KL is in the reward, not in the loss
