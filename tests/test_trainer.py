"""Algorithms on a real (tiny) policy: advantages from a filled buffer, and one optimizer step on
each algorithm's loss moves log-probs the way the advantage says. Slow: each algorithm raises the
mean training reward on Arith with the tiny trained policy."""

from __future__ import annotations

import glob
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from algorithms.base import make_algorithm
from algorithms.config import AlgorithmConfig
from algorithms.registry import ALGORITHMS
from algorithms.buffer import RolloutBuffer, StepRecord
from models.policy import LanguagePolicy
from models.tiny import shipped_models
from event_files import read_scalars
from train.reporting import bar_summary


@pytest.fixture(scope="module")
def policy(untrained_policy_dir):
    torch.manual_seed(0)
    return LanguagePolicy(untrained_policy_dir, device="cpu", with_critic=True).eval()


def one_step_buffer(policy: LanguagePolicy, critic: str | None) -> RolloutBuffer:
    """Two envs of one group, one action each: env 0 right (reward 1), env 1 wrong (reward 0). The
    critic's values are recorded as 0 (an untrained critic's values would decide the signs)."""
    prompts = [[5, 6, 7], [5, 6, 7]]
    actions = [[8, 9, 10, 11], [12, 13]]
    with torch.no_grad():
        scores = policy.score_actions(prompts, actions, with_values=True)
    scores.values.zero_()
    log_probs = [scores.log_probs[i, :len(a)].tolist() for i, a in enumerate(actions)]
    buffer = RolloutBuffer(1, 2, 1, 6, token_values=critic == "token")
    buffer.add(StepRecord(step=0, envs=[0, 1], agents=[0, 0], prompt_ids=prompts, action_ids=actions,
                          rollout_log_probs=log_probs,
                          group_ids=torch.zeros(2, dtype=torch.long), texts=["a", "b"], values=scores.values[:, 0],
                          token_values=scores.values if critic == "token" else None))
    buffer.add_step_results(0, np.array([[1.0], [0.0]]), np.ones(2, dtype=bool), np.zeros(2, dtype=bool),
                            np.array([1.0, 0.0]))
    buffer.next_values = torch.zeros(buffer.shape)  # both episodes terminated
    return buffer


def joint_log_probs(policy, batch) -> torch.Tensor:
    return policy.score_actions(batch.prompt_ids, (batch.action_ids, batch.action_lengths)).log_probs.sum(-1)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_one_update_moves_log_probs_with_the_advantage(policy, name):
    algorithm = make_algorithm(name, AlgorithmConfig(accuracy_lower_bound=0.0, accuracy_upper_bound=1.0))
    buffer = one_step_buffer(policy, ALGORITHMS[name].critic)
    targets = algorithm.advantages(buffer)
    batch = buffer.batch(torch.arange(2), 2, 6, targets)
    signs = targets.advantages.reshape(2, -1)[:, 0].sign()
    assert signs.tolist() == [1.0, -1.0], f"{name}: the right answer must get the positive advantage"
    with torch.no_grad():
        before = joint_log_probs(policy, batch)
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.SGD(policy.actor_parameters(), lr=0.02)
    scores = policy.score_actions(batch.prompt_ids, (batch.action_ids, batch.action_lengths), with_values=True)
    loss, stats = algorithm.loss(scores, batch)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = joint_log_probs(policy, batch)
    policy.load_state_dict(state)
    assert after[0] > before[0] and after[1] < before[1], f"{name}: {before.tolist()} -> {after.tolist()}"
    assert all(math.isfinite(float(v)) for v in stats.values())


