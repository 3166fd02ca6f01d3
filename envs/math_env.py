"""MathEnv: one math problem per episode; an action is one reasoning step (text) or one token.

The episode logic lives in ``MathTask`` so that ``MathEnv`` (one episode) and ``MathVectorEnv``
(N episodes, rewards scored in one batch) share it: a task builds episodes, applies actions, and
scores every step completed in a batch with one call to the reward model.

Observation: the prompt (problem inside a template) followed by the steps so far, each ending
with the step delimiter; the gold answer is never in it. Reward: whatever the reward model pays
for each completed step (default: the verified outcome, 1 if correct, at the end of the episode).
``terminated`` when a step holds a final answer (or the end-of-solution marker / EOS token),
``truncated`` at ``max_steps`` steps or ``max_solution_chars`` (step mode) / ``max_solution_tokens``
(token mode).

Tools (``tools="python"``, step mode): an action whose text since the last tool output ends in a fenced
```` ```python ```` block is a tool call. The block runs in a sandbox (``envs.sandbox``; one per task,
its calls of one batch run together) and its output, cut to ``max_tool_output_chars``, follows the step
in the observation as a tool turn (``tool_turn``: a plain ```` ```output ```` block, or the chat
template's tool role, ``models.prompting.tool_turn_template``). Tool output is observation only: it is
never an action (so never trained on) and never a step (``episode.steps``, what the reward model
scores, holds the policy's steps alone). The episode goes on until a step holds an answer, a tool call
beyond ``max_tool_calls`` (truncated, not run) or the step and length limits.
"""

from __future__ import annotations

import copy
import hashlib
import string
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import gymnasium
import numpy as np
from gymnasium import spaces

from envs.contract import FACTS, StepFacts
from envs.datasets import Arith, Problem, load_problems
from envs.grader import extract_answer
from envs.modes import ActionLevel, Tool, member_of
from envs.prompts import DEFAULT_TEMPLATE, STEP_DELIMITER, format_prompt, resolve_template
from envs.reasoning_gym_source import reasoning_gym_problems
from envs.rewards import OutcomeReward, RewardModel, StepContext, final_answer, score_batch, verify
from envs.sandbox import PythonSandbox, Sandbox

MODES = (ActionLevel.STEP, ActionLevel.TOKEN)  # an action is one step of text, or one token id
SOLUTION_MODE = " (a whole solution per action is mode='step' with max_steps=1)"
CODE_FENCE, CLOSING_FENCE = "```python", "```"
OUTPUT_SLOT = "{output}"
TOOL_OUTPUT_CUT = "\n... (output cut)"
TOOL_TIMEOUT_S, MAX_TOOL_OUTPUT_CHARS = 5.0, 1024  # a tool call's defaults: wall-clock seconds, output length
MAX_TOOL_CALLS = 4  # an episode's default


def plain_tool_turn(step_delimiter: str = STEP_DELIMITER) -> str:
    """The tool turn of a plain (non-chat) prompt: the output in a fenced ``output`` block, as Qwen2.5-Math's
    tool-integrated reasoning writes it, between step delimiters; ``{output}`` stands for the output."""
    return f"{step_delimiter}```output\n{OUTPUT_SLOT}\n```{step_delimiter}"


def trailing_code(text: str) -> str | None:
    """The code of the fenced python block ``text`` ends with (trailing whitespace aside), else None.
    Linear in ``len(text)`` (model output: no backtracking parse)."""
    text = text.rstrip()
    start = text.rfind(CODE_FENCE)
    if start < 0 or not text.endswith(CLOSING_FENCE) or len(text) - len(CLOSING_FENCE) < start + len(CODE_FENCE):
        return None
    opening, newline, code = text[start + len(CODE_FENCE):len(text) - len(CLOSING_FENCE)].partition("\n")
    if not newline or opening.strip() or CLOSING_FENCE in code:
        return None
    return code.removesuffix("\n")


