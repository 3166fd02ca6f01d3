"""Dynamic sampling (DAPO's filter_groups): which groups have signal, buffers joined along the env axis, the
rounds that refill a batch, its flags, and a run of train_math with it (synchronous and asynchronous)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from absl import flags

from algorithms.base import make_algorithm
from algorithms.buffer import RolloutBuffer, StepRecord
from algorithms.config import AlgorithmConfig
from event_files import read_scalars
from test_train_math import parse
from test_trainer import run_train_math
from train.collector import Tally
from train.rollouts import refilled


def episodic_buffer(returns: list[float], group_ids: list[int], group_offset: int = 0) -> RolloutBuffer:
    """One step of len(returns) envs, one agent; env n's action is the tokens [n, n] of prompt [n]."""
    num_envs = len(returns)
    buffer = RolloutBuffer(1, num_envs, 1, 2)
    buffer.add(StepRecord(step=0, envs=range(num_envs), agents=[0] * num_envs,
                          prompt_ids=[[n] for n in range(num_envs)],
                          action_ids=[[n, n] for n in range(num_envs)], rollout_log_probs=[[-0.5, -0.25]] * num_envs,
                          group_ids=torch.tensor(group_ids) + group_offset, texts=[f"t{n}" for n in range(num_envs)],
                          cut=[n % 2 == 1 for n in range(num_envs)]))
    buffer.add_step_results(0, np.array(returns)[:, None], np.ones(num_envs, dtype=bool),
                            np.zeros(num_envs, dtype=bool), np.array(returns))
    return buffer


def test_varied_groups_are_those_whose_returns_differ():
    # groups 7: (1, 1) equal; 3: (0, 1) varied; 5: (0.5, 0.5) equal
    buffer = episodic_buffer([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], [7, 7, 3, 3, 5, 5])
    ids, varied = buffer.varied_groups()
    assert ids.tolist() == [3, 5, 7] and varied.tolist() == [True, False, False]
    assert buffer.prompt_groups().tolist() == [7, 7, 3, 3, 5, 5]


