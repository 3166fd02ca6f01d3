"""The Python tool in the env: a step ending in a fenced python block runs in the sandbox and its output
follows as a tool turn (plain ```output block, or the chat template's tool role); tool output is observation
only (never an action token, never a step the reward model scores); max_tool_calls; the registered ids pass
gymnasium's check_env; and a short GRPO run of a tool-using tiny policy trains end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode

import envs  # noqa: F401  (registers the ids)
from envs.contract import FACTS
from envs.datasets import Arith, Problem
from envs.math_env import TOOL_OUTPUT_CUT, MathEnv, cut_output, plain_tool_turn, trailing_code
from envs.prompts import format_prompt
from envs.rewards import OutcomeReward, RewardOutput, StepContext
from envs.vector import MathVectorEnv
from models.prompting import build_template, tool_turn_template
from models.tiny import shipped_models

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
          "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PROBLEM = Problem(id="p0", problem="What is 6*7?", answer="42")
CODE_STEP = "Compute it.\n```python\nprint(6*7)\n```"


class RecordingReward:
    """The verified outcome, keeping every context it was asked to score (what a PRM would read)."""

    name = "recording"

    def __init__(self):
        self.contexts: list[StepContext] = []
        self.outcome = OutcomeReward()

    def score(self, contexts):
        self.contexts += contexts
        return self.outcome.score(contexts)


@pytest.mark.parametrize("text, code", [
    (CODE_STEP, "print(6*7)"),
    ("```python\nx = 1\n\ny = 2\nprint(x + y)\n```  \n", "x = 1\n\ny = 2\nprint(x + y)"),
    ("```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```", "print(2)"),
    ("```python\nprint(1)\n``` and more", None),  # text after the block: not a call
    ("```python print(1)```", None),  # no newline after the opening fence
    ("```python\nprint(1)", None),  # not closed
    ("```py\nprint(1)\n```", None),
    ("```python\nprint(1)\n```\n```", None),  # the trailing fence closes another block
])
def test_a_call_is_a_fenced_python_block_at_the_end(text, code):
    assert trailing_code(text) == code


def test_an_output_is_cut_saying_so():
    assert cut_output("abc", 5) == "abc"
    cut = cut_output("x" * 100, 30)
    assert len(cut) == 30 and cut == "x" * (30 - len(TOOL_OUTPUT_CUT)) + TOOL_OUTPUT_CUT


def test_the_output_follows_the_call_and_is_never_a_step():
    reward = RecordingReward()
    env = MathVectorEnv(2, problems=[PROBLEM], tools="python", tool_workers=1, reward_model=reward, max_steps=4,
                        autoreset_mode=AutoresetMode.DISABLED, tool_timeout_s=10.0)
    try:
        obs, _ = env.reset(seed=0)
        prompt = format_prompt(PROBLEM.problem)
        obs, rewards, terminated, truncated, info = env.step([CODE_STEP, "1/0 is next.\n```python\n1/0\n```"])
        assert obs[0] == prompt + CODE_STEP + "\n\n```output\n42\n```\n\n"
        assert obs[1] == (prompt + "1/0 is next.\n```python\n1/0\n```" +
                          "\n\n```output\nZeroDivisionError: division by zero\n```\n\n")
        assert info["tool_called"].tolist() == [True, True] and not terminated.any() and not truncated.any()
        assert info[FACTS].tool_called.tolist() == [[True], [True]]  # the contract's [N, A], what a trainer reads
        obs, rewards, terminated, truncated, info = env.step(["So the answer is \\boxed{42}.", "\\boxed{0}"])
        assert obs[0].endswith("```output\n42\n```\n\nSo the answer is \\boxed{42}.\n\n")
        assert terminated.tolist() == [True, True] and rewards.tolist() == [1.0, 0.0]
        assert info["tool_called"].tolist() == [False, False] and info[FACTS].tool_called.tolist() == [[False]] * 2
        assert env.episodes[0].steps == [CODE_STEP, "So the answer is \\boxed{42}."]
        assert env.episodes[0].tool_calls == 1
        # the reward model read the policy's steps alone: no tool output in any of them
        assert [c.steps for c in reward.contexts[:2]] == [(CODE_STEP,), ("1/0 is next.\n```python\n1/0\n```",)]
        assert not any("```output" in step or "ZeroDivision" in step for c in reward.contexts for step in c.steps)
    finally:
        env.close()


def test_the_contract_says_which_actions_called_the_tool_only_in_an_env_with_one():
    """``StepFacts.tool_called`` [N, A]: the one env and the vector env with a tool say it at each step (None at
    a reset); an env without a tool says None."""
    one = MathEnv(problems=[PROBLEM], tools="python", tool_workers=1)
    try:
        _, info = one.reset(seed=0)
        assert info[FACTS].tool_called is None
        _, _, _, _, info = one.step(CODE_STEP)
        assert info[FACTS].tool_called.tolist() == [[True]]
        _, _, _, _, info = one.step("So the answer is \\boxed{42}.")
        assert info[FACTS].tool_called.tolist() == [[False]]
    finally:
        one.close()
    plain = MathVectorEnv(2, problems=[PROBLEM], max_steps=4)
    plain.reset(seed=0)
    _, _, _, _, info = plain.step([CODE_STEP, "x"])
    assert info[FACTS].tool_called is None and "tool_called" not in info


def test_a_call_beyond_max_tool_calls_ends_the_episode_unrun():
    env = MathVectorEnv(1, problems=[PROBLEM], tools="python", tool_workers=1, max_tool_calls=1, max_steps=8,
                        autoreset_mode=AutoresetMode.DISABLED)
    try:
        env.reset(seed=0)
        env.step([CODE_STEP])
        obs, rewards, terminated, truncated, info = env.step(["Again.\n```python\nprint(7)\n```"])
        assert truncated.tolist() == [True] and not terminated.any() and info["tool_called"].tolist() == [False]
        assert obs[0].endswith("```output\n42\n```\n\nAgain.\n```python\nprint(7)\n```\n\n")
        assert obs[0].count("```output") == 1 and rewards.tolist() == [0.0]
    finally:
        env.close()


def test_a_long_output_is_cut_to_max_tool_output_chars():
    env = MathEnv(problems=[PROBLEM], tools="python", tool_workers=1, max_tool_output_chars=40)
    try:
        env.reset(seed=0)
        obs, *_ = env.step("```python\nprint('y' * 5000)\n```")
        output = obs.split("```output\n")[1].split("\n```")[0]
        assert 0 < len(output) <= 40 and output.startswith("y" * 10)
    finally:
        env.close()


def test_under_a_chat_template_with_a_tool_role_the_output_is_a_tool_turn(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = CHATML
    turn = tool_turn_template("chat", tokenizer)
    assert turn == "<|im_end|>\n<|im_start|>tool\n{output}<|im_end|>\n<|im_start|>assistant\n"
    assert tool_turn_template("default", tokenizer) is None and tool_turn_template("chat", tiny_tokenizer) is None
    template = build_template("chat", tokenizer)
    env = MathEnv(problems=[PROBLEM], tools="python", tool_workers=1, template=template, tool_turn=turn)
    try:
        env.reset(seed=0)
        obs, *_ = env.step(CODE_STEP)
    finally:
        env.close()
    conversation = [{"role": "user", "content": PROBLEM.problem}, {"role": "assistant", "content": CODE_STEP},
                    {"role": "tool", "content": "42"}]
    assert obs == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_plain_tool_turn_and_a_template_without_output_slot_is_refused():
    assert plain_tool_turn("\n\n") == "\n\n```output\n{output}\n```\n\n"
    with pytest.raises(ValueError, match="tool_turn=.* must hold '{output}'"):
        MathEnv(problems=[PROBLEM], tools="python", tool_workers=1, tool_turn="no slot")
    with pytest.raises(ValueError, match="needs mode='step'"):
        MathEnv(problems=[PROBLEM], tools="python", tool_workers=1, mode="token", tokenizer=object())


@pytest.mark.parametrize("env_id, kwargs", [
    ("Arith-Tool-v0", {"arith": {**envs.DEFAULT_ARITH, "num_train": 200, "num_test": 20}}), ("MATH-Tool-v0", {})])
def test_check_env_passes_on_the_tool_ids(env_id, kwargs):
    env = gymnasium.make(env_id, tool_workers=1, **kwargs)
    try:
        assert env.unwrapped.task.tools == "python"
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()


TOOL_TURN_42 = "\n\n```output\n42\n```\n\n"


class ScriptedGenerator:
    """The policy's generator with its choices scripted, where the choice is the point: exact action texts to
    follow token by token, and answers right and wrong in turn so that a group's rewards differ (the shipped
    tool model copies the tool's output, so its groups mostly agree and GRPO's advantages vanish). A prompt
    without tool output gets ``CODE_STEP``, one with output a boxed answer (42 and 0 in turn). Token ids and
    rollout log-probs are the policy's own (``LanguagePolicy.score_actions``), texts end in the stop string."""

    def __init__(self, policy):
        self.policy = policy
        self.answers = 0  # boxed answers written so far

    def generate(self, prompts, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=-1, stop=None, seed=None,
                 adapters=None):
        from models.sampling import GenerationOutput

        tokenizer = self.policy.tokenizer
        texts = [(CODE_STEP if "```output" not in prompt else self.answer()) + "\n\n" for prompt in prompts]
        prompt_ids = tokenizer(list(prompts))["input_ids"]
        action_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        with torch.no_grad():
            scores = self.policy.score_actions(prompt_ids, action_ids, temperature or 1.0, with_entropy=False)
        log_probs = [scores.log_probs[b, :len(ids)].tolist() for b, ids in enumerate(action_ids)]
        return GenerationOutput(texts, action_ids, log_probs, ["stop"] * len(texts), prompt_ids)

    def answer(self) -> str:
        self.answers += 1
        return f"So \\boxed{{{42 if self.answers % 2 else 0}}}."

    def sync(self, policy) -> float:
        return 0.0


