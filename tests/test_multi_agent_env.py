"""The multi-agent env driven by scripted messages (no language model): turn order, verdicts, the
final answer, credit as hand-computed [N, A] arrays, problem draws, state, registration, hostile input."""

import json

import gymnasium
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from envs.datasets import Arith, Problem
from envs.math_env import MathTask
from envs.contract import FACTS
from envs.multi_agent import MultiAgentMathEnv, MultiAgentMathVectorEnv, register_builtin
from envs.prompts import format_prompt
from envs.vector import MathVectorEnv
from envs.workflows import (ACCEPT, REJECT, VERIFIER_INSTRUCTIONS, Role, Workflow, chain, debate, parse_verdict,
                            prefix)

PROBLEMS = Arith().problems(40, seed=1)
BY_ID = {p.id: p for p in PROBLEMS}
WRONG = "The answer is \\boxed{-1000}."  # no two-digit +/- problem has this answer
HALF = [Problem("half", "What is one half?", "\\frac{1}{2}")]
DISABLED = AutoresetMode.DISABLED


def right(problem_id):
    return BY_ID[problem_id].solution  # the reference steps, ending "The answer is \boxed{...}."


def act(env, info, say):
    """Actions [N][A]: ``say(env index, role name, problem id)`` for every acting slot, "" elsewhere."""
    return [[say(i, env.roles[slot], info["problem_id"][i]) if info["acting"][i, slot] else ""
             for slot in range(env.num_agents)] for i in range(env.num_envs)]


def scripted(scripts):
    """A ``say`` that gives env i the next of scripts[i], cyclically (a callable of the problem id, or text)."""
    turns = {}

    def say(i, role, problem_id):
        turn = turns[i] = turns.get(i, -1) + 1
        message = scripts[i][turn % len(scripts[i])]
        return message(problem_id) if callable(message) else message
    return say


def chain_env(num_envs=4, verdict_by="line", **kwargs):
    return MultiAgentMathVectorEnv(num_envs=num_envs, problems=PROBLEMS, autoreset_mode=DISABLED,
                                   workflow=chain(verdict_by), **kwargs)


@pytest.mark.parametrize("text, verdict", [
    ("Looks right.\nVerdict: correct", True), ("verdict :  WRONG.  \n\n", False), (ACCEPT, True), (REJECT, False),
    ("Verdict: correct\nOn second thought, no.", None), ("Verdict: correctly", None), ("I think it is wrong", None),
    ("x" * 1_000_000 + "\nVerdict: correct", True), ("Verdict: correct " + "x" * 1_000_000, None),
])
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) is verdict


def test_first_prompt_is_the_single_agent_prompt_and_chain_ends_after_acceptance():
    env = chain_env(num_envs=1)
    obs, info = env.reset(seed=0)
    problem = BY_ID[info["problem_id"][0]]
    assert obs == ((MathTask(problems=PROBLEMS).prompt(problem), "", ""),)
    assert info["roles"] == ("solver", "verifier", "refiner") and info["acting"].tolist() == [[True, False, False]]
    obs, rewards, terminated, _, info = env.step([[right(problem.id), "", ""]])
    assert info["acting"].tolist() == [[False, True, False]] and info["turn"].tolist() == [1]
    assert obs[0][1] == (f"[solver]\n{problem.solution}\n\n{VERIFIER_INSTRUCTIONS['line']}\n\n"
                          + format_prompt(problem.problem))
    assert rewards.tolist() == [[0, 0, 0]] and not terminated[0] and np.isnan(info["correct"][0])
    obs, rewards, terminated, truncated, info = env.step([["", "Checked.\nVerdict: correct", ""]])
    assert terminated.tolist() == [True] and truncated.tolist() == [False] and obs == (("", "", ""),)
    assert info["final_answer"][0] == problem.answer and info["correct"].tolist() == [1.0]
    np.testing.assert_array_equal(info["verdict"], [[np.nan, 1, np.nan]])
    assert rewards.tolist() == [[1, 1, 0]] and not info["acting"].any()


