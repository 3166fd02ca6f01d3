import math
from types import SimpleNamespace

import pytest
import torch

from algorithms.appo import gae
from algorithms.base import roc_auc
from algorithms.grpo import group_advantages
from algorithms.losses import aggregate, clipped_surrogate, discounted_reverse_cumsum, huber, kl_k3, value_loss
from algorithms.rloo import filter_groups, leave_one_out_centred, rloo_returns
from algorithms.statistics import kl_early_stop, role_sums, row_statistics
from algorithms.tppo import tppo_advantages
from envs.modes import ProcessBaseline



@pytest.fixture(autouse=True)
def float64_default():
    """Hand-computed values are compared in float64; the default is restored for other modules."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def test_gae_by_hand():
    # one env, 3 steps; the episode terminates after step 2 (index 1), a new one starts at step 3
    rewards = torch.tensor([[0.0], [1.0], [0.5]])
    values = torch.tensor([[0.2], [0.4], [0.3]])
    next_values = torch.tensor([[0.4], [0.0], [0.6]])  # V(s1); terminated -> 0; bootstrap V(s3)=0.6
    ends = torch.tensor([[0.0], [1.0], [0.0]])
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(rewards, values, next_values, ends, gamma, lam)
    d2 = 0.5 + 0.9 * 0.6 - 0.3          # 0.74
    d1 = 1.0 + 0.0 - 0.4                # 0.6
    d0 = 0.0 + 0.9 * 0.4 - 0.2          # 0.16
    expected = [d0 + 0.72 * d1, d1, d2]  # A1 does not see A2 (episode ended)
    torch.testing.assert_close(advantages[:, 0], torch.tensor(expected))
    torch.testing.assert_close(returns, advantages + values)


def test_roc_auc_by_hand():
    assert roc_auc(torch.tensor([0.9, 0.8, 0.3]), torch.tensor([1, 1, 0])) == 1.0
    assert roc_auc(torch.tensor([0.9, 0.3, 0.5, 0.5]), torch.tensor([1, 1, 0, 1])) == (1 + 0 + 0.5) / 3
    with pytest.raises(ValueError, match="both classes"):
        roc_auc(torch.tensor([0.5]), torch.tensor([1]))


def test_grpo_group_zscores_by_hand():
    returns = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])
    a = group_advantages(returns, groups, "group", eps=0.0)
    std1 = math.sqrt(((0.5**2) * 4) / 3)  # mean 0.5, unbiased std
    std2 = math.sqrt((3 * 0.75**2 + 2.25**2) / 3)  # mean 2.75
    expected = [0.5 / std1, -0.5 / std1, -0.5 / std1, 0.5 / std1] + [-0.75 / std2] * 3 + [2.25 / std2]
    torch.testing.assert_close(a, torch.tensor(expected))
    torch.testing.assert_close(group_advantages(returns, groups, "none"),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]))
    torch.testing.assert_close(group_advantages(returns, groups, "batch", eps=0.0),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]) / returns.std())
    # a group where everyone is right has zero advantage, not NaN
    assert group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long)).abs().max() == 0
    # equal fractional returns too: exactly 0 (their float32 mean is 3e-8 off, which the eps scaled to 3e-4),
    # so the runner skips the group's update; a neighbouring group is unaffected
    equal = group_advantages(torch.tensor([0.1 + 0.2] * 8 + [0.0, 1.0]), torch.tensor([0] * 8 + [1, 1]))
    assert equal[:8].abs().max() == 0 and float(equal[9]) > 0 > float(equal[8])
    # a group of one (a role that acted once in its group) has nothing to compare with: 0
    torch.testing.assert_close(group_advantages(torch.tensor([3.0, 1.0, 0.0]), torch.tensor([0, 1, 1]), eps=0.0),
                               torch.tensor([0.0, 0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)]))
    with pytest.raises(ValueError, match="scale_rewards='zscore'"):
        group_advantages(returns, groups, "zscore")


def test_kl_k3_by_hand():
    log_probs, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    torch.testing.assert_close(kl_k3(log_probs, ref), torch.tensor([math.exp(-0.5) + 0.5 - 1.0, 0.0]))


def test_clipped_surrogate_by_hand():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5, 1.1]))
    adv = torch.tensor([1.0, -1.0, -2.0, 3.0])
    out = clipped_surrogate(new - old, adv, 0.2)
    # ratio 1.5, A>0: min(1.5, 1.2) -> 1.2 (clipped); A<0: min(-1.5, -1.2) -> -1.5 (unclipped)
    # ratio 0.5, A=-2: min(-1.0, -1.6) -> -1.6 (clipped); ratio 1.1 in range
    torch.testing.assert_close(out.loss, torch.tensor([-1.2, 1.5, 1.6, -3.3]))
    torch.testing.assert_close(out.clipped_high, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(out.clipped_low, torch.tensor([0.0, 0.0, 1.0, 0.0]))


def test_value_loss_and_huber_use_absolute_error():
    torch.testing.assert_close(huber(torch.tensor([-3.0, 3.0, 0.5]), 1.0), torch.tensor([2.5, 2.5, 0.125]))
    values, old, returns = torch.tensor([1.0, -1.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 2.0])
    # unclipped MSE: 0.5, 4.5; clipped values (0.2, -0.2): 0.02, 2.42 -> max
    torch.testing.assert_close(value_loss(values, old, returns, clip_param=0.2), torch.tensor([0.5, 4.5]))
    torch.testing.assert_close(value_loss(values, old, returns, clip_param=0.0, huber_delta=1.0),
                               torch.tensor([0.5, 2.5]))


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.0)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)  # (2 + 2) / 2
    loss[0, 1] = 6.0
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(3.0)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)


def test_discounted_reverse_cumsum_matches_loop():
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    expected = torch.zeros_like(x)
    running = torch.zeros(3)
    for j in reversed(range(7)):
        running = x[:, j] + 0.9 * running
        expected[:, j] = running
    torch.testing.assert_close(discounted_reverse_cumsum(x, 0.9), expected)


def tppo_loop(rewards, token_values, lengths, next_values, ends, gamma, lam):
    """The POAD recursion written as plain loops over steps, envs and tokens."""
    T, N, L = token_values.shape
    adv = torch.zeros(T, N, L)
    for n in range(N):
        next_first = 0.0
        for t in reversed(range(T)):
            last = int(lengths[t, n]) - 1
            for j in reversed(range(last + 1)):
                if j == last:
                    delta = rewards[t, n] + gamma * next_values[t, n] - token_values[t, n, j]
                    adv[t, n, j] = delta + gamma * lam * (1 - ends[t, n]) * next_first
                else:
                    delta = token_values[t, n, j + 1] - token_values[t, n, j]
                    adv[t, n, j] = delta + lam * adv[t, n, j + 1]
            next_first = adv[t, n, 0]
    returns = adv + token_values * (torch.arange(L) < lengths[..., None])
    return adv, returns


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tppo_vectorised_equals_loop(seed):
    g = torch.Generator().manual_seed(seed)
    T, N, L = 5, 6, 9
    rewards = torch.randn(T, N, generator=g)
    token_values = torch.randn(T, N, L, generator=g)
    lengths = torch.randint(1, L + 1, (T, N), generator=g)
    ends = (torch.rand(T, N, generator=g) < 0.3).double()
    next_values = torch.randn(T, N, generator=g) * (torch.rand(T, N, generator=g) < 0.8)
    gamma, lam = 0.97, 0.9
    advantages, returns = tppo_advantages(rewards, token_values, lengths, next_values, ends, gamma, lam)
    expected_adv, expected_ret = tppo_loop(rewards, token_values, lengths, next_values, ends, gamma, lam)
    torch.testing.assert_close(advantages, expected_adv, atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, expected_ret, atol=1e-6, rtol=0)


def test_rloo_centring_is_prime_codes_by_hand():
    """PRIME's compute_rloo_returns on one group of n = 3: a_it = (3 r_it - sum_j m_j) / 2, m_j response j's mean.
    Process stream, lengths 2, 2, 1: means 0.2, 0.1, 0.4 (sum 0.7), so
        response 0: (0.9 - 0.7) / 2 = 0.1,   (0.3 - 0.7) / 2 = -0.2
        response 1: (0.0 - 0.7) / 2 = -0.35, (0.6 - 0.7) / 2 = -0.05
        response 2: (1.2 - 0.7) / 2 = 0.25
    (response 0's first token: 0.3 less the others' mean (0.1 + 0.4) / 2 = 0.05, plus its own deviation
    (0.3 - 0.2) / 2 = 0.05). Outcome stream 1, 0, 1 at the last tokens: (3 o - 2) / 2 = 0.5, -1, 0.5, the plain
    leave-one-out baseline (1 - (0 + 1) / 2 = 0.5). Returns: reverse cumsums of the two streams' sum,
        response 0: [0.1, -0.2 + 0.5] -> [0.4, 0.3]; response 1: [-0.35, -0.05 - 1] -> [-1.4, -1.05];
        response 2: [0.25 + 0.5] -> [0.75]."""
    groups = torch.tensor([7, 7, 7])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    process = torch.tensor([[0.3, 0.1], [0.0, 0.2], [0.4, 5.0]])  # 5.0 sits on padding: ignored
    torch.testing.assert_close(leave_one_out_centred(process, mask, groups),
                               torch.tensor([[0.1, -0.2], [-0.35, -0.05], [0.25, 0.0]]))
    outcome = torch.tensor([1.0, 0.0, 1.0])
    returns = rloo_returns(outcome, groups, mask, process)
    torch.testing.assert_close(returns, torch.tensor([[0.4, 0.3], [-1.4, -1.05], [0.75, 0.0]]))
    with pytest.raises(ValueError, match="use group_size >= 2"):
        leave_one_out_centred(process, mask, torch.tensor([7, 7, 8]))
    # one reward per response, groups of 4 and 2: each score less the mean of its group's others
    scores, paid = torch.tensor([[1.0], [0.0], [0.0], [1.0], [3.0], [5.0]]), torch.ones(6, 1)
    torch.testing.assert_close(leave_one_out_centred(scores, paid, torch.tensor([0, 0, 0, 0, 1, 1])),
                               torch.tensor([[2 / 3], [-2 / 3], [-2 / 3], [2 / 3], [-2.0], [2.0]]))


def test_the_response_baseline_takes_the_others_mean_process_return_whatever_the_length_by_hand():
    """One group of n = 2, process rewards [0.3, 0.1] (R_0 = 0.4, 2 tokens) and [-0.2] (R_1 = -0.2, 1 token).
    token (PRIME's code): m = 0.2, -0.2, sum 0; a = 2 r: response 0 [0.6, 0.2], its return 0.8 = R_0 - 2 x (-0.2),
    the other's per-token mean taken twice; response 1 -0.4 = R_1 - 1 x 0.2.
    response: sum_j R_j = 0.2 spread over each response's own tokens: response 0 2 r - 0.1 = [0.5, 0.1], its
    return 0.6 = R_0 - R_1; response 1 2 r - 0.2 = -0.6 = R_1 - R_0."""
    groups, mask = torch.tensor([3, 3]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    process = torch.tensor([[0.3, 0.1], [-0.2, 0.0]])
    token = leave_one_out_centred(process, mask, groups)
    response = leave_one_out_centred(process, mask, groups, ProcessBaseline.RESPONSE)
    torch.testing.assert_close(token, torch.tensor([[0.6, 0.2], [-0.4, 0.0]]))
    torch.testing.assert_close(response, torch.tensor([[0.5, 0.1], [-0.6, 0.0]]))
    torch.testing.assert_close(response.sum(-1), torch.tensor([0.4 - -0.2, -0.2 - 0.4]))
    # through rloo_returns: the first token's process return is the response's, less the other's
    returns = rloo_returns(torch.zeros(2), groups, mask, process, process_baseline=ProcessBaseline.RESPONSE)
    torch.testing.assert_close(returns[:, 0], torch.tensor([0.6, -0.6]))
    # a stream paid once per response is centred alike by both
    scores, paid = torch.tensor([[1.0], [0.0], [3.0]]), torch.ones(3, 1)
    torch.testing.assert_close(leave_one_out_centred(scores, paid, torch.tensor([0, 0, 0]), ProcessBaseline.RESPONSE),
                               leave_one_out_centred(scores, paid, torch.tensor([0, 0, 0])))


def test_rloo_returns_prime_combination_by_hand():
    outcome = torch.tensor([1.0, 0.0])
    groups = torch.tensor([4, 4])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    process = torch.tensor([[0.3, 0.0, 0.3], [0.1, 0.3, 9.0]])  # 9.0 sits on padding: ignored
    returns = rloo_returns(outcome, groups, mask, process, outcome_coef=2.0, process_coef=0.5, gamma=1.0)
    # outcome stream (n = 2): 2 o - (1 + 0) = +1 at token 2 of response 0, -1 at token 1 of response 1 (times 2)
    # process stream: means 0.2 and 0.2 (sum 0.4) -> 2 r - 0.4 on each token (times 0.5)
    a0 = torch.tensor([0.1, -0.2, 0.1 + 2.0])
    a1 = torch.tensor([-0.1, 0.1 - 2.0, 0.0])
    expected = torch.stack([a0.flip(0).cumsum(0).flip(0), a1.flip(0).cumsum(0).flip(0) * mask[1]])
    torch.testing.assert_close(returns, expected)
    outcome_only = rloo_returns(outcome, groups, mask)
    torch.testing.assert_close(outcome_only, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))


@pytest.mark.parametrize("normalize", [True, False])
def test_rloo_keeps_the_filtered_groups_and_standardises_their_returns(normalize):
    """One step, three groups of two: group 0 all right and group 2 all wrong are filtered out; group 1's
    returns are +1 and -1 over the outcome's leave-one-out baseline, then (normalize_advantages, PRIME's code)
    standardised over the kept tokens: 3 tokens at +1 and 1 at -1 have mean 0.5 and std 1 (unbiased)."""
    from algorithms.buffer import RolloutBuffer, StepRecord
    from algorithms.config import AlgorithmConfig
    from algorithms.rloo import RLOO

    torch.set_default_dtype(torch.float32)  # the buffer's dtype in training (the fixture restores float64)
    buffer = RolloutBuffer(1, 6, 1, 3)
    buffer.add(StepRecord(step=0, envs=list(range(6)), agents=[0] * 6, prompt_ids=[[1]] * 6,
                          action_ids=[[2], [2, 3], [2, 3, 4], [2], [2, 3], [2]], rollout_log_probs=[[0.0]] * 6,
                          group_ids=torch.tensor([0, 0, 1, 1, 2, 2]), texts=["x"] * 6))
    correct = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    buffer.add_step_results(0, correct[:, None].numpy(), torch.ones(6, dtype=torch.bool).numpy(),
                            torch.zeros(6, dtype=torch.bool).numpy(), correct.numpy())
    rloo = RLOO(AlgorithmConfig(process_coef=0.0, normalize_advantages=normalize))
    assert rloo.kept(buffer)[0, :, 0].tolist() == [False, False, True, True, False, False]
    estimate = rloo.advantages(buffer)
    advantages = estimate.advantages[0, :, 0]  # [N, L]
    plus, minus = 1 - 0.5, -1 - 0.5  # (x - mean) / std
    expected = [[plus] * 3, [minus, 0.0, 0.0]] if normalize else [[1.0] * 3, [-1.0, 0.0, 0.0]]
    torch.testing.assert_close(advantages[2:4], torch.tensor(expected))
    assert float(advantages[[0, 1, 4, 5]].abs().sum()) == 0.0


def test_filter_groups_by_accuracy():
    correct = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0])
    groups = torch.tensor([0] * 4 + [1] * 4 + [2] * 4)
    keep = filter_groups(correct, groups, 0.2, 0.8)
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4


def test_filter_groups_drops_a_group_holding_a_cut_response():
    # groups 0 and 1 both half right; a response of group 1 ran to the token limit
    correct = torch.tensor([1, 0, 1, 0, 1, 0, 0, 1])
    groups = torch.tensor([0] * 4 + [1] * 4)
    cut = torch.tensor([False] * 5 + [True] + [False] * 2)
    assert filter_groups(correct, groups, 0.2, 0.8, cut).tolist() == [True] * 4 + [False] * 4
    assert filter_groups(correct, groups, 0.2, 0.8).tolist() == [True] * 8


def test_kl_early_stop_only_above_a_set_target():
    assert kl_early_stop(0.03, target_kl=0.02) and not kl_early_stop(0.02, target_kl=0.02)
    assert not kl_early_stop(5.0, target_kl=0.0)  # 0: off


def test_role_statistics_by_hand():
    """Three actions of two tokens (the last one token long): agents 0, 1, 0 of roles (writer, judge).
    Entropy is each action's mean over its own tokens, approx KL the k3 of its joint log-probs."""
    batch = SimpleNamespace(token_mask=torch.tensor([[True, True], [True, True], [True, False]]),
                            old_log_probs=torch.tensor([[-1.0, -1.0], [-0.5, -0.5], [-2.0, 0.0]]))
    log_probs = torch.tensor([[-1.0, -1.0], [-1.0, -0.5], [-1.0, 0.0]])
    entropy = torch.tensor([[1.0, 3.0], [0.5, 0.5], [4.0, 100.0]])
    rows = row_statistics(log_probs, entropy, batch, value_loss=torch.tensor([0.1, 0.2, 0.3]))
    torch.testing.assert_close(rows["entropy"], torch.tensor([2.0, 0.5, 4.0]))
    # k3 = exp(d) - 1 - d with d = new - old joint log-prob: 0, -0.5, 1.0
    torch.testing.assert_close(rows["approx_kl"], torch.tensor([0.0, math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0]))
    sums = role_sums(rows, torch.tensor([0, 1, 0]), ["writer", "judge"])
    assert sums["writer/entropy"] == (6.0, 2) and sums["judge/entropy"] == (0.5, 1)
    assert sums["writer/value_loss"] == (pytest.approx(0.4), 2) and sums["judge/value_loss"] == (pytest.approx(0.2), 1)
    assert set(role_sums(rows, torch.tensor([0, 0, 0]), ["writer", "judge"])) == {
        "writer/entropy", "writer/approx_kl", "writer/value_loss"}  # a role without rows in the batch: none
