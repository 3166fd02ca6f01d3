"""RolloutBuffer: masks from true lengths, minibatch / gradient-accumulation weighting, episode views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from algorithms.base import make_algorithm
from algorithms.config import AlgorithmConfig
from algorithms.buffer import AdvantageEstimate, RolloutBuffer, StepRecord
from envs.modes import LossAgg
from models.scoring import ActionScores

VOCAB = 11


def filled_buffer(num_steps: int = 2, num_envs: int = 7, max_tokens: int = 5,
                  seed: int = 0) -> tuple[RolloutBuffer, AdvantageEstimate]:
    """Random actions of lengths 1..max_tokens (token id 0, the 'pad' id, appears as a real token);
    env 6 is not live at step 1 (its episode ended). Random advantages and returns."""
    g = torch.Generator().manual_seed(seed)
    buffer = RolloutBuffer(num_steps, num_envs, 1, max_tokens)
    for step in range(num_steps):
        envs = list(range(num_envs - 1 if step == 1 else num_envs))
        lengths = torch.randint(1, max_tokens + 1, (len(envs),), generator=g).tolist()
        actions = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
        log_probs = [(-torch.rand(n, generator=g)).tolist() for n in lengths]
        rewards = np.zeros((num_envs, 1))
        rewards[envs, 0] = torch.rand(len(envs), generator=g).numpy()
        buffer.add(StepRecord(step=step, envs=envs, agents=[0] * len(envs), prompt_ids=[[1, 2, 3]] * len(envs),
                              action_ids=actions, rollout_log_probs=log_probs,
                              group_ids=torch.tensor([e // 2 for e in envs]),
                              texts=["x"] * len(envs), values=torch.randn(len(envs), generator=g)))
        buffer.add_step_results(step, rewards, np.zeros(num_envs, dtype=bool), np.zeros(num_envs, dtype=bool),
                      np.full(num_envs, np.nan))
    advantages = torch.randn(buffer.shape, generator=g) * buffer.live
    return buffer, AdvantageEstimate(advantages, returns=torch.randn(buffer.shape, generator=g))


def test_step_results_pay_each_agent_at_its_latest_action():
    """Two envs, two agents: in env 0 agent 0 acts at steps 0 and 2, agent 1 at step 1; env 1's agent 1 never
    acts. The team outcome paid at step 2 lands on each agent's latest action, with the episode's end."""
    buffer = RolloutBuffer(3, 2, 2, 1)
    nan = float("nan")
    for step, agent in ((0, 0), (1, 1), (2, 0)):
        buffer.add(StepRecord(step=step, envs=[0, 1], agents=[agent, 0], prompt_ids=[[1]] * 2, action_ids=[[2]] * 2,
                              rollout_log_probs=[[0.0]] * 2, group_ids=torch.tensor([0, 1]), texts=["x"] * 2))
        rewards = np.array([[0.5, 0.0], [0.0, 0.0]]) if step == 0 else np.zeros((2, 2))
        if step == 2:
            rewards = np.array([[1.0, 1.0], [0.0, 7.0]])  # env 1's agent 1 has no action to take its 7
        ended = np.array([step == 2, False])
        buffer.add_step_results(step, rewards, ended, np.zeros(2, dtype=bool),
                                np.array([1.0 if step == 2 else nan, nan]))
    assert buffer.rewards[:, 0].tolist() == [[0.5, 0.0], [0.0, 1.0], [1.0, 0.0]]
    assert buffer.rewards[:, 1].tolist() == [[0.0, 0.0]] * 3
    assert buffer.terminated[:, 0].tolist() == [[False, False], [False, True], [True, False]]
    assert not buffer.terminated[:, 1].any()
    assert buffer.correct[1, 0, 1] == 1.0 and buffer.correct[2, 0, 0] == 1.0 and buffer.correct[0, 0, 0].isnan()
    assert buffer.episode_returns().tolist() == [[1.5, 1.0], [0.0, 0.0]]


def test_token_mask_comes_from_lengths_not_pad_ids():
    buffer = RolloutBuffer(1, 2, 1, 4)
    buffer.add(StepRecord(step=0, envs=[0, 1], agents=[0, 0], prompt_ids=[[5], [6]], action_ids=[[0, 0, 7], [0]],
                          rollout_log_probs=[[-1.0] * 3, [-2.0]],
                          group_ids=torch.zeros(2, dtype=torch.long), texts=["a", "b"]))
    assert buffer.token_mask()[0, :, 0].tolist() == [[True, True, True, False], [True, False, False, False]]
    batch = buffer.rows()
    assert batch.action_ids.shape == (2, 3) and batch.token_mask.sum().item() == 4


def scores_from(theta: torch.Tensor, batch) -> ActionScores:
    """A stand-in policy: log-softmax of one parameter vector, read at the action ids."""
    all_log_probs = theta.log_softmax(-1)
    entropy = -(all_log_probs.exp() * all_log_probs).sum() * batch.action_ids.float().sin()  # varies per token
    return ActionScores(log_probs=torch.where(batch.token_mask, all_log_probs[batch.action_ids], 0.0),
                        mask=batch.token_mask, entropy=torch.where(batch.token_mask, entropy, 0.0),
                        values=theta[batch.action_ids].tanh())


def accumulated_gradient(buffer, targets, algorithm, num_mini_batch, micro_batches, skip=None,
                         max_tokens: int = 0) -> list[torch.Tensor]:
    """Gradient of each minibatch, accumulated over its micro-batches."""
    grads = []
    for minibatch in buffer.minibatches(targets, num_mini_batch, micro_batches, torch.Generator().manual_seed(3),
                                        skip=skip, max_tokens=max_tokens):
        theta = torch.linspace(-1, 1, VOCAB, requires_grad=True)
        for batch in minibatch:
            loss, _ = algorithm.loss(scores_from(theta, batch), batch)
            loss.backward()
        grads.append(theta.grad)
    return grads


@pytest.mark.parametrize("name, loss_agg_mode", [("GRPO", "token-mean"), ("GRPO", "seq-mean-token-mean"),
                                                 ("GRPO", "seq-mean-token-sum-norm"), ("APPO", "token-mean")])
@pytest.mark.parametrize("micro_batches", [2, 3, 5])
def test_gradient_accumulation_equals_full_batch_gradient(name, loss_agg_mode, micro_batches):
    buffer, targets = filled_buffer()  # 13 live slots: no split below divides them evenly
    algorithm = make_algorithm(name, AlgorithmConfig(loss_agg_mode=loss_agg_mode, loss_scale_factor=8,
                                                       value_clip_param=0.0, entropy_coef=0.1))
    (full,) = accumulated_gradient(buffer, targets, algorithm, 1, 1)
    (accumulated,) = accumulated_gradient(buffer, targets, algorithm, 1, micro_batches)
    torch.testing.assert_close(accumulated, full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("max_tokens", [1, 9, 20])
def test_a_token_budget_per_micro_batch_keeps_the_gradient(max_tokens):
    buffer, targets = filled_buffer()
    algorithm = make_algorithm("GRPO", AlgorithmConfig(entropy_coef=0.1))
    (full,) = accumulated_gradient(buffer, targets, algorithm, 1, 1)
    (budgeted,) = accumulated_gradient(buffer, targets, algorithm, 1, 2, max_tokens=max_tokens)
    torch.testing.assert_close(budgeted, full, atol=1e-6, rtol=1e-5)


def test_a_token_budget_cuts_micro_batches_by_forwarded_positions_keeping_a_prompts_rows_together():
    """Three groups of rows: prompts of 4, 6 and 3 tokens, actions of the lengths below. A micro-batch forwards
    each prompt once, padded to its longest prompt, plus every action, padded to its longest action: 4 + 2 x 3
    = 10 for group a, 6 + 2 x 5 = 16 for group b (over a budget of 12, so cut: 6 + 5 and 6 + 5), 3 + 2 x 1 = 5
    for group c; a and c together 2 x 4 + 4 x 3 = 20 (their 14 tokens padded)."""
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8, 9, 10], "c": [11, 12, 13]}
    rows = [("b", 5), ("a", 2), ("c", 1), ("b", 5), ("a", 3), ("c", 1)]
    buffer = RolloutBuffer(1, len(rows), 1, 5)
    buffer.add(StepRecord(step=0, envs=list(range(len(rows))), agents=[0] * len(rows),
                          prompt_ids=[prompts[g] for g, _ in rows],
                          action_ids=[[7] * n for _, n in rows], rollout_log_probs=[[-1.0] * n for _, n in rows],
                          group_ids=torch.tensor([ord(g) for g, _ in rows]), texts=["x"] * len(rows)))

    def cut(max_tokens: int) -> list[list[int]]:
        return [part.tolist() for part in buffer.within_tokens(torch.arange(len(rows)), max_tokens)]

    assert cut(12) == [[0], [3], [1, 4], [2, 5]]  # b first (its prompt is seen first), then a, then c
    assert cut(19) == [[0, 3], [1, 4], [2, 5]]  # c does not fit beside a (20 with padding): moved whole, not cut
    assert cut(20) == [[0, 3], [1, 4, 2, 5]]
    assert cut(32) == [[0, 3, 1, 4], [2, 5]]  # b and a: 2 x 6 + 4 x 5
    assert cut(100) == [[0, 3, 1, 4, 2, 5]]
    assert cut(1) == [[0], [3], [1], [4], [2], [5]]  # a row over the budget goes alone


def test_skipping_zero_advantage_rows_keeps_the_gradient():
    buffer, targets = filled_buffer()
    targets.advantages[:, :3] = 0.0  # e.g. groups that were all right: no loss, no gradient
    algorithm = make_algorithm("GRPO", AlgorithmConfig())
    (full,) = accumulated_gradient(buffer, targets, algorithm, 1, 1)
    (skipped,) = accumulated_gradient(buffer, targets, algorithm, 1, 4, skip=algorithm.skippable_rows)
    torch.testing.assert_close(skipped, full, atol=1e-6, rtol=1e-5)


def test_minibatches_cover_every_live_slot_once_with_balanced_sizes():
    buffer, targets = filled_buffer()
    minibatches = list(buffer.minibatches(targets, 4, 2, torch.Generator().manual_seed(0)))
    sizes = [sum(b.num_samples for b in mb) for mb in minibatches]
    assert sorted(sizes) == [3, 3, 3, 4]
    seen = torch.cat([b.index for mb in minibatches for b in mb])
    assert sorted(seen.tolist()) == buffer.live.flatten().nonzero().squeeze(1).tolist()
    for minibatch in minibatches:  # micro-batch weights of a minibatch sum to one, in both units
        assert sum(b.weight(LossAgg.SEQ_MEAN_TOKEN_MEAN) for b in minibatch) == pytest.approx(1.0)
        assert sum(b.weight(LossAgg.TOKEN_MEAN) for b in minibatch) == pytest.approx(1.0)


def test_minibatch_gradients_sum_to_full_gradient_for_sample_weighted_loss():
    """With sample weighting, averaging minibatch gradients by their sizes gives the full one."""
    buffer, targets = filled_buffer()
    algorithm = make_algorithm("APPO", AlgorithmConfig(value_clip_param=0.0))
    (full,) = accumulated_gradient(buffer, targets, algorithm, 1, 1)
    minibatches = list(buffer.minibatches(targets, 3, 1, torch.Generator().manual_seed(3)))
    parts = accumulated_gradient(buffer, targets, algorithm, 3, 1)
    sizes = [mb[0].num_samples for mb in minibatches]
    combined = sum(g * n for g, n in zip(parts, sizes)) / sum(sizes)
    torch.testing.assert_close(combined, full, atol=1e-6, rtol=1e-5)


def test_episode_views_make_multi_step_episodes_contiguous_and_invert():
    buffer, _ = filled_buffer(num_steps=3, num_envs=4, max_tokens=3)
    order, mask = buffer.episode_token_order()
    lengths = buffer.action_lengths * buffer.live
    assert mask.sum(1).tolist() == lengths.sum(0).squeeze(-1).tolist()
    assert (mask.long().diff(dim=1) <= 0).all()  # real tokens first, then padding
    x = torch.randn(*buffer.shape, 3) * buffer.token_mask()
    torch.testing.assert_close(buffer.from_episodes(buffer.to_episodes(x, order), order), x)
    # env 0's tokens in time order: step 0's, then step 1's, then step 2's
    real = [x[t, 0, 0, :n] for t, n in enumerate(lengths[:, 0, 0].tolist())]
    torch.testing.assert_close(buffer.to_episodes(x, order)[0, : int(mask[0].sum())], torch.cat(real))