def test_grpo_gives_each_episode_its_group_advantage_on_every_step():
    buffer = RolloutBuffer(2, 4, 1, 3)
    nan = float("nan")
    # group 0 = envs 0, 1; group 1 = envs 2, 3. Env 0 takes two steps (0.5 each), the others one.
    step0 = dict(rewards=[0.5, 0.0, 1.0, 1.0], ends=[False, True, True, True], correct=[nan, 0.0, 1.0, 1.0])
    buffer.add(StepRecord(step=0, envs=range(4), agents=[0] * 4, prompt_ids=[[1]] * 4, action_ids=[[2]] * 4,
                          rollout_log_probs=[[-1.0]] * 4, group_ids=torch.tensor([0, 0, 1, 1]), texts=["s"] * 4))
    buffer.add_step_results(0, np.array(step0["rewards"])[:, None], np.array(step0["ends"]), np.zeros(4, dtype=bool),
                  np.array(step0["correct"]))
    buffer.add(StepRecord(step=1, envs=[0], agents=[0], prompt_ids=[[1]], action_ids=[[2]], rollout_log_probs=[[-1.0]],
                          group_ids=torch.tensor([0]), texts=["s"]))
    buffer.add_step_results(1, np.array([[0.5], [0.0], [0.0], [0.0]]), np.array([True, False, False, False]),
                  np.zeros(4, dtype=bool), np.array([1.0, nan, nan, nan]))
    grpo = make_algorithm("GRPO", AlgorithmConfig())
    targets = grpo.advantages(buffer)
    z = 0.5 / (math.sqrt(0.5) + 1e-4)  # returns (1, 0): mean 0.5, unbiased std sqrt(0.5)
    expected = torch.tensor([[z, -z, 0.0, 0.0], [z, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(targets.advantages[..., 0], expected)
    assert targets.keep is None and buffer.update_slots(targets).sum() == 5


def test_rloo_filters_groups_outside_the_accuracy_bounds():
    buffer = RolloutBuffer(1, 6, 1, 2)
    correct = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # groups: all right, mixed, all wrong
    buffer.add(StepRecord(step=0, envs=range(6), agents=[0] * 6, prompt_ids=[[1]] * 6, action_ids=[[2, 3]] * 6,
                          rollout_log_probs=[[-1.0, -1.0]] * 6,
                          group_ids=torch.tensor([0, 0, 1, 1, 2, 2]), texts=["s"] * 6))
    buffer.add_step_results(0, correct.numpy()[:, None], np.ones(6, dtype=bool), np.zeros(6, dtype=bool),
                            correct.numpy())
    rloo = make_algorithm("RLOO", AlgorithmConfig())
    targets = rloo.advantages(buffer)
    assert targets.keep[0, :, 0].tolist() == [False, False, True, True, False, False]
    assert buffer.live.all(), "the algorithm returns its filter; the buffer is left as collected"
    # returns +1 and -1 on two tokens each, standardised (--normalize_advantages): mean 0, unbiased std sqrt(4/3)
    scale = 1 / math.sqrt(4 / 3)
    torch.testing.assert_close(targets.advantages[0, 2:4, 0], torch.tensor([[scale, scale], [-scale, -scale]]))
    trained = [batch.index.tolist() for minibatch in buffer.minibatches(targets, 1, 1) for batch in minibatch]
    assert sorted(trained[0]) == [2, 3]


# ---------------------------------------------------------------------------------------------
# Slow: each algorithm raises the mean training reward on Arith
# ---------------------------------------------------------------------------------------------

def run_train_math(argv: list[str]):
    """Runs train_math.main in-process with ``argv`` flags; returns the run directory."""
    import train_math
    from train.flags import FLAGS

    FLAGS.unparse_flags()
    FLAGS(["train_math", *argv])
    try:
        train_math.main(["train_math"])
    finally:
        FLAGS.unparse_flags()
    return sorted(glob.glob(f"{argv[argv.index('--logdir') + 1]}/*/run_*"))[-1]


SLOW_ITERATIONS = 300
"""64 samples per iteration on the 1.1M tiny policy: the mean training reward of the first and the last
quarter (75 iterations, 4,800 samples each) then differ by 0.06-0.07 (2026-11-23, seed 0, rollouts
asynchronous as by default on a CPU: GRPO 0.160 -> 0.227, APPO 0.186 -> 0.254, TPPO 0.168 -> 0.235, RLOO
on the outcome stream 0.155 -> 0.225, RLOO with PRIME's both streams 0.188 -> 0.261), while a quarter's
mean has a standard error of ~0.012. Over 64 iterations the change was within noise."""

GRPO_SAMPLING = ["--temperature", "1.0", "--lr_schedule", "constant"]
"""The slow learning tests sample as GRPO commonly does (temperature 1.0; groups of 8 where an algorithm
compares samples within a group) at a constant lr: the settings their figures were measured with."""

SLOW_CASES = [
    pytest.param("GRPO", [], id="GRPO"),
    pytest.param("APPO", [], id="APPO"),
    pytest.param("TPPO", [], id="TPPO"),
    # RLOO's leave-one-out machinery on the verified outcome alone, every group kept
    pytest.param("RLOO", ["--process_coef", "0", "--accuracy_lower_bound", "0", "--accuracy_upper_bound", "1"],
                 id="RLOO-outcome"),
    # PRIME's defaults: both streams, the [0.2, 0.8] filter over 4x oversampled prompts (11 minutes)
    pytest.param("RLOO", [], id="RLOO-PRIME"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "settings"), SLOW_CASES)
def test_algorithm_raises_training_reward_on_arith(tiny_models, tmp_path, name, settings):
    oversample = 4 if name == "RLOO" else 1  # RLOO steps 4x the envs per iteration (--oversample_factor)
    groups = ["--group_size", "8"] if name in ("GRPO", "RLOO") else []
    run_dir = run_train_math(["--algorithm_name", name, "--model_name_or_path", str(tiny_models.policy),
                              "--eval_interval", "0", "--logdir", str(tmp_path), "--save_interval", "0",
                              *GRPO_SAMPLING, *groups,
                              "--n_rollout_threads", "64", "--num_env_steps", str(64 * oversample * SLOW_ITERATIONS),
                              *settings])
    rewards = [value for _, value in sorted(read_scalars(run_dir)["train/reward"])]
    window = len(rewards) // 4
    first, last = np.mean(rewards[:window]), np.mean(rewards[-window:])
    print(f"{name}: mean training reward {first:.3f} (first {window} iterations) -> {last:.3f} (last {window})")
    assert last > first + 0.04, f"{name} did not raise the training reward: {first:.3f} -> {last:.3f}"


@pytest.mark.slow
def test_prime_implicit_prm_learns_to_predict_outcomes(tiny_models, tmp_path):
    """PRIME's claim that an implicit PRM learns from outcome labels alone: each batch's held-out ROC-AUC
    over every sampled answer (its outcome score, beta * sum log(pi_psi / pi_ref), against the verified answers,
    of answers it has not trained on; ``--implicit_prm_heldout_all``). An uninformed score has AUC 0.5 (sd about
    0.04 on one batch of 256, 0.013 on the mean of ten). On the shipped build (the learning grid's rloo_prime, 128
    envs, seeds 0 and 1): 0.64 and 0.66 on average from the fourth to the 25th iteration, 0.65 and 0.70 over
    iterations 16-25."""
    run_dir = run_train_math(["--algorithm_name", "RLOO", "--model_name_or_path", str(tiny_models.policy),
                              "--eval_interval", "0", "--logdir", str(tmp_path), "--save_interval", "0",
                              *GRPO_SAMPLING, "--group_size", "8",
                              "--n_rollout_threads", "64", "--num_env_steps", str(64 * 4 * 25),
                              "--implicit_prm_heldout_all"])
    aucs = [value for _, value in sorted(read_scalars(run_dir)["implicit_prm/heldout_all_auc"])]
    late = float(np.mean(aucs[-10:]))
    print(f"implicit PRM held-out ROC-AUC: iteration 0 {aucs[0]:.3f}, mean of the last 10 {late:.3f}")
    assert late > 0.6, f"the implicit PRM did not learn to predict outcomes: held-out AUC {aucs}"


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["steps:1.0", "outcome:1.0,prm:0.2"])
def test_process_rewards_raise_held_out_accuracy(tiny_models, tmp_path, reward):
    """The process-reward claim (Math-Shepherd, OpenR): step rewards carry a learning signal that reaches
    the verified answer. Arith's exact step reward (the share of reference steps reproduced before the first
    mistake) alone, never the outcome, must lift held-out accuracy; the tiny PRM beside the outcome (the
    grid's grpo_outcome_prm row) must too, i.e. not be hacked. Alone, the tiny PRM was hacked on an earlier
    build: held-out accuracy went 0.303 -> 0.343 (iterations 50-100) -> 0.230 (250-300) while GRPO
    maximised its score."""
    prm = ["--prm_model_name_or_path", str(tiny_models.prm)] if "prm" in reward else []
    run_dir = run_train_math(["--model_name_or_path", str(tiny_models.policy), "--reward", reward, *prm,
                              "--logdir", str(tmp_path), *GRPO_SAMPLING, "--group_size", "8",
                              "--n_rollout_threads", "64", "--num_env_steps", str(64 * 150),
                              "--eval_interval", "25", "--eval_limit", "300", "--save_interval", "0"])
    accuracy = [value for _, value in sorted(read_scalars(run_dir)["eval/accuracy"])]
    start, late = accuracy[0], float(np.mean(accuracy[-3:]))
    print(f"{reward}: held-out accuracy {start:.3f} -> {late:.3f} (mean of the last 3 evals): {accuracy}")
    assert late > start + 0.04, f"GRPO on {reward} did not raise held-out accuracy: {accuracy}"


def test_the_progress_bar_shows_each_roles_reward_not_their_sum():
    """A multi-agent episode's return adds every role's rewards: the bar shows each role's own instead."""
    stats = {"train/reward": 1.5, "train/accuracy": 0.5, "train/solver/reward": 1.0, "train/verifier/reward": 0.5}
    assert bar_summary(stats, ["solver", "verifier"]) == {"solver_reward": "1.000", "verifier_reward": "0.500",
                                                          "train_acc": "0.500"}
    assert bar_summary(stats, None) == {"reward": "1.500", "train_acc": "0.500"}


@pytest.fixture(scope="module")
def tiny_solvers():
    """The shipped tiny policy and target (the ``tiny_models`` fixture's, the team model not required)."""
    return shipped_models(team=False)


@pytest.mark.slow  # the trained tiny policy and target: a target that solves is the point
def test_prefix_rl_by_handoff_steps_evaluates_the_target_finishing_the_prefix(tiny_solvers, tmp_path):
    """--handoff_steps 1 with a 6-token prefix: the policy's prefix alone never holds the answer, the
    frozen target finishes it. Held-out accuracy is the target's verdict on the finished solution (what
    the reward pays), not the prefix's own (0.000 at every evaluation), so best/ is saved for it."""
    run_dir = run_train_math(["--model_name_or_path", str(tiny_solvers.policy), "--handoff_steps", "1",
                              "--reward", "target", "--target_model_name_or_path", str(tiny_solvers.target),
                              "--max_new_tokens", "6", "--logdir", str(tmp_path), "--noasync_rollouts",
                              "--n_rollout_threads", "8", "--num_env_steps", "8", "--eval_limit", "32",
                              "--eval_batch_size", "32", "--eval_interval", "1", "--save_interval", "0"])
    accuracy = [value for _, value in sorted(read_scalars(run_dir)["eval/accuracy"])]
    assert len(accuracy) == 2 and min(accuracy) > 0.1, accuracy
    assert (Path(run_dir) / "best").is_dir()