@pytest.mark.parametrize("text, judged_answer, verdict", [
    ("1 + 2 = 3\nThe answer is \\boxed{3}.", "3", True), ("\\boxed{4}", "3", False), ("Looks right.", "3", None),
    (ACCEPT, "3", None), ("\\boxed{0.5}", "\\frac{1}{2}", True), ("\\boxed{ 3 }", "3.0", True),
    ("\\boxed{\\sqrt{4}}", "2", False), ("\\boxed{3}", None, False),
    ("\\boxed{" + "9" * 1_000_000 + "}", "3", False), ("x" * 1_000_000 + "\\boxed{3}", "3", True),
])
def test_a_verifier_that_solves_again_accepts_exactly_an_agreeing_answer(text, judged_answer, verdict):
    verifier = chain().roles[1]
    assert verifier.verdict_by == "solving" and verifier.verdict(text, judged_answer) is verdict


def test_the_default_chain_verifier_solves_again_and_the_refiner_reads_both_solutions():
    env = chain_env(num_envs=2, verdict_by="solving")
    obs, info = env.reset(seed=0)
    problem = BY_ID[info["problem_id"][0]]
    say = scripted([[right, right], [WRONG, right, right]])
    obs, _, terminated, _, info = env.step(act(env, info, say))
    assert obs[0][1] == (f"[solver]\n{problem.solution}\n\n{VERIFIER_INSTRUCTIONS['solving']}\n\n"
                         + format_prompt(problem.problem))
    obs, _, terminated, _, info = env.step(act(env, info, say))
    assert terminated.tolist() == [True, False] and info["verdict"][:, 1].tolist() == [1, 0]
    assert info["verdict_correct"][:, 1].tolist() == [1, 1] and info["final_answer"][0] == problem.answer
    second = BY_ID[info["problem_id"][1]]
    assert obs[1][2].startswith(f"[solver]\n{WRONG}\n\n[verifier]\n{second.solution}\n\nRefiner:")
    _, _, terminated, _, info = env.step(act(env, info, say))
    assert terminated.tolist() == [False, True] and info["correct"][1] == 1


def test_rejection_hands_over_to_the_refiner_whose_answer_is_final():
    env = chain_env(num_envs=2)
    _, info = env.reset(seed=0)
    say = scripted([[right, REJECT, WRONG], [WRONG, "The second step is off.", right]])  # 2nd: unparseable verdict
    *_, info = env.step(act(env, info, say))
    obs, _, terminated, _, info = env.step(act(env, info, say))
    assert not terminated.any() and info["acting"].tolist() == [[False, False, True]] * 2
    assert info["verdict"][:, 1].tolist() == [0.0, 0.0] and info["verdict_correct"][:, 1].tolist() == [0.0, 1.0]
    assert obs[1][2].count("[solver]\n" + WRONG) == 1 and "[verifier]\nThe second step is off." in obs[1][2]
    _, _, terminated, _, info = env.step(act(env, info, say))
    assert terminated.tolist() == [True, True] and info["correct"].tolist() == [0.0, 1.0]
    assert info["final_answer"].tolist() == ["-1000", BY_ID[info["problem_id"][1]].answer]


# env 0: right, accepted. env 1: right, wrongly rejected, the refiner breaks it. env 2: wrong, an unparseable
# verdict (a rejection), the refiner fixes it. env 3: wrong, wrongly accepted. A verifier that solves again
# accepts by reaching the solver's answer and rejects by reaching another; without an answer it is unparseable.
CASES = {"line": [[right, ACCEPT], [right, REJECT, WRONG], [WRONG, "Hmm, not sure.", right], [WRONG, ACCEPT]],
         "solving": [[right, right], [right, WRONG, WRONG], [WRONG, "Hmm, not sure.", right], [WRONG, WRONG]]}
