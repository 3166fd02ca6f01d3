import json

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import envs  # noqa: F401  (registers the env ids)
from envs.contract import FACTS, Agents
from envs.datasets import Arith
from envs.math_env import MathEnv
from envs.prompts import split_steps
from envs.vector import MathVectorEnv
from test_env import StepLengthReward

PROBLEMS = Arith().problems(40, seed=1)
BY_ID = {p.id: p for p in PROBLEMS}


def test_groups_share_problems_and_ids():
    env = MathVectorEnv(num_envs=8, group_size=4, problems=PROBLEMS)
    _, info = env.reset(seed=0)
    assert len(set(info["problem_id"][:4])) == 1 and len(set(info["problem_id"][4:])) == 1
    assert info["problem_id"][0] != info["problem_id"][4]
    assert list(info["group_id"]) == [0, 0, 0, 0, 1, 1, 1, 1]
    # members finish at different times; each member's next episode is still the group's next problem
    env.step(["The answer is \\boxed{0}."] + ["thinking"] * 7)      # env 0 ends
    _, _, _, _, info = env.step(["resetting"] + ["The answer is \\boxed{0}."] * 7)
    assert info["group_id"][0] == 2 and info["step"][0] == 0        # env 0 reset into group 0's 2nd problem
    _, _, _, _, info = env.step(["a"] + ["resetting"] * 7)
    assert list(info["group_id"]) == [2, 2, 2, 2, 3, 3, 3, 3]
    assert len(set(info["problem_id"][:4])) == 1 and len(set(info["problem_id"][4:])) == 1


def test_one_reward_call_per_step_for_all_acting_envs():
    reward = StepLengthReward()
    env = MathVectorEnv(num_envs=16, group_size=4, problems=PROBLEMS, reward_model=reward)
    env.reset(seed=0)
    _, rewards, *_ = env.step(["x" * k for k in range(16)])
    assert reward.batch_sizes == [16]
    np.testing.assert_allclose(rewards, np.arange(16) / 100)