def test_tool_output_tokens_are_observations_only(untrained_policy_dir):
    """Token by token: each action's trained tokens are the policy's own; the tool turn lies in the next
    prompt's tokens alone; the reward model scores the policy's steps alone."""
    from algorithms.registry import algorithm_spec
    from models.policy import LanguagePolicy
    from train.collector import Collector
    from train.episodes import Sampling

    policy = LanguagePolicy(str(untrained_policy_dir), device="cpu").eval()
    tokenizer = policy.tokenizer
    reward = RecordingReward()
    env = MathVectorEnv(4, group_size=2, problems=[PROBLEM], tools="python", tool_workers=1, max_steps=3,
                        reward_model=reward, autoreset_mode=AutoresetMode.DISABLED)
    sampling = Sampling(max_new_tokens=48, temperature=1.0, stop=("\n\n",))
    try:
        collector = Collector(env, algorithm_spec("GRPO"), episode_length=3, sampling=sampling, seed=0)
        buffer, tally = collector.collect(policy, ScriptedGenerator(policy), seed=0)
    finally:
        env.close()
    live, mask = buffer.live[..., 0], buffer.token_mask()[..., 0, :]  # [T, N], [T, N, L]: what the loss reads
    assert live[:2].all() and not live[2].any() and tally.mean("train/tool_calls") == 0.5
    prompt = tokenizer(format_prompt(PROBLEM.problem))["input_ids"]
    for i in range(4):
        first, second = (buffer.slot_index(t, torch.tensor([i]), torch.tensor([0])).item() for t in (0, 1))
        assert buffer.prompt_ids[first] == prompt
        assert buffer.action_ids[0, i, 0][mask[0, i]].tolist() == tokenizer(CODE_STEP + "\n\n",
                                                                             add_special_tokens=False)["input_ids"]
        # the next prompt is the observation: the call, then the tool turn, tokenized as one text
        assert buffer.prompt_ids[second] == tokenizer(format_prompt(PROBLEM.problem) + CODE_STEP + TOOL_TURN_42
                                                      )["input_ids"]
        assert tokenizer.decode(buffer.action_ids[1, i, 0][mask[1, i]].tolist()).startswith("So \\boxed{")
    assert int(mask.sum()) == int(buffer.action_lengths[..., 0][live].sum())
    answered = [buffer.texts[buffer.slot_index(1, torch.tensor([i]), torch.tensor([0])).item()] for i in range(4)]
    assert buffer.correct[1, :, 0].tolist() == [float("boxed{42}" in text) for text in answered]
    assert not any("```output" in step for c in reward.contexts for step in c.steps)