CREDIT = {  # rewards [N, A] at each of the three steps
    "team": [np.zeros((4, 3)), [[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
             [[0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]],
    "individual": [[[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]], [[0, 1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0]],
                   [[0, 0, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0]]],
    # env 1's verifier: 0 - 1 (accepting would have kept the right answer); its refiner: 0 - 1 (keeping it too);
    # env 0's solver: 1 - 0 (no answer, accepted, fails); env 2's verifier and refiner: 1 - 0
    "counterfactual": [np.zeros((4, 3)), [[1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
                       [[0, 0, 0], [0, -1, -1], [0, 1, 1], [0, 0, 0]]],
}


@pytest.mark.parametrize("verdict_by", sorted(CASES))
def test_chain_role_rates_split_verdicts_and_revisions_by_the_truth(verdict_by):
    env = chain_env(verdict_by=verdict_by, reward_assignment="individual")
    _, info = env.reset(seed=0)
    say, infos = scripted(CASES[verdict_by]), []
    for _ in range(3):
        *_, info = env.step(act(env, info, say))
        infos.append(info)
    nan = np.nan
    # step 2, the verifiers: accepted envs 0 (right) and 3 (wrong); rejected 1 (right) and 2 (wrong)
    np.testing.assert_array_equal(infos[1]["verdict_precision"][:, 1], [1, nan, nan, 0])
    np.testing.assert_array_equal(infos[1]["verdict_recall"][:, 1], [1, 0, nan, nan])
    np.testing.assert_array_equal(infos[1]["verdict_specificity"][:, 1], [nan, nan, 1, 0])
    # step 3, the refiners: env 1 broke a right solution, env 2 fixed a wrong one
    np.testing.assert_array_equal(infos[2]["keep_rate"][:, 2], [nan, 0, nan, nan])
    np.testing.assert_array_equal(infos[2]["fix_rate"][:, 2], [nan, nan, 1, nan])
    for key in ("verdict_precision", "verdict_recall", "verdict_specificity", "fix_rate", "keep_rate"):
        assert np.isnan(infos[0][key]).all()  # the solvers revise nothing and judge nothing
        assert np.isnan(np.delete(infos[1][key], 1, axis=1)).all()
        assert np.isnan(np.delete(infos[2][key], 2, axis=1)).all()


@pytest.mark.parametrize("verdict_by", sorted(CASES))
@pytest.mark.parametrize("assignment", sorted(CREDIT))
def test_chain_credit(assignment, verdict_by):
    env = chain_env(verdict_by=verdict_by, reward_assignment=assignment)
    _, info = env.reset(seed=0)
    say, ends = scripted(CASES[verdict_by]), []
    for expected in CREDIT[assignment]:
        _, rewards, terminated, truncated, info = env.step(act(env, info, say))
        assert rewards.dtype == np.float64 and rewards.shape == (4, 3)
        np.testing.assert_array_equal(rewards, expected)
        ends.append((terminated | truncated).tolist())
    assert ends == [[False] * 4, [True, False, False, True], [False, True, True, False]]
    np.testing.assert_array_equal(info["correct"], [np.nan, 0, 1, np.nan])


def test_debate_votes_over_equivalent_answers_written_differently():
    env = MultiAgentMathVectorEnv(num_envs=1, problems=HALF, workflow=debate(), autoreset_mode=DISABLED,
                                  reward_assignment="counterfactual")
    obs, info = env.reset(seed=0)
    assert info["acting"].tolist() == [[True] * 3] and obs[0] == (format_prompt("What is one half?"),) * 3
    obs, rewards, *_, info = env.step([["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"]])
    assert info["acting"].tolist() == [[True] * 3] and rewards.tolist() == [[0, 0, 0]]
    assert "[debater_1]\n\\boxed{2}" in obs[0][0] and "[debater_2]\n\\boxed{3}" in obs[0][0]
    assert "[debater_0]" not in obs[0][0] and "Debater 0:" in obs[0][0]
    _, rewards, terminated, _, info = env.step([["\\boxed{0.5}", "\\boxed{3}", "\\boxed{\\frac{1}{2}}"]])
    assert terminated.tolist() == [True] and info["final_answer"].tolist() == ["0.5"] and info["correct"][0] == 1
    assert info["answer_correct"].tolist() == [[1, 0, 1]]
    assert info["agrees_with_vote"].tolist() == [[1, 0, 1]]  # 0.5 and \frac{1}{2} outvote 3
    # without debater_0 the vote ties 3 against \frac{1}{2} and the earlier slot's 3 wins; without either
    # other debater 0.5 still wins
    assert rewards.tolist() == [[1, 0, 0]]


@pytest.mark.parametrize("last_round, final, correct, credit", [
    (["\\boxed{3}", "\\boxed{0.5}", "no idea"], "3", 0.0, [[-1, 0, 0]]),
    (["\\boxed{0.5}", "\\boxed{3}", "no idea"], "0.5", 1.0, [[1, 0, 0]]),
])
def test_debate_tie_goes_to_the_lowest_slot(last_round, final, correct, credit):
    env = MultiAgentMathVectorEnv(num_envs=1, problems=HALF, workflow="debate", autoreset_mode=DISABLED,
                                  reward_assignment="counterfactual")
    env.reset(seed=0)
    _, _, _, _, info = env.step([["a", "b", "c"]])
    assert np.isnan(info["agrees_with_vote"]).all()  # no vote before the episode ends
    _, rewards, _, _, info = env.step([last_round])
    assert info["final_answer"].tolist() == [final] and info["correct"].tolist() == [correct]
    assert rewards.tolist() == credit
    assert info["agrees_with_vote"].tolist() == [[1, 0, 0]]  # the winner; the tie's loser; no answer


def test_debaters_saying_one_answer_all_agree_with_the_vote_and_a_chain_has_no_vote():
    env = MultiAgentMathVectorEnv(num_envs=2, problems=HALF, workflow="debate", autoreset_mode=DISABLED)
    env.reset(seed=0)
    env.step([["a", "b", "c"]] * 2)
    _, _, _, _, info = env.step([["\\boxed{7}", "so \\boxed{7}", "\\boxed{7.0}"], ["none", "none", "none"]])
    assert info["agrees_with_vote"].tolist() == [[1, 1, 1], [0, 0, 0]]
    chain_env = MultiAgentMathVectorEnv(num_envs=1, problems=HALF, workflow="chain", autoreset_mode=DISABLED)
    chain_env.reset(seed=0)
    chain_env.step([["\\boxed{0.5}", "", ""]])
    _, _, terminated, _, info = chain_env.step([["", "\\boxed{0.5}", ""]])  # the verifier agrees: the chain ends
    assert terminated.tolist() == [True] and np.isnan(info["agrees_with_vote"]).all()


@pytest.mark.parametrize("rollout_mode", ["tree", "independent"])
def test_tree_rollouts_continue_a_group_from_its_best_episode(rollout_mode):
    """Two groups of two debates: in the first, the second debate's round earns the most; in the second, a tie
    goes to the first. Under tree rollouts every debate of a group then holds the same transcript (its second
    round's prompts one), each keeping its own return."""
    env = MultiAgentMathVectorEnv(num_envs=4, group_size=2, problems=HALF, workflow="debate", autoreset_mode=DISABLED,
                                  reward_assignment="individual", rollout_mode=rollout_mode)
    env.reset(seed=0)
    first_round = [["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"], ["\\boxed{0.5}", "\\boxed{3}", "\\boxed{0.5}"],
                   ["\\boxed{4}", "no idea", "\\boxed{5}"], ["\\boxed{6}", "\\boxed{7}", "no idea"]]
    obs, rewards, _, _, info = env.step(first_round)
    assert rewards.tolist() == [[0, 0, 0], [1, 0, 1], [0, 0, 0], [0, 0, 0]]
    said = [[m.text for m in dialogue.transcript] for dialogue in env.dialogues]
    if rollout_mode == "tree":
        assert said == [first_round[1], first_round[1], first_round[2], first_round[2]]
        assert obs[0] == obs[1] and obs[2] == obs[3] and obs[0] != obs[2]
    else:
        assert said == first_round and len(set(obs)) == 4
    np.testing.assert_array_equal([d.return_so_far for d in env.dialogues], rewards)  # each its own
    _, rewards, terminated, _, info = env.step([["\\boxed{0.5}"] * 3] * 4)
    assert terminated.all() and info["correct"].tolist() == [1, 1, 1, 1]
    assert [d.return_so_far.tolist() for d in env.dialogues] == [[1, 1, 1], [2, 1, 2], [1, 1, 1], [1, 1, 1]]


def test_prefix_solver_continues_the_prefix():
    assert [r.trainable for r in prefix().roles] == [True, False] and prefix(co_train=True).roles[1].trainable
    env = MultiAgentMathVectorEnv(num_envs=2, problems=PROBLEMS, workflow="prefix", autoreset_mode=DISABLED,
                                  reward_assignment="individual")
    obs, info = env.reset(seed=0)
    problems = [BY_ID[i] for i in info["problem_id"]]
    first_steps = [p.solution.split("\n\n")[0] for p in problems]
    cut = first_steps[0][:-2]  # a prefix cut mid-step by its token budget is continued mid-step
    obs, *_ = env.step([[cut, ""], [problems[1].solution, ""]])  # env 1's writer already answers
    assert obs[0] == ("", format_prompt(problems[0].problem) + cut)
    rest = first_steps[0][-2:] + "\n\n" + problems[0].solution.split("\n\n", 1)[1]
    _, rewards, terminated, _, info = env.step([["", rest], ["", "I agree."]])
    assert terminated.all() and info["correct"].tolist() == [1, 1]
    assert rewards.tolist() == [[1, 1], [1, 1]]  # the writer is paid the solver's verified answer
    obs, info = env.reset(seed=1)
    obs, *_ = env.step([["", ""], ["", ""]])  # an empty prefix: the solver reads the single-agent prompt
    assert [o[1] for o in obs] == [format_prompt(BY_ID[i].problem) for i in info["problem_id"]]


def test_same_step_autoreset_and_truncation():
    env = MultiAgentMathVectorEnv(num_envs=2, problems=PROBLEMS, max_steps=2)
    _, info = env.reset(seed=0)
    first_ids = list(info["problem_id"])
    say = scripted([[right, right], [WRONG, right]])  # the default chain's verifier solves again
    *_, info = env.step(act(env, info, say))
    obs, _, terminated, truncated, info = env.step(act(env, info, say))
    assert terminated.tolist() == [True, False] and truncated.tolist() == [False, True]  # 2 turns: no refiner
    assert info["correct"].tolist() == [1, 0] and info["final_answer"][1] == "-1000"
    assert info["_final_obs"].tolist() == [True, True] and info["final_obs"][0] == ("", "", "")
    assert info["final_obs"][1][2].endswith("Solution:\n") and info["final_obs"][1][:2] == ("", "")
    assert list(info["final_info"]["problem_id"]) == first_ids
    assert info["acting"].tolist() == [[True, False, False]] * 2 and info["turn"].tolist() == [0, 0]
    assert list(info["group_id"]) == [2, 3] and obs[0][0] == format_prompt(BY_ID[info["problem_id"][0]].problem)


def test_groups_draw_the_problems_math_vector_env_draws():
    multi = MultiAgentMathVectorEnv(num_envs=6, group_size=3, problems=PROBLEMS)
    single = MathVectorEnv(num_envs=6, group_size=3, problems=PROBLEMS, autoreset_mode=AutoresetMode.SAME_STEP)
    _, info = multi.reset(seed=7)
    _, reference = single.reset(seed=7)
    assert list(info["problem_id"]) == list(reference["problem_id"]) and len(set(info["problem_id"][:3])) == 1
    assert list(info["group_id"]) == list(reference["group_id"]) == [0, 0, 0, 1, 1, 1]
    shard = MultiAgentMathVectorEnv(num_envs=3, group_size=3, group_offset=1, total_groups=2, problems=PROBLEMS)
    _, shard_info = shard.reset(seed=7)
    assert list(shard_info["problem_id"]) == list(reference["problem_id"][3:]) and set(shard_info["group_id"]) == {1}
    # env 0 finishes first; its next problem is its group's next draw in both envs
    _, _, _, _, reference = single.step(["The answer is \\boxed{0}."] + ["thinking"] * 5)
    say = scripted([[right, right]] + [[WRONG, right]] * 5)
    for _ in range(2):
        _, _, _, _, info = multi.step(act(multi, info, say))
    assert (info["problem_id"][0], info["group_id"][0]) == (reference["problem_id"][0], reference["group_id"][0])


def test_state_round_trip_mid_episode_gives_identical_next_steps():
    def build():
        return MultiAgentMathVectorEnv(num_envs=4, group_size=2, problems=PROBLEMS, reward_assignment="counterfactual")
    env, twin = build(), build()
    _, info = env.reset(seed=3)
    say = scripted([[right, right]] * 2 + [[WRONG, right, right, right, right]] * 2)
    *_, info = env.step(act(env, info, say))
    obs, _, _, _, info = env.step(act(env, info, say))  # envs 0 and 1 restarted, 2 and 3 at the refiner
    assert info["acting"][:, 0].tolist() == [True, True, False, False] and info["acting"][2:, 2].all()
    state = json.loads(json.dumps(env.get_state()))
    twin_obs, twin_info = twin.set_state(state)
    assert twin_obs == obs and twin_info["acting"].tolist() == info["acting"].tolist()
    for _ in range(3):
        actions = act(env, info, say)
        expected, got = env.step(actions), twin.step(actions)
        info = expected[-1]
        for a, b in zip(expected, got):
            np.testing.assert_equal(a, b)
    with pytest.raises(ValueError, match="workflow 'chain'.*restore it into an env of the same workflow"):
        MultiAgentMathVectorEnv(num_envs=4, group_size=2, problems=PROBLEMS, workflow="debate").set_state(state)


def test_split_and_merge_states():
    env = MultiAgentMathVectorEnv(num_envs=4, group_size=2, problems=PROBLEMS)
    _, info = env.reset(seed=1)
    obs, *_ = env.step(act(env, info, lambda i, role, problem_id: right(problem_id)))
    state = env.get_state()
    shards = [env.split_state(state, group, 1) for group in range(2)]
    assert env.merge_states(shards) == state
    shard = MultiAgentMathVectorEnv(num_envs=2, group_size=2, group_offset=1, total_groups=2, problems=PROBLEMS)
    assert shard.set_state(shards[1])[0] == obs[2:]


def test_a_state_saved_by_an_older_build_resumes_with_its_returns_so_far():
    """A state saved before the slots' running returns were named ``return_so_far`` holds them under ``returns``:
    it resumes (whole and split into shards) with those returns, and the next step's rewards add to them."""
    env, twin = chain_env(num_envs=2, group_size=1), chain_env(num_envs=2, group_size=1)
    _, info = env.reset(seed=0)
    say = scripted([[right, ACCEPT]] * 2)
    *_, info = env.step(act(env, info, say))
    state = json.loads(json.dumps(env.get_state()))
    state["return_so_far"] = [[0.25, 0.0, 0.0], [0.5, 0.0, 0.0]]
    old = {("returns" if key == "return_so_far" else key): value for key, value in state.items()}
    twin.set_state(old)
    assert twin.get_state() == state
    assert [env.split_state(old, group, 1) for group in range(2)] == [env.split_state(state, group, 1)
                                                                     for group in range(2)]
    actions = act(env, info, say)
    (*_, expected), (_, rewards, terminated, _, got) = env.step(actions), twin.step(actions)
    assert terminated.all() and rewards[:, 0].tolist() == [1.0, 1.0]
    assert got[FACTS].return_so_far.tolist() == (expected[FACTS].return_so_far + state["return_so_far"]).tolist()


def test_hostile_actions_are_clipped_or_refused():
    env = chain_env(num_envs=2, max_step_chars=100)
    _, info = env.reset(seed=0)
    huge = "x" * 1_000_000 + "\\boxed{5}"
    _, _, _, _, info = env.step([[huge, None, 3], [right(info["problem_id"][1]), "", ""]])  # idle slots: ignored
    assert info["action_clipped"].tolist() == [[True, False, False], [False] * 3]
    assert info["answer_correct"][:, 0].tolist() == [0, 1]  # the box was clipped off
    state = env.get_state()
    assert state["transcripts"][0] == [[0, 0, "x" * 100]]
    with pytest.raises(TypeError, match=r"actions\[1\]\[1\] \(verifier's message\) must be a str, got int"):
        env.step([["", ACCEPT, ""], ["", 7, ""]])
    with pytest.raises(ValueError, match="got 1 actions for 2 envs"):
        env.step([["", ACCEPT, ""]])
    with pytest.raises(ValueError, match=r"actions\[0\] must be a sequence of 3 messages.*got str"):
        env.step([ACCEPT, ["", ACCEPT, ""]])
    assert env.get_state() == state  # a refused step takes nothing


@pytest.mark.parametrize("kwargs, message", [
    ({"autoreset_mode": AutoresetMode.NEXT_STEP}, "autoreset_mode=.*not supported"),
    ({"reward_model": "prm"}, "reward_model='prm' has no name and score"),
    ({"handoff_steps": 1}, "handoff_steps= is not supported"),
    ({"mode": "token"}, "whole messages"),
    ({"reward_assignment": "shared"}, "reward_assignment='shared' must be one of"),
    ({"rollout_mode": "forest"}, "rollout_mode='forest' must be one of"),
    ({"workflow": "relay"}, "workflow='relay' is neither"),
])
def test_refused_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        MultiAgentMathVectorEnv(num_envs=1, problems=PROBLEMS, **kwargs)


def test_workflow_checks():
    with pytest.raises(ValueError, match="repeated role names"):
        Workflow("twins", (Role("a"), Role("a")), schedule=lambda transcript, turn: (0,))
    with pytest.raises(ValueError, match="both answers and judges"):
        Role("critic", judges="solver")
    stray = Workflow("stray", (Role("a"),), schedule=lambda transcript, turn: (0,) if turn == 0 else (3,))
    env = MultiAgentMathVectorEnv(num_envs=1, problems=PROBLEMS, workflow=stray)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"schedule gave slots \(3,\) at turn 1"):
        env.step([["hi"]])
    assert [role.default for role in chain("line").roles[:2]] == ["", ACCEPT]
    with pytest.raises(ValueError, match="verdict_by='vote' must be one of"):
        chain("vote")


@pytest.mark.parametrize("env_id, num_agents", [("Arith-Chain-v0", 3), ("Arith-Debate-v0", 3), ("Arith-Prefix-v0", 2)])
def test_make_vec_of_the_registered_arith_ids(env_id, num_agents):
    register_builtin()
    register_builtin()  # idempotent
    env = gymnasium.make_vec(env_id, num_envs=2, vectorization_mode="vector_entry_point")
    assert isinstance(env, MultiAgentMathVectorEnv) and env.task.max_steps == 8  # Arith-v0's limits
    obs, info = env.reset(seed=0)
    assert len(obs) == 2 and all(len(row) == num_agents for row in obs) and obs[0][0].startswith("Problem: Compute")
    assert obs in env.observation_space
    _, rewards, *_ = env.step([["\\boxed{1}"] * num_agents] * 2)
    assert rewards.shape == (2, num_agents)


@pytest.mark.filterwarnings("ignore:.*reward returned by `step\\(\\)` must be a float")  # one reward per slot [A]
def test_make_of_a_registered_id_gives_the_single_env():
    register_builtin()
    env = gymnasium.make("Arith-Chain-v0")
    task = env.unwrapped.vector_env.task
    problem = task.sampler.problems[5]
    obs, info = env.reset(seed=0, options={"problem_id": problem.id})
    assert isinstance(env.unwrapped, MultiAgentMathEnv) and obs == (task.prompt(problem), "", "")
    assert info["problem_id"] == problem.id and info["acting"].tolist() == [True, False, False]
    _, reward, terminated, _, info = env.step([f"\\boxed{{{problem.answer}}}", "", ""])
    assert reward.tolist() == [0, 0, 0] and not terminated and info["acting"].tolist() == [False, True, False]
    _, reward, terminated, _, info = env.step(["", f"So \\boxed{{{problem.answer}}}.", ""])  # solved again: agrees
    assert reward.tolist() == [1, 1, 0] and terminated and info["correct"] == 1 and info["roles"][1] == "verifier"


def test_a_user_workflow_registers_and_makes_vec():
    solo = Workflow("solo", (Role("solver"),), schedule=lambda transcript, turn: (0,) if turn == 0 else ())
    if "Test-Solo-v0" not in gymnasium.registry:
        gymnasium.register("Test-Solo-v0", entry_point="envs.multi_agent:MultiAgentMathEnv",
                           vector_entry_point="envs.multi_agent:MultiAgentMathVectorEnv",
                           kwargs={"problems": PROBLEMS, "workflow": solo, "reward_assignment": "individual"})
    env = gymnasium.make_vec("Test-Solo-v0", num_envs=2, vectorization_mode="vector_entry_point")
    obs, info = env.reset(seed=0)
    reference_obs, _ = MathVectorEnv(num_envs=2, problems=PROBLEMS).reset(seed=0)
    assert tuple(row[0] for row in obs) == reference_obs  # one role, no instruction: today's prompt
    _, rewards, terminated, _, _ = env.step([[right(info["problem_id"][0])], [WRONG]])
    assert rewards.tolist() == [[1], [0]] and terminated.tolist() == [True, True]