def cut_output(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying so."""
    return text if len(text) <= limit else text[:max(limit - len(TOOL_OUTPUT_CUT), 0)] + TOOL_OUTPUT_CUT


class UnicodeText(spaces.Text):
    """A Text space that contains any Python string up to ``max_length`` characters.

    Model output and MATH problems hold arbitrary Unicode (LaTeX, non-ASCII), so membership is
    checked on length only; ``sample`` draws from printable ASCII.
    """

    def __init__(self, max_length: int, min_length: int = 0, seed: int | None = None):
        super().__init__(max_length, min_length=min_length, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"

    def __deepcopy__(self, memo: dict) -> UnicodeText:
        """A copy with its own RNG that shares the character tables, which nothing changes: gymnasium's
        ``batch_space`` deep-copies the space once per env (1,000 of them in a held-out env)."""
        copied = copy.copy(self)
        memo[id(self)] = copied
        copied._np_random = copy.deepcopy(self._np_random, memo)
        return copied


def build_problems(
    problems: Sequence[Problem] | None = None,
    dataset_path: str | None = None,
    split: str | None = None,
    subjects: Sequence[str] | None = None,
    levels: Sequence[int] | None = None,
    limit: int | None = None,
    arith: dict | None = None,
    reasoning_gym: dict | None = None,
) -> list[Problem]:
    """The problem list from exactly one source: ``problems``, ``dataset_path`` (+ filters),
    ``arith`` (knobs of ``Arith`` plus ``num_train``, ``num_test``, ``seed``; ``split`` picks
    "train" or "test" of that disjoint split) or ``reasoning_gym`` (a reasoning-gym dataset, split the same
    way: ``envs.reasoning_gym_source``)."""
    sources = (("problems", problems), ("dataset_path", dataset_path), ("arith", arith),
               ("reasoning_gym", reasoning_gym))
    given = [name for name, value in sources if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one problem source of problems=, dataset_path=, arith=, reasoning_gym=; got "
                         f"{given or 'none'}")
    if problems is not None:
        if not problems or not all(isinstance(p, Problem) for p in problems):
            raise ValueError("problems= must be a non-empty list of envs.datasets.Problem")
        return list(problems)
    if dataset_path is not None:
        return load_problems(dataset_path, split=split, subjects=subjects, levels=levels, limit=limit)
    if reasoning_gym is not None:
        chosen = reasoning_gym_problems(reasoning_gym, split)
        return chosen[:limit] if limit else chosen
    knobs = dict(arith)
    sizes = {key: knobs.pop(key) for key in ("num_train", "num_test", "seed") if key in knobs}
    train, test = Arith(**knobs).split(sizes.get("num_train", 20_000), sizes.get("num_test", 1_000),
                                       sizes.get("seed", 0))
    if split not in (None, "train", "test"):
        raise ValueError(f"Arith split={split!r} must be 'train' or 'test'")
    chosen = test if split == "test" else train
    return chosen[:limit] if limit else chosen


class ProblemSampler:
    """Problems by draw position: position p is problem ``order_e[p % P]`` of epoch ``e = p // P``, where
    each epoch's order is a fresh permutation from the seeded RNG (or the list order, unshuffled). Epochs
    are generated in sequence, so a seed fixes the problem at every position whatever order positions
    are asked in: envs split over processes draw what one process would (``MathVectorEnv`` gives group
    g its d-th problem at position ``d * total_groups + g``). ``draw`` takes the next position in turn."""

    def __init__(self, problems: Sequence[Problem], shuffle: bool = True):
        self.problems = list(problems)
        self.shuffle = shuffle
        self.index = {p.id: i for i, p in enumerate(self.problems)}
        self.seed(None)

    def seed(self, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)
        self.start = self.rng.bit_generator.state  # the epochs regenerate from here (set_state)
        self.orders: list[np.ndarray] = []  # [P] problem indices of each epoch generated so far
        self.position = 0  # the next position ``draw`` takes

    def at(self, position: int) -> Problem:
        epoch, offset = divmod(position, len(self.problems))
        while len(self.orders) <= epoch:
            self.orders.append(self.rng.permutation(len(self.problems)) if self.shuffle
                               else np.arange(len(self.problems)))
        return self.problems[self.orders[epoch][offset]]

    def draw(self) -> Problem:
        problem = self.at(self.position)
        self.position += 1
        return problem

    def get(self, problem_id: str) -> Problem:
        if problem_id not in self.index:
            raise KeyError(f"problem_id {problem_id!r} is not among the env's {len(self.problems)} problems")
        return self.problems[self.index[problem_id]]

    def fingerprint(self) -> str:
        """A hash of the problem ids in order: a saved state only fits the same problem list."""
        return hashlib.sha1("\n".join(p.id for p in self.problems).encode()).hexdigest()

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable: the RNG state the epochs start from, how many there are, the next position."""
        return {"fingerprint": self.fingerprint(), "start": self.start, "epochs": len(self.orders),
                "position": self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues exactly where ``get_state`` was called (on the same problem list)."""
        if state["fingerprint"] != self.fingerprint():
            raise ValueError(f"the saved sampler state is for a different problem list than this env's "
                             f"{len(self.problems)} problems; resume with the same dataset, filters and split")
        if "start" not in state:
            raise ValueError("the saved sampler state is from an older mathrl (it drew problems in turn, not by "
                             "position); start a new run")
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = self.start = state["start"]
        self.orders = []
        if state["epochs"]:
            self.at(state["epochs"] * len(self.problems) - 1)
        self.position = state["position"]


RENAMED_STATE_KEYS = {"paid": "return_so_far", "returns": "return_so_far"}
"""Keys of an env state saved by an older build (an ``Episode.get_state``'s ``paid``, a multi-agent env's
``returns``) -> their name now, so its checkpoints resume."""


def renamed_state_keys(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each key an older build saved under its name now (``RENAMED_STATE_KEYS``)."""
    return {RENAMED_STATE_KEYS.get(key, key): value for key, value in state.items()}


@dataclass
class Episode:
    """The state of one episode. ``solution_ids``, ``step_start`` and ``completed_text`` are used
    in token mode only; ``solution_text`` is what the observation shows after the prompt; ``return_so_far``
    is the sum of its rewards so far."""

    problem: Problem
    group_id: int
    prompt: str
    steps: list[str] = field(default_factory=list)
    solution_ids: list[int] = field(default_factory=list)
    step_start: int = 0
    completed_text: str = ""  # token mode: decoded text of the completed steps
    solution_text: str = ""
    done: bool = False
    return_so_far: float = 0.0
    tool_calls: int = 0  # tool calls run
    tool_start: int = 0  # where the text after the last tool output starts in solution_text

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable copy; the problem by id, the prompt left out (rebuilt from the problem)."""
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("problem", "prompt")}
        return {**state, "steps": list(self.steps), "solution_ids": list(self.solution_ids),
                "problem_id": self.problem.id}


@dataclass
class Transition:
    """What one action did to an episode: the step it completed (if any), the end flags, whether the
    action text was clipped to ``max_step_chars`` (step mode), and the code of the tool call it made."""

    completed_step: str | None
    terminated: bool
    truncated: bool
    action_clipped: bool = False
    tool_code: str | None = None  # run by ``MathTask.run_tools``


@dataclass
class StepScores:
    """What a batch of B actions earned, as arrays over the B episodes.

    rewards: [B] float64, 0.0 where the action completed no step.
    sources: {source name: [B] float64} as the reward model reported them (``RewardOutput.sources``), NaN
        where no step was scored.
    correct: [B] float64 verdicts, 1.0 / 0.0 where the episode ended at this step, NaN elsewhere.
    answers: [B] object, the extracted final answer where the episode ended at this step, None elsewhere
        (and where the solution has none).
    """

    rewards: np.ndarray
    sources: dict[str, np.ndarray]
    correct: np.ndarray
    answers: np.ndarray


def task_modes(mode: ActionLevel | str, tools: Tool | str | None) -> tuple[ActionLevel, Tool]:
    """``mode`` and ``tools`` (members or their strings; tools None: no tool) as members, or a ValueError
    naming the bad one and the values it may take."""
    return (member_of(MODES, mode, "mode", SOLUTION_MODE),
            member_of(tuple(Tool), Tool.NONE if tools is None else tools, "tools", " or None"))


def check_task_arguments(mode: ActionLevel, tokenizer: Any, step_delimiter: str, tools: Tool, tool_turn: str | None,
                         **limits: int) -> None:
    """Fails early, naming the argument, on a token mode without tokenizer, a tool in token mode, a tool
    turn without ``{output}``, an empty delimiter or a limit below 1."""
    if tools != Tool.NONE and mode != ActionLevel.STEP:
        raise ValueError(f"tools={tools.value!r} runs code between steps: it needs mode='step', not {mode.value!r}")
    if tool_turn is not None and tool_turn.count(OUTPUT_SLOT) != 1:
        raise ValueError(f"tool_turn={tool_turn!r} must hold {OUTPUT_SLOT!r} once (where the tool's output goes)")
    if mode == ActionLevel.TOKEN and tokenizer is None:
        raise ValueError("mode='token' needs tokenizer= (a Hugging Face tokenizer to decode the token actions)")
    if not step_delimiter:
        raise ValueError("step_delimiter must be a non-empty string, e.g. '\\n\\n'")
    for name, value in limits.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")


class MathTask:
    """Everything about the MATH task that does not depend on how many episodes run at once.

    Args:
        problems / dataset_path (+ split, subjects, levels, limit) / arith / reasoning_gym: the problem source
            (exactly one; see ``build_problems``).
        mode: ``ActionLevel.STEP`` or "step" (action = one step of text), ``ActionLevel.TOKEN`` or "token"
            (action = one token id of ``tokenizer``).
        tokenizer: a Hugging Face tokenizer, required in token mode (decoding only).
        reward_model: a ``RewardModel``; default ``OutcomeReward()`` (1 for a verified answer).
        template: prompt template (key of ``envs.prompts.TEMPLATES`` or a string with ``{problem}``).
        step_delimiter: text between steps. max_steps: truncation in steps.
        max_step_chars: longest step text kept (longer actions are clipped, and info says so).
        max_solution_chars / max_solution_tokens: truncation by solution length.
        end_marker: text that ends a solution without an answer (e.g. the tokenizer's EOS text).
        handoff_steps: Prefix-RL: the episode terminates after this many steps, handing the
            solution to a target solver (``reward_models.target_solver``) that finishes it.
        shuffle: draw problems in a fresh random order each epoch (False: in dataset order).
        tools: ``Tool.PYTHON`` or "python" (step mode): a step ending in a fenced python block is run (module
            docstring); None or "none": no tool.
        max_tool_calls: tool calls per episode; a call beyond them truncates the episode.
        max_tool_output_chars: a tool output is cut to this many characters.
        tool_timeout_s: wall-clock seconds one tool call may run.
        tool_turn: what follows a tool call's step, ``{output}`` standing for its output (default:
            ``plain_tool_turn(step_delimiter)``).
        sandbox: where tool calls run (e.g. ``models.remote_sandbox.RemoteSandbox``); default: a
            ``PythonSandbox`` of this task with ``tool_workers`` warm workers (None: its default, one per
            core). The task closes it (``close``).
    """

    def __init__(
        self,
        problems: Sequence[Problem] | None = None,
        dataset_path: str | None = None,
        split: str | None = None,
        subjects: Sequence[str] | None = None,
        levels: Sequence[int] | None = None,
        limit: int | None = None,
        arith: dict | None = None,
        reasoning_gym: dict | None = None,
        mode: ActionLevel | str = ActionLevel.STEP,
        tokenizer: Any = None,
        reward_model: RewardModel | None = None,
        template: str = DEFAULT_TEMPLATE,
        step_delimiter: str = STEP_DELIMITER,
        max_steps: int = 16,
        max_step_chars: int = 4096,
        max_solution_chars: int = 16384,
        max_solution_tokens: int = 1024,
        end_marker: str | None = None,
        handoff_steps: int | None = None,
        shuffle: bool = True,
        tools: Tool | str | None = None,
        max_tool_calls: int = MAX_TOOL_CALLS,
        max_tool_output_chars: int = MAX_TOOL_OUTPUT_CHARS,
        tool_timeout_s: float = TOOL_TIMEOUT_S,
        tool_turn: str | None = None,
        sandbox: Sandbox | None = None,
        tool_workers: int | None = None,
    ):
        mode, tools = task_modes(mode, tools)
        check_task_arguments(mode, tokenizer, step_delimiter, tools, tool_turn, max_steps=max_steps,
                             max_step_chars=max_step_chars, max_solution_chars=max_solution_chars,
                             max_solution_tokens=max_solution_tokens, max_tool_output_chars=max_tool_output_chars,
                             handoff_steps=1 if handoff_steps is None else handoff_steps,
                             max_tool_calls=max_tool_calls)
        self.sampler = ProblemSampler(build_problems(problems, dataset_path, split, subjects, levels, limit, arith,
                                                     reasoning_gym),
                                      shuffle=shuffle)
        self.mode, self.tokenizer = mode, tokenizer
        self.reward_model = reward_model if reward_model is not None else OutcomeReward()
        self.template = resolve_template(template)
        self.step_delimiter = step_delimiter
        self.max_steps, self.max_step_chars = max_steps, max_step_chars
        self.max_solution_chars, self.max_solution_tokens = max_solution_chars, max_solution_tokens
        self.end_marker = end_marker
        self.handoff_steps = handoff_steps
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self._set_up_tools(tools, max_tool_calls, max_tool_output_chars, tool_timeout_s, tool_turn, sandbox,
                           tool_workers)

    def _set_up_tools(self, tools: Tool, max_tool_calls: int, max_tool_output_chars: int, tool_timeout_s: float,
                      tool_turn: str | None, sandbox: Sandbox | None, tool_workers: int | None) -> None:
        """The tool options (``__init__``'s), then the spaces (a tool output lengthens the observation) and the
        sandbox: ``sandbox``, else a ``PythonSandbox`` when ``tools`` asks for one."""
        self.tools, self.max_tool_calls, self.max_tool_output_chars = tools, max_tool_calls, max_tool_output_chars
        self.tool_turn = tool_turn if tool_turn is not None else plain_tool_turn(self.step_delimiter)
        self.action_space, self.observation_space = self._spaces()
        self.sandbox = sandbox
        if tools != Tool.NONE and sandbox is None:
            self.sandbox = PythonSandbox(timeout_s=tool_timeout_s, max_output_chars=max_tool_output_chars,
                                         workers=tool_workers)

    def close(self) -> None:
        """Stops the sandbox (its warm workers), if the task has one."""
        if self.sandbox is not None:
            self.sandbox.close()

    def _spaces(self) -> tuple[spaces.Space, UnicodeText]:
        """The action space and an observation space long enough for any prompt plus the longest
        solution the limits allow."""
        longest_prompt = max(len(self.prompt(p)) for p in self.sampler.problems)
        if self.mode == ActionLevel.STEP:
            longest_solution = self.max_solution_chars + self.max_step_chars + len(self.step_delimiter)
            if self.tools != Tool.NONE:
                longest_solution += len(self.tool_turn) + self.max_tool_output_chars
            return UnicodeText(self.max_step_chars), UnicodeText(longest_prompt + longest_solution)
        vocabulary = len(self.tokenizer)
        longest_token = max(len(t) for t in self.tokenizer.convert_ids_to_tokens(range(vocabulary)) if t)
        longest_solution = (self.max_solution_tokens + 1) * max(longest_token, 8)
        return spaces.Discrete(vocabulary), UnicodeText(longest_prompt + longest_solution)

    def prompt(self, problem: Problem) -> str:
        return format_prompt(problem.problem, self.template)

    def new_episode(self, problem: Problem, group_id: int) -> Episode:
        return Episode(problem=problem, group_id=group_id, prompt=self.prompt(problem))

    def restore_episode(self, state: dict[str, Any]) -> Episode:
        """The episode ``Episode.get_state`` described."""
        problem = self.sampler.get(state["problem_id"])
        rest = {key: value for key, value in renamed_state_keys(state).items() if key != "problem_id"}
        return Episode(problem=problem, prompt=self.prompt(problem), **rest)

    def observation(self, episode: Episode) -> str:
        return episode.prompt + episode.solution_text

    def info(self, episode: Episode) -> dict[str, Any]:
        info = {"problem_id": episode.problem.id, "group_id": episode.group_id, "step": len(episode.steps)}
        if self.tools != Tool.NONE:
            info["tool_calls"] = episode.tool_calls
        return info

    @staticmethod
    def facts(episodes: Sequence[Episode], acting: np.ndarray, **results: Any) -> StepFacts:
        """The ``StepFacts`` of ``episodes`` (one agent slot; ``acting`` [N]) and ``results``, the fields of
        the actions just taken (none: a reset's)."""
        return StepFacts(problem_ids=np.array([e.problem.id for e in episodes], dtype=object),
                         group_ids=np.array([e.group_id for e in episodes], dtype=np.int64),
                         turns=np.array([len(e.steps) for e in episodes], dtype=np.int64),
                         acting=np.asarray(acting, dtype=bool)[:, None], **results)

    def apply(self, episode: Episode, action: Any) -> Transition:
        """Applies one action to a live episode (marking it done if the action ended it)."""
        if episode.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        transition = (self._apply_step(episode, action) if self.mode == ActionLevel.STEP
                      else self._apply_token(episode, action))
        episode.done = transition.terminated or transition.truncated
        return transition

    def _apply_step(self, episode: Episode, action: Any) -> Transition:
        if not isinstance(action, str):
            raise TypeError(f"step mode takes one reasoning step as str, got {type(action).__name__}")
        clipped = len(action) > self.max_step_chars
        step = action[: self.max_step_chars].strip().removesuffix(self.step_delimiter.strip()).rstrip()
        episode.steps.append(step)
        episode.solution_text += step
        terminated = self._ends_solution(step) or self._hands_off(episode)
        code = (None if terminated or self.tools == Tool.NONE
                else trailing_code(episode.solution_text[episode.tool_start:]))
        if code is None:
            episode.solution_text += self.step_delimiter
        truncated = not terminated and (
            len(episode.steps) >= self.max_steps or len(episode.solution_text) >= self.max_solution_chars
            or (code is not None and episode.tool_calls >= self.max_tool_calls)
        )
        if truncated and code is not None:  # not run: the step ends the solution as written
            episode.solution_text += self.step_delimiter
            code = None
        return Transition(step, terminated, truncated, action_clipped=clipped, tool_code=code)

    def run_tools(self, episodes: Sequence[Episode], transitions: Sequence[Transition]) -> None:
        """Runs the tool calls of a batch of actions together (``Sandbox.run_many``) and puts each output in
        its episode's observation as a tool turn."""
        calls = [(episode, t.tool_code) for episode, t in zip(episodes, transitions) if t.tool_code is not None]
        if not calls:
            return
        results = self.sandbox.run_many([code for _, code in calls])
        for (episode, _), result in zip(calls, results):
            output = cut_output(result.output, self.max_tool_output_chars).rstrip("\n")  # the turn has its own
            episode.solution_text += self.tool_turn.replace(OUTPUT_SLOT, output)
            episode.tool_start = len(episode.solution_text)
            episode.tool_calls += 1

    def _apply_token(self, episode: Episode, action: Any) -> Transition:
        token_id = int(action)
        if not 0 <= token_id < self.action_space.n:
            raise ValueError(f"token action {token_id} is outside the vocabulary [0, {self.action_space.n})")
        episode.solution_ids.append(token_id)
        # Decode only the current step (not the whole solution) so an episode costs O(L) decodes of
        # short spans rather than O(L^2) characters.
        step_text = self.tokenizer.decode(episode.solution_ids[episode.step_start:], skip_special_tokens=True)
        episode.solution_text = episode.completed_text + step_text
        is_eos = token_id == self.eos_token_id
        step_ended = self.step_delimiter in step_text or is_eos
        too_long = len(episode.solution_ids) >= self.max_solution_tokens
        if not (step_ended or too_long):
            return Transition(None, False, False)
        step = step_text.split(self.step_delimiter)[0].strip()
        episode.steps.append(step)
        episode.step_start = len(episode.solution_ids)
        episode.completed_text = episode.solution_text
        terminated = is_eos or self._ends_solution(step) or self._hands_off(episode)
        truncated = not terminated and (too_long or len(episode.steps) >= self.max_steps)
        return Transition(step, terminated, truncated)

    def _hands_off(self, episode: Episode) -> bool:
        return self.handoff_steps is not None and len(episode.steps) >= self.handoff_steps

    def _ends_solution(self, step: str) -> bool:
        return extract_answer(step) is not None or (self.end_marker is not None and self.end_marker in step)

    def score(self, episodes: Sequence[Episode], transitions: Sequence[Transition]) -> StepScores:
        """Scores every completed step of a batch of B episodes with ONE reward-model call (and
        grades the finished episodes once); see ``StepScores`` for the [B] arrays."""
        scores = StepScores(rewards=np.zeros(len(episodes)), sources={}, correct=np.full(len(episodes), np.nan),
                            answers=np.full(len(episodes), None, dtype=object))
        scored = [i for i, t in enumerate(transitions) if t.completed_step is not None]
        if not scored:
            return scores
        contexts = [
            StepContext(
                problem=episodes[i].problem,
                previous_steps=tuple(episodes[i].steps[:-1]),
                new_step=episodes[i].steps[-1],
                done=transitions[i].terminated or transitions[i].truncated,
                group_id=episodes[i].group_id,
            )
            for i in scored
        ]
        output = score_batch(self.reward_model, contexts)
        rewards = np.asarray(output.rewards, dtype=np.float64)
        answers = [final_answer(c) if c.done else None for c in contexts]
        correct = output.correct if output.correct is not None else verify(contexts, answers)
        done = np.array([c.done for c in contexts])
        scores.rewards[scored] = rewards
        scores.answers[scored] = answers
        # verdicts only where the episode ended: a model may grade unfinished steps too
        scores.correct[scored] = np.where(done, np.asarray(correct, dtype=np.float64), np.nan)
        for name, values in output.sources.items():
            scores.sources[name] = np.full(len(episodes), np.nan)
            scores.sources[name][scored] = np.asarray(values, dtype=np.float64)
        return scores


class MathEnv(gymnasium.Env):
    """One math problem per episode; see ``MathTask`` for the arguments.

    ``reset(seed=..., options={"problem_id": ...})`` returns the prompt and info (problem id, group
    id, step count). ``step(action)`` takes one step of text (step mode) or one token id (token
    mode). Its info has ``reward/<source>`` for a scored step, ``action_clipped`` (step mode) and,
    at episode end, ``correct`` (the verifier's verdict, bool); ``info[FACTS]`` is the same as the
    ``envs.contract.StepFacts`` of one env.

    >>> import gymnasium
    >>> import envs  # registers the ids
    >>> env = gymnasium.make("Arith-v0")
    >>> obs, info = env.reset(seed=0)
    >>> print(obs)
    Problem: Compute 16 + 26.
    Solution:
    <BLANKLINE>
    >>> obs, reward, terminated, truncated, info = env.step("16 + 26 = 42")  # a step without an answer
    >>> reward, terminated
    (0.0, False)
    >>> obs, reward, terminated, truncated, info = env.step(r"The answer is \\boxed{42}.")
    >>> reward, terminated, info["correct"]  # the verified outcome
    (1.0, True, True)
    >>> env.close()
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, render_mode: str | None = None, **task_kwargs: Any):
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode={render_mode!r} must be None or 'ansi'")
        self.render_mode = render_mode
        self.task = MathTask(**task_kwargs)
        self.observation_space = self.task.observation_space
        self.action_space = self.task.action_space
        self.episode: Episode | None = None
        self.episodes_started = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self.task.sampler.seed(seed)
            self.episodes_started = 0
        problem_id = (options or {}).get("problem_id")
        problem = self.task.sampler.get(problem_id) if problem_id is not None else self.task.sampler.draw()
        self.episode = self.task.new_episode(problem, group_id=self.episodes_started)
        self.episodes_started += 1
        info = {**self.task.info(self.episode), FACTS: self.task.facts([self.episode], [True])}
        return self.task.observation(self.episode), info

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.episode is None:
            raise RuntimeError("call reset() before step()")
        transition = self.task.apply(self.episode, action)
        self.task.run_tools([self.episode], [transition])
        scores = self.task.score([self.episode], [transition])
        self.episode.return_so_far += float(scores.rewards[0])
        info = self.task.info(self.episode)
        info[FACTS] = self.task.facts([self.episode], [not self.episode.done], rewards=scores.rewards[:, None],
                                      return_so_far=np.array([[self.episode.return_so_far]]), correct=scores.correct,
                                      answers=scores.answers,
                                      sources={name: values[:, None] for name, values in scores.sources.items()},
                                      clipped=np.array([[transition.action_clipped]]),
                                      tool_called=(np.array([[transition.tool_code is not None]])
                                                   if self.task.tools != Tool.NONE else None))
        info.update({f"reward/{name}": float(values[0]) for name, values in scores.sources.items()})
        if self.task.mode == ActionLevel.STEP:
            info["action_clipped"] = transition.action_clipped
        if self.episode.done:
            info["correct"] = bool(scores.correct[0])
        return (self.task.observation(self.episode), float(scores.rewards[0]), transition.terminated,
                transition.truncated, info)

    def render(self) -> str | None:
        if self.render_mode == "ansi" and self.episode is not None:
            return self.task.observation(self.episode)
        return None

    def close(self) -> None:
        self.task.close()