@pytest.fixture(scope="module")
def tool_model() -> Path:
    """The shipped tool model (models/tiny/shipped, inside the package: no cache, no build): the tiny policy
    taught to compute with the tool, so a run's own actions call it."""
    return shipped_models(team=False, tool=True).tool


def test_a_grpo_run_with_the_tool_trains_end_to_end(tool_model, tmp_path):
    """train_math.py on Arith-Tool-v0 (GRPO, HF backend, asynchronous rollouts as on a CPU by default) with the
    shipped tool model: its actions call the tool, the sandboxes start, the run trains, evaluates, saves and
    closes them."""
    from event_files import read_scalars
    from test_trainer import run_train_math

    run_dir = run_train_math(["--env_id", "Arith-Tool-v0", "--action_level", "step", "--algorithm_name", "GRPO",
                              "--model_name_or_path", str(tool_model), "--num_env_steps", "16",
                              "--n_rollout_threads", "4", "--group_size", "2", "--episode_length", "2",
                              "--max_new_tokens", "32", "--max_tool_calls", "2", "--eval_interval", "2",
                              "--eval_limit", "4", "--eval_batch_size", "4", "--logdir", str(tmp_path),
                              "--env_kwargs", '{"arith": {"num_train": 200, "num_test": 20}}'])
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["eval/accuracy"]] == [0, 2]
    assert len(scalars["train/reward"]) == 2 and "grad/norm" in scalars
    assert len(scalars["train/tool_calls"]) == 2 and min(value for _, value in scalars["train/tool_calls"]) > 0
    assert [step for step, _ in scalars["eval/tool_calls"]] == [0, 2]
    assert min(value for _, value in scalars["eval/tool_calls"]) > 0  # greedy, the tool model calls it
    assert (Path(run_dir) / "checkpoints" / "iter_2" / "manifest.json").is_file()