def test_rewards_match_sync_vector_env_over_math_env():
    """The batched env pays exactly what gymnasium's SyncVectorEnv over MathEnv pays."""
    n = 8
    batched = MathVectorEnv(num_envs=n, problems=PROBLEMS)
    _, info = batched.reset(seed=0)
    ids = list(info["problem_id"])
    sync = SyncVectorEnv([lambda: MathEnv(problems=PROBLEMS) for _ in range(n)])
    sync.reset()
    for env, problem_id in zip(sync.envs, ids):
        env.reset(options={"problem_id": problem_id})
    totals = {"batched": np.zeros(n), "sync": np.zeros(n)}
    for t in range(5):
        # even envs follow the reference solution, odd envs give a wrong answer first; then both think
        steps = [split_steps(BY_ID[problem_id].solution) for problem_id in ids]
        actions = [
            (steps[i][t] if t < len(steps[i]) else "thinking") if i % 2 == 0
            else ("The answer is \\boxed{x}." if t == 0 else "thinking")
            for i in range(n)
        ]
        for name, env in (("batched", batched), ("sync", sync)):
            totals[name] += env.step(actions)[1]
    np.testing.assert_array_equal(totals["batched"], totals["sync"])
    np.testing.assert_array_equal(totals["batched"], [1.0, 0.0] * (n // 2))


def test_next_step_autoreset_ignores_action():
    env = MathVectorEnv(num_envs=2, problems=PROBLEMS)
    obs0, info = env.reset(seed=0)
    _, rewards, terminated, _, _ = env.step(["The answer is \\boxed{1}.", "step"])
    assert terminated.tolist() == [True, False]
    obs, rewards, terminated, truncated, info = env.step(["ignored", "step"])
    assert rewards[0] == 0.0 and not terminated[0] and not truncated[0] and info["step"][0] == 0
    assert obs[0].endswith("Solution:\n") and obs[1].endswith("step\n\nstep\n\n")


def test_same_step_autoreset_returns_final_obs():
    env = MathVectorEnv(num_envs=2, problems=PROBLEMS, autoreset_mode=AutoresetMode.SAME_STEP)
    _, info = env.reset(seed=0)
    ended_id, answer = info["problem_id"][0], f"The answer is \\boxed{{{BY_ID[info['problem_id'][0]].answer}}}."
    obs, rewards, terminated, _, info = env.step([answer, "step"])
    assert terminated.tolist() == [True, False] and rewards.tolist() == [1.0, 0.0]
    assert info["_final_obs"].tolist() == [True, False] and info["_final_info"].tolist() == [True, False]
    assert info["final_obs"][0].endswith(answer + "\n\n") and info["final_obs"][1] is None
    # the ended episode's metadata in final_info; the action's results at the top level
    assert info["final_info"]["problem_id"][0] == ended_id and info["final_info"]["step"][0] == 1
    np.testing.assert_array_equal(info["correct"], [1.0, np.nan])
    np.testing.assert_array_equal(info["reward/outcome"], [1.0, 0.0])
    assert obs[0].endswith("Solution:\n") and info["step"].tolist() == [0, 1]
    assert info["group_id"][0] == 2 and info["final_info"]["group_id"][0] == 0


def test_infos_are_full_arrays_of_the_action_just_taken():
    reward = StepLengthReward()
    env = MathVectorEnv(num_envs=3, problems=PROBLEMS, reward_model=reward, max_step_chars=40)
    _, info = env.reset(seed=0)
    assert sorted(info) == [FACTS, "group_id", "problem_id", "step"]
    assert info[FACTS].acting.tolist() == [[True]] * 3 and info[FACTS].rewards.tolist() == [[0.0]] * 3
    answer = f"The answer is \\boxed{{{BY_ID[info['problem_id'][1]].answer}}}."
    _, rewards, terminated, _, info = env.step(["x" * 50, answer, "ab"])
    facts = info.pop(FACTS)
    assert sorted(info) == ["action_clipped", "correct", "final_answer", "group_id", "problem_id", "reward/length",
                            "step"]
    assert all(isinstance(v, np.ndarray) and v.shape == (3,) for v in info.values())
    assert info["problem_id"].dtype == object and info["group_id"].dtype == info["step"].dtype == np.int64
    expected = [0.40, len(answer) / 100, 0.02]  # the 50 x's are clipped to 40
    np.testing.assert_allclose(rewards, expected)
    np.testing.assert_allclose(info["reward/length"], expected)
    np.testing.assert_array_equal(info["correct"], [np.nan, 1.0, np.nan])
    assert info["final_answer"].tolist() == [None, BY_ID[info["problem_id"][1]].answer, None]  # the ended one's
    assert info["action_clipped"].tolist() == [True, False, False] and terminated.tolist() == [False, True, False]
    # the trainer's view of the same step: one agent slot
    np.testing.assert_array_equal(facts.rewards, np.array(expected)[:, None])
    np.testing.assert_array_equal(facts.return_so_far, facts.rewards)  # every episode's first step
    np.testing.assert_array_equal(facts.sources["length"], np.array(expected)[:, None])
    np.testing.assert_array_equal(facts.correct, info["correct"])
    assert facts.clipped[:, 0].tolist() == [True, False, False] and facts.acting[:, 0].tolist() == [True, False, True]
    assert facts.group_ids.tolist() == info["group_id"].tolist() and env.agents == Agents()
    # NEXT_STEP: env 1 resets and ignores its action, so it has no result this step
    _, rewards, _, _, info = env.step(["a", "ignored", "The answer is \\boxed{-1}."])
    np.testing.assert_allclose(info["reward/length"], [0.01, np.nan, len("The answer is \\boxed{-1}.") / 100])
    np.testing.assert_array_equal(info["correct"], [np.nan, np.nan, 0.0])
    assert rewards[1] == 0.0 and info["step"].tolist() == [2, 0, 2] and not info["action_clipped"].any()
    assert info[FACTS].acting[:, 0].tolist() == [True, True, False]
    np.testing.assert_allclose(info[FACTS].return_so_far[:, 0],
                               [0.41, 0.0, 0.02 + len("The answer is \\boxed{-1}.") / 100])


def test_draws_without_replacement_per_epoch_and_reproducible():
    env = MathVectorEnv(num_envs=4, group_size=2, problems=PROBLEMS[:10])

    def drawn(seed):
        _, info = env.reset(seed=seed)
        ids = list(info["problem_id"][::2])
        for _ in range(4):  # every step ends every episode -> next step resets into new problems
            env.step(["The answer is \\boxed{0}."] * 4)
            _, _, _, _, info = env.step(["reset"] * 4)
            ids += list(info["problem_id"][::2])
        return ids

    first = drawn(seed=5)
    assert sorted(first) == sorted(p.id for p in PROBLEMS[:10])
    assert first == drawn(seed=5) and first != drawn(seed=6)


def test_reset_with_problem_ids_and_errors():
    env = MathVectorEnv(num_envs=4, group_size=2, problems=PROBLEMS)
    _, info = env.reset(options={"problem_ids": [PROBLEMS[3].id, PROBLEMS[4].id]})
    assert list(info["problem_id"]) == [PROBLEMS[3].id] * 2 + [PROBLEMS[4].id] * 2
    with pytest.raises(ValueError, match="one per group"):
        env.reset(options={"problem_ids": [PROBLEMS[3].id]})
    with pytest.raises(ValueError, match="group_size=3 must be >= 1 and divide num_envs=4"):
        MathVectorEnv(num_envs=4, group_size=3, problems=PROBLEMS)
    with pytest.raises(ValueError, match="got 3 actions for 4 envs"):
        env.step(["a"] * 3)


def test_token_mode_batches_only_completed_steps(tiny_tokenizer):
    reward = StepLengthReward()
    env = MathVectorEnv(num_envs=4, problems=PROBLEMS, mode="token", tokenizer=tiny_tokenizer, reward_model=reward)
    env.reset(seed=0)
    digit = tiny_tokenizer.convert_tokens_to_ids("1")
    delimiter = tiny_tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    assert len(delimiter) == 1
    env.step(np.array([digit] * 4))
    _, rewards, _, _, info = env.step(np.array([delimiter[0], digit, delimiter[0], digit]))
    assert reward.batch_sizes == [2] and rewards.tolist() == [0.01, 0.0, 0.01, 0.0]
    assert info["step"].tolist() == [1, 0, 1, 0] and "action_clipped" not in info
    np.testing.assert_array_equal(info["reward/length"], [0.01, np.nan, 0.01, np.nan])
    np.testing.assert_array_equal(info["correct"], np.nan)


def test_make_vec_uses_the_batched_env():
    env = gymnasium.make_vec("Arith-v0", num_envs=64, vectorization_mode="vector_entry_point", group_size=8)
    assert isinstance(env.unwrapped, MathVectorEnv) and env.num_envs == 64
    obs, info = env.reset(seed=0)
    assert len(obs) == 64 and len(set(info["problem_id"])) == 8


def test_user_registers_own_dataset(tmp_path):
    """The README's 'register your own env' snippet, verbatim in spirit: 10 lines."""
    path = tmp_path / "my_problems.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"What is {k} squared?", "final_answer": str(k * k)})
                              for k in range(1, 6)))
    gymnasium.register(
        id="MyMath-v0",
        entry_point="envs.math_env:MathEnv",
        vector_entry_point="envs.vector:MathVectorEnv",
        kwargs={"dataset_path": str(path), "max_steps": 4},
    )
    env = gymnasium.make("MyMath-v0")
    obs, info = env.reset(seed=0)
    k = int(obs.split("What is ")[1].split(" ")[0])
    _, reward, terminated, _, _ = env.step(f"So it is \\boxed{{{k * k}}}.")
    assert reward == 1.0 and terminated
    vec = gymnasium.make_vec("MyMath-v0", num_envs=4, vectorization_mode="vector_entry_point")
    assert isinstance(vec.unwrapped, MathVectorEnv)