def test_concat_envs_carries_every_slot_of_the_chosen_envs():
    first = episodic_buffer([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    second = episodic_buffer([0.0, 1.0, 0.0, 0.0], [0, 0, 1, 1], group_offset=10)
    joined = RolloutBuffer.concat_envs([(first, torch.tensor([0, 1])), (second, torch.tensor([0, 1]))])
    assert joined.shape == (1, 4, 1)
    assert joined.rewards[0, :, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert joined.group_ids[0, :, 0].tolist() == [0, 0, 10, 10]
    assert joined.cut[0, :, 0].tolist() == [False, True, False, True]
    assert joined.prompt_ids == [[0], [1], [0], [1]] and joined.texts == ["t0", "t1", "t0", "t1"]
    assert joined.live.all() and joined.steps_filled == 1
    torch.testing.assert_close(joined.rollout_log_probs[0, :, 0], torch.tensor([[-0.5, -0.25]] * 4))
    # GRPO on the joined batch: each group's own baseline, returns (1, 0) -> +-z
    targets = make_algorithm("GRPO", AlgorithmConfig()).advantages(joined)
    z = 0.5 / (np.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(targets.advantages[0, :, 0], torch.tensor([z, -z, -z, z], dtype=torch.float32))


def scripted_rounds(rounds: list[list[float]]):
    """A ``Collector.collect(policy, generator, seed)`` that returns round k's buffer (groups of two envs, ids
    unique across rounds) and records the seeds it was called with."""
    seeds = []

    def collect(policy, generator, seed: int) -> tuple[RolloutBuffer, Tally]:
        k = len(seeds)
        seeds.append(seed)
        returns = rounds[k]
        tally = Tally()
        tally.add("train/reward", returns)
        tally.seconds["generate"] = 1.0 + k
        return episodic_buffer(returns, [g // 2 for g in range(len(returns))], group_offset=100 * k), tally

    return collect, seeds


def test_refill_draws_rounds_until_the_batch_holds_the_groups_wanted():
    # three groups per round; round 0 has one varied group (1), round 1 two (100, 102), round 2 is never drawn
    collect, seeds = scripted_rounds([[1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 0, 1], [0, 1, 0, 1, 0, 1]])
    buffer, tally = refilled(collect, None, None, seed=42, groups_wanted=3, max_rounds=5)
    assert len(seeds) == 2 and seeds[0] == 42 and seeds[1] != 42
    assert buffer.group_ids[0, :, 0].tolist() == [1, 1, 100, 100, 102, 102]
    assert buffer.rewards[0, :, 0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert tally.mean("rollout/gen_rounds") == 2
    assert tally.mean("rollout/filtered_share") == pytest.approx(3 / 6)  # 6 groups drawn, 3 of equal returns
    assert tally.mean("rollout/filled_share") == 1.0
    assert tally.counts["train/reward"] == 12  # every episode drawn is counted in the statistics
    assert tally.seconds["generate"] == 1.0 and tally.seconds["refill_generate"] == 2.0


def test_filter_truncated_refills_past_groups_holding_a_cut_answer():
    # groups of two, the second env of each cut (episodic_buffer): every group holds a cut answer
    buffer = episodic_buffer([1.0, 0.0, 1.0, 1.0], [4, 4, 2, 2])
    assert buffer.cut_groups(torch.tensor([2, 4])).tolist() == [True, True]
    collect, seeds = scripted_rounds([[1, 0, 0, 1], [0, 1, 1, 1]])
    buffer, tally = refilled(collect, None, None, seed=0, groups_wanted=1, max_rounds=2, filter_truncated=True)
    assert len(seeds) == 2  # round 0's varied groups were cut: nothing kept, round 1 drawn, nothing kept either
    assert tally.mean("rollout/cut_group_share") == 1.0 and tally.mean("rollout/filtered_share") == 1.0
    assert tally.mean("rollout/filled_share") == 0.0
    # the last round comes back as it came; RLOO's filter drops its varied group 100, which holds a cut answer
    assert buffer.group_ids[0, :, 0].tolist() == [100, 100, 101, 101]
    every_accuracy = {"accuracy_lower_bound": 0.0, "accuracy_upper_bound": 1.0}
    targets = make_algorithm("RLOO", AlgorithmConfig(filter_truncated=True, **every_accuracy)).advantages(buffer)
    assert not targets.advantages.any() and not targets.keep.any()
    unfiltered = make_algorithm("RLOO", AlgorithmConfig(**every_accuracy)).advantages(buffer)
    assert unfiltered.keep[0, :, 0].tolist() == [True, True, True, True] and unfiltered.advantages.any()
    # without the filter round 0's first varied group fills the batch
    collect, seeds = scripted_rounds([[1, 0, 0, 1], [0, 1, 1, 1]])
    buffer, tally = refilled(collect, None, None, seed=0, groups_wanted=1, max_rounds=2)
    assert len(seeds) == 1 and buffer.group_ids[0, :, 0].tolist() == [0, 0]
    assert "rollout/cut_group_share" not in tally.counts


def test_filter_truncated_keeps_groups_whose_answers_all_stopped():
    uncut = [False] * 4
    collect, seeds = scripted_rounds([[1, 0, 0, 1], [1, 1, 1, 0]])

    def collect_uncut_second_round(policy, generator, seed):
        buffer, tally = collect(policy, generator, seed)
        if len(seeds) == 2:
            buffer.cut[0, :, 0] = torch.tensor(uncut)
        return buffer, tally

    buffer, tally = refilled(collect_uncut_second_round, None, None, seed=0, groups_wanted=1, max_rounds=3,
                             filter_truncated=True)
    assert len(seeds) == 2 and buffer.group_ids[0, :, 0].tolist() == [101, 101]
    assert tally.mean("rollout/cut_group_share") == pytest.approx(2 / 4)  # round 0's two groups of four drawn
    assert tally.mean("rollout/filtered_share") == pytest.approx(3 / 4)  # round 1's first group: equal returns


def test_refill_stops_after_the_most_rounds_with_the_groups_it_holds():
    collect, seeds = scripted_rounds([[1, 1, 0, 1], [0, 0, 1, 1], [0, 0, 0, 0]])
    buffer, tally = refilled(collect, None, None, seed=0, groups_wanted=2, max_rounds=2)
    assert len(seeds) == 2 and buffer.shape == (1, 2, 1)
    assert tally.mean("rollout/filled_share") == 0.5
    # nothing varied in any round: the last round as it came, which trains on nothing
    collect, seeds = scripted_rounds([[1, 1, 0, 0], [0, 0, 1, 1]])
    buffer, tally = refilled(collect, None, None, seed=0, groups_wanted=2, max_rounds=2)
    assert buffer.shape == (1, 4, 1) and buffer.group_ids[0, :, 0].tolist() == [100, 100, 101, 101]
    assert tally.mean("rollout/filled_share") == 0.0 and tally.mean("rollout/filtered_share") == 1.0


@pytest.mark.parametrize("argv, message", [
    (["--algorithm_name", "APPO", "--filter_groups"], "APPO collects no groups"),
    (["--algorithm_name", "TPPO", "--filter_groups", "--max_num_gen_batches", "3"], "TPPO collects no groups"),
    (["--max_num_gen_batches", "3"], "add --filter_groups"),
    (["--algorithm_name", "RLOO", "--filter_groups"], "pass --oversample_factor 1"),
    (["--filter_groups", "--max_num_gen_batches", "0"], "max_num_gen_batches"),
    (["--filter_truncated"], "--filter_truncated applies to RLOO"),
    (["--algorithm_name", "RLOO", "--filter_truncated", "--action_level", "token"], "every action is one token"),
])
def test_meaningless_dynamic_sampling_flags_are_refused(argv, message):
    with pytest.raises((flags.Error, ValueError), match=message):
        parse(*argv)


def test_dynamic_sampling_flags_reach_the_run_config():
    config = parse("--filter_groups", "--max_num_gen_batches", "3", "--algorithm_name", "RLOO",
                   "--oversample_factor", "1")
    assert config.rollout.filter_groups and config.rollout.max_num_gen_batches == 3
    assert not config.prime.filter_truncated
    assert parse("--algorithm_name", "RLOO", "--filter_truncated").prime.filter_truncated


@pytest.mark.parametrize("extra", [["--async_rollouts"], ["--noasync_rollouts", "--algorithm_name", "RLOO",
                                                            "--oversample_factor", "1", "--filter_truncated"]])
def test_a_run_with_dynamic_sampling_logs_its_rounds_and_their_cost(untrained_policy_dir, tmp_path, extra):
    run_dir = run_train_math(["--model_name_or_path", str(untrained_policy_dir), "--num_env_steps", "16",
                              "--n_rollout_threads", "8", "--group_size", "4", "--max_new_tokens", "6",
                              "--eval_interval", "0", "--logdir", str(tmp_path), "--save_interval", "0",
                              "--filter_groups", "--max_num_gen_batches", "3", *extra])
    scalars = read_scalars(run_dir)
    assert ("rollout/cut_group_share" in scalars) == ("--filter_truncated" in extra)
    rounds = [value for _, value in scalars["rollout/gen_rounds"]]
    assert len(rounds) == 2 and all(1 <= r <= 3 for r in rounds)
    filled = [value for _, value in scalars["rollout/filled_share"]]
    for r, share in zip(rounds, filled):  # fewer than the most rounds: the batch was filled
        assert r == 3 or share == 1.0
    assert ("time/refill" in scalars) == any(r > 1 for r in rounds)
    assert all(0 <= value <= 1 for _, value in scalars["rollout/filtered_share"])


@pytest.mark.slow
def test_dynamic_sampling_refills_the_batch_with_groups_that_have_signal(tiny_models, tmp_path):
    """The shipped policy answers about one Arith problem in eight right: a group of eight is often all wrong
    under the outcome reward, and the batch is refilled to its four groups of varied returns."""
    run_dir = run_train_math(["--model_name_or_path", str(tiny_models.policy), "--reward", "outcome",
                              "--num_env_steps", "96", "--n_rollout_threads", "32", "--group_size", "8",
                              "--temperature", "1.0", "--eval_interval", "0", "--logdir", str(tmp_path),
                              "--save_interval", "0", "--filter_groups", "--max_num_gen_batches", "8"])
    scalars = read_scalars(run_dir)
    assert [value for _, value in scalars["rollout/filled_share"]] == [1.0] * 3
    assert any(value > 0 for _, value in scalars["rollout/filtered_share"])
    assert any(value > 1 for _, value in scalars["rollout/gen_rounds"]) and "time/refill" in scalars
    # every trained sample belongs to a group of varied returns: 4 groups of 8
    assert [value for _, value in scalars["train/trained_samples"]] == [32.0] * 3