def test_a_run_with_tool_calls_trains(untrained_policy_dir, tmp_path):
    """A library user's run (RunConfig, no flags) on MATH-Tool-v0 (one problem) whose actions call the tool:
    GRPO updates the policy on them. Scripted (``ScriptedGenerator``): each group answers right and wrong, so
    its advantages are not zero and the update must move the weights."""
    from tensorboardX import SummaryWriter

    from envs.modes import ActionLevel
    from train.builders import build_runner
    from train.config import BudgetConfig, EnvConfig, GenerationConfig, LoggingConfig, ModelConfig, RunConfig

    dataset = tmp_path / "problems.jsonl"
    dataset.write_text(json.dumps({"problem": PROBLEM.problem, "answer": PROBLEM.answer}) + "\n")
    config = RunConfig(model=ModelConfig(name_or_path=str(untrained_policy_dir), device="cpu"),
                       env=EnvConfig(env_id="MATH-Tool-v0", dataset_path=str(dataset), action_level=ActionLevel.STEP,
                                     episode_length=2, num_envs=4, group_size=2, tools="python"),
                       generation=GenerationConfig(max_new_tokens=48, async_rollouts=False),
                       budget=BudgetConfig(num_iterations=1, eval_interval=0, eval_batch_size=4),
                       logging=LoggingConfig(save_interval=0, save_best=False))
    writer = SummaryWriter(str(tmp_path))
    runner = build_runner(config, tmp_path, writer, generator_factory=ScriptedGenerator)
    before = [p.detach().clone() for p in runner.policy.parameters() if p.requires_grad]
    try:
        runner.run()
    finally:
        runner.close()
        writer.close()
    assert runner.last_buffer.live[:2].all()
    after = [p for p in runner.policy.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