def test_disabled_autoreset_keeps_one_episode_per_env_until_reset():
    env = MathVectorEnv(num_envs=4, group_size=2, problems=PROBLEMS, autoreset_mode=AutoresetMode.DISABLED)
    obs, info = env.reset(seed=0)
    first_ids = list(info["problem_id"])
    env.step(["The answer is \\boxed{1}."] * 2 + ["step"] * 2)
    obs, rewards, terminated, truncated, info = env.step(["ignored"] * 2 + ["The answer is \\boxed{1}."] * 2)
    assert rewards[:2].tolist() == [0.0, 0.0] and not terminated[:2].any() and terminated[2:].all()
    assert list(info["problem_id"]) == first_ids and obs[0].endswith("\\boxed{1}.\n\n")
    assert np.isnan(info["reward/outcome"][:2]).all() and not np.isnan(info["correct"][2:]).any()
    _, info = env.reset(options={"reset_mask": np.array([True, True, False, False])})
    assert info["step"].tolist() == [0, 0, 2, 2] and info["group_id"].tolist() == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="whole groups"):
        env.reset(options={"reset_mask": np.array([True, False, False, False])})


def test_an_episode_saved_by_an_older_build_resumes_with_its_return():
    """A state saved before ``Episode.return_so_far`` names the return ``paid``: it resumes with that return, and
    the next step's reward adds to it."""
    env = MathVectorEnv(num_envs=2, group_size=1, problems=PROBLEMS, max_steps=3)
    env.reset(seed=0)
    problem = env.episodes[1].problem
    state = env.get_state()
    state["episodes"][1] = {"group_id": 1, "steps": ["thinking"], "solution_ids": [], "step_start": 0,
                            "completed_text": "", "solution_text": "thinking\n\n", "done": False, "paid": 0.25,
                            "tool_calls": 0, "tool_start": 0, "problem_id": problem.id}
    env.set_state(json.loads(json.dumps(state)))
    assert env.episodes[1].return_so_far == 0.25 and env.episodes[1].steps == ["thinking"]
    _, rewards, terminated, _, info = env.step(["more", f"The answer is \\boxed{{{problem.answer}}}."])
    assert terminated[1] and rewards[1] == 1.0
    assert info[FACTS].return_so_far[1, 0] == 1.25
