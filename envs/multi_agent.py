"""MultiAgentMathVectorEnv: N math episodes, each a multi-agent workflow (``envs.workflows``: the
solver -> verifier -> refiner chain, a debate, Prefix-RL's writer and solver, or your own) on one
problem, every answer of a step graded in one time-bounded batch.

The env keeps the ``envs.contract`` with A = the workflow's roles, one agent slot each: observations
are N tuples of A prompts ("" where a slot does not act next), actions N sequences of A messages (a
message longer than ``max_step_chars`` is clipped), rewards [N, A], terminated / truncated [N] (the
workflow ended the episode / ``max_steps`` turns or ``max_solution_chars`` characters cut it).

Rewards come from ``reward_model``'s sources (``--reward``; default: "outcome" alone), combined by
``envs.rewards.RewardMixture.combine`` as on the single-agent env:

- "outcome" is the verified outcome, credited (``envs.credit``) by ``reward_assignment``: ``team``, the final answer's
  verdict (1/0) to every slot that acted in the episode; ``individual``, each message's own verified
  output (an answer's verdict; a judge's verdict agreeing with the truth; a role with neither gets the
  team outcome); ``counterfactual``, the team outcome minus that of ``Workflow.replay`` with the slot's
  messages replaced by its role's default. Credit that needs the outcome is paid at the episode's end
  step to every slot that acted, whether it acts then or not (a trainer adds it to the slot's last action);
- every other source scores each answering role's message as one finished solution
  (``StepContext(problem, (), Workflow.solution_of(...), done=True)``, as the single-agent env scores a
  whole-solution action), all of a step's solutions in one call per source; verdicts get none.

Grading: a step first collects every comparison it needs (new answers, the answers new verdicts judge,
the final answers of ended episodes and their counterfactuals, a vote's candidates pairwise), then decides
them in ONE ``envs.grader.grade_batch`` call, each bounded by ``grade_timeout`` seconds.

Infos: ``info[FACTS]`` (``StepFacts``: ``states`` is the joint transcript a centralized critic reads,
``outputs`` each slot's verified output, ``ROLE_METRICS``), and the same facts as plain arrays:
``problem_id``, ``group_id``, ``turn`` [N], ``acting``, ``state`` [N, A], ``roles`` [A] and, from
``step``, ``correct`` [N], ``final_answer`` [N] object, ``action_clipped`` [N, A], ``reward/<source>`` and
each of ``ROLE_METRICS`` [N, A] (NaN where none): ``answer_correct``, ``verdict`` (1 accept, 0 reject or
unparseable), ``verdict_correct``, and split by the truth so that a mean is a rate, ``verdict_precision``,
``verdict_recall``, ``verdict_specificity``, ``fix_rate`` and ``keep_rate`` (a revising answer right,
where the judged one was wrong / right), and in a vote's ended episodes ``agrees_with_vote`` (a voter's
answer is in the winning group: debaters whose answers collapse into one read 1 each). SAME_STEP autoreset
adds gymnasium's ``final_obs``, ``final_info`` and their masks.

Tree rollouts (``rollout_mode="tree"``, PettingLLMs' for AT-GRPO): after every step, the envs of a group whose
episodes go on at the same turn all continue from the one whose messages of that step earned the most (their
rewards summed over its slots; a tie goes to the first), each keeping its own return so far. Every later action
of the group then answers one same prompt, so a role's actions at a turn of a group are a true GRPO group (in
independent episodes a debater's second-round prompts differ with what the others said in the first).

Problems and groups are MathVectorEnv's: a MathVectorEnv that never steps, the ``problem_env``, draws them,
and its state travels in ``get_state``. Autoreset: ``SAME_STEP`` (default) or ``DISABLED``; ``NEXT_STEP`` is
refused (every slot of a resetting env would generate a message only to throw it away).
"""

from __future__ import annotations

from typing import Any, Sequence

import dataclasses

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from envs.contract import FACTS, Agents, StepFacts
from envs.credit import Credit, MessageRef
from envs.datasets import Problem
from envs.math_env import UnicodeText, renamed_state_keys
from envs.modes import ActionLevel, RewardAssignment, RolloutMode, member_of
from envs.rewards import OutcomeReward, RewardMixture, RewardModel, StepContext, score_batch
from envs.vector import MathVectorEnv
from envs.workflows import (WORKFLOWS, Dialogue, DialogueLimits, Message, TurnContext, Workflow, resolve_workflow,
                            state_prompt)

ROLE_METRICS = ("answer_correct", "verdict", "verdict_correct", "verdict_precision", "verdict_recall",
                "verdict_specificity", "fix_rate", "keep_rate",
                "agrees_with_vote")  # the [N, A] infos of each role's verified output
AUTORESET_MODES = (AutoresetMode.SAME_STEP, AutoresetMode.DISABLED)
SINGLE_AGENT_KEYWORDS = {  # MathTask keywords that mean nothing for whole messages: why, and what instead
    "handoff_steps": "Prefix-RL is the workflow='prefix' here",
    "end_marker": "an action is a whole message, so a message ends where the generator stops",
    "tools": "a role's code blocks are not run between messages; the single-agent MATH-Tool-v0 and Arith-Tool-v0 "
             "run them",
}

def check_task_keywords(task_kwargs: dict[str, Any]) -> None:
    """Refuses, saying why, the MathTask keywords a multi-agent env cannot honour."""
    if task_kwargs.get("mode", ActionLevel.STEP) != ActionLevel.STEP:
        raise ValueError(f"mode={task_kwargs['mode']!r}: MultiAgentMathVectorEnv takes whole messages as actions; "
                         "leave mode out (or 'step')")
    for key, why in SINGLE_AGENT_KEYWORDS.items():
        if task_kwargs.get(key) is not None:
            raise ValueError(f"{key}= is not supported by MultiAgentMathVectorEnv ({why}); leave it out")


def check_actions(actions: Sequence[Sequence[Any]], num_envs: int, roles: tuple[str, ...],
                  acting_slots: dict[int, Sequence[int]]) -> None:
    """Fails before any message is taken, so that a bad action leaves every episode as it was: ``actions``
    must be ``num_envs`` rows of one message per role, a str for each of ``acting_slots`` {env: slots}."""
    if len(actions) != num_envs:
        raise ValueError(f"got {len(actions)} actions for {num_envs} envs; give one sequence of "
                         f"{len(roles)} messages per env")
    for i, row in enumerate(actions):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__") or len(row) != len(roles):
            raise ValueError(f"actions[{i}] must be a sequence of {len(roles)} messages, one per slot "
                             f"{roles}; got {type(row).__name__}"
                             + (f" of length {len(row)}" if hasattr(row, "__len__") else ""))
    for i, slots in acting_slots.items():
        for slot in slots:
            if not isinstance(actions[i][slot], str):
                raise TypeError(f"actions[{i}][{slot}] ({roles[slot]}'s message) must be a str, got "
                                f"{type(actions[i][slot]).__name__}")


def resolve_autoreset_mode(autoreset_mode: AutoresetMode | str) -> AutoresetMode:
    """``autoreset_mode`` (an ``AUTORESET_MODES`` member or its value) as the member."""
    supported = {mode: mode for mode in AUTORESET_MODES} | {mode.value: mode for mode in AUTORESET_MODES}
    if autoreset_mode not in supported:
        raise ValueError(f"autoreset_mode={autoreset_mode!r} is not supported; use AutoresetMode.SAME_STEP or "
                         "AutoresetMode.DISABLED ('SameStep', 'Disabled'). NEXT_STEP would have every slot of a "
                         "resetting env generate a message only to discard it")
    return supported[autoreset_mode]


def saved_return_so_far(state: dict[str, Any]) -> list[list[float]]:
    """[N][A] the slots' returns so far in a ``get_state`` (its keys renamed: ``renamed_state_keys``); zeros in a
    state without them (its episodes are replaced before a trainer steps them: multi-agent rollouts are whole
    episodes)."""
    return state.get("return_so_far", [[0.0] * len(state["roles"])] * len(state["transcripts"]))


class MultiAgentMathVectorEnv(VectorEnv):
    """``num_envs`` episodes of ``workflow`` (a ``Workflow`` or a built-in's name: "chain", "debate",
    "prefix"). ``group_size``, ``group_offset``, ``total_groups`` as MathVectorEnv's; ``rollout_mode``
    "independent" or "tree" (the module docstring); the other keywords
    build the shared ``MathTask`` (problem source, template, limits: see ``envs.math_env.MathTask``).
    ``grade_timeout``: seconds the grader may spend on one comparison. ``reward_model``: a ``RewardModel`` or
    a ``RewardMixture`` of sources (None: "outcome" alone), its "outcome" source the ``reward_assignment``
    credit. Shapes, credit, rewards and infos: see the module docstring."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": []}

    def __init__(
        self,
        num_envs: int,
        group_size: int = 1,
        autoreset_mode: AutoresetMode | str = AutoresetMode.SAME_STEP,
        group_offset: int = 0,
        total_groups: int | None = None,
        workflow: Workflow | str = "chain",
        reward_assignment: RewardAssignment | str = RewardAssignment.TEAM,
        grade_timeout: float = 1.0,
        reward_model: RewardModel | None = None,
        rollout_mode: RolloutMode | str = RolloutMode.INDEPENDENT,
        **task_kwargs: Any,
    ):
        self.autoreset_mode = resolve_autoreset_mode(autoreset_mode)
        reward_assignment = member_of(tuple(RewardAssignment), reward_assignment, "reward_assignment")
        self.rollout_mode = member_of(tuple(RolloutMode), rollout_mode, "rollout_mode")
        if not grade_timeout > 0:
            raise ValueError(f"grade_timeout={grade_timeout!r} must be > 0 seconds")
        if reward_model is not None and not isinstance(reward_model, RewardModel):
            raise TypeError(f"reward_model={reward_model!r:.100} has no name and score(contexts); pass an "
                            "envs.rewards.RewardModel (e.g. envs.rewards.RewardMixture) or None")
        check_task_keywords(task_kwargs)
        self.workflow = resolve_workflow(workflow)
        self.grade_timeout = grade_timeout
        self.reward = RewardMixture.of(reward_model if reward_model is not None else OutcomeReward())
        self.problem_env = MathVectorEnv(num_envs, group_size, AutoresetMode.DISABLED, group_offset, total_groups,
                                         **task_kwargs)
        self.task = self.problem_env.task
        self.limits = DialogueLimits(max_turns=min(self.task.max_steps, self.workflow.max_turns or self.task.max_steps),
                                     max_chars=self.task.max_solution_chars)
        self.credit = Credit(self.workflow, reward_assignment, self.task.template, self.limits)
        self.metadata = {**self.metadata, "autoreset_mode": self.autoreset_mode}
        self.num_envs, self.group_size = num_envs, group_size
        self.roles = self.workflow.role_names
        self.num_agents = len(self.roles)
        self.agents = Agents(self.roles, tuple(role.trainable for role in self.workflow.roles))
        self.single_observation_space = spaces.Tuple([UnicodeText(self._longest_prompt())] * self.num_agents)
        self.single_action_space = spaces.Tuple([UnicodeText(self.task.max_step_chars)] * self.num_agents)
        self.observation_space = spaces.Tuple([self.single_observation_space] * num_envs)
        self.action_space = spaces.Tuple([self.single_action_space] * num_envs)
        self.dialogues: list[Dialogue] = []

    @property
    def problems(self) -> list[Problem]:
        """The env's problems (the ``problem_env``'s)."""
        return self.problem_env.problems

    def _longest_prompt(self) -> int:
        """A bound on a built-in prompt's length: the longest problem prompt, the longest instruction and
        every message the turn limit allows, each under its role's name."""
        roles = self.workflow.roles
        per_message = self.task.max_step_chars + max(len(role.name) for role in roles) + 6
        longest_problem = max(len(self.task.prompt(problem)) for problem in self.problems)
        longest_instruction = max(len(role.instruction) for role in roles) + 2
        return longest_problem + longest_instruction + self.limits.max_turns * len(roles) * per_message

    def reset(self, *, seed: int | None = None,
              options: dict | None = None) -> tuple[tuple[tuple[str, ...], ...], dict[str, Any]]:
        """Starts a new episode in every env, or only where ``options["reset_mask"]`` [N] is True (whole
        groups); ``options["problem_ids"]`` gives one problem id per group instead of drawing (as
        MathVectorEnv.reset)."""
        super().reset(seed=seed)
        if seed is not None:
            self.action_space.seed(seed)
        self.problem_env.reset(seed=seed, options=options)
        mask = np.asarray((options or {}).get("reset_mask", np.ones(self.num_envs, dtype=bool)), dtype=bool)
        if mask.all():
            self.dialogues = [None] * self.num_envs
        for i in np.flatnonzero(mask):
            self.dialogues[i] = self._new_dialogue(int(i))
        return self._observations(), self._info(self._facts())

    def step(self, actions: Sequence[Sequence[Any]]) -> tuple[tuple[tuple[str, ...], ...], np.ndarray, np.ndarray,
                                                              np.ndarray, dict[str, Any]]:
        """Takes each acting slot's message; returns observations, rewards [N, A], terminated [N],
        truncated [N] and info. Envs whose episode ended (DISABLED autoreset) ignore their actions."""
        live = [i for i, dialogue in enumerate(self.dialogues) if not dialogue.progress.ended]
        check_actions(actions, self.num_envs, self.roles, {i: self.dialogues[i].progress.slots for i in live})
        clipped = np.zeros((self.num_envs, self.num_agents), dtype=bool)
        first_new = {}  # env -> index of its first message of this step
        for i in live:
            first_new[i] = len(self.dialogues[i].transcript)
            clipped[i] = self._say(i, actions[i])
        results = self._score(first_new)
        results["clipped"] = clipped
        for dialogue, rewards in zip(self.dialogues, results["rewards"]):
            dialogue.return_so_far += rewards
        # before an autoreset replaces them
        results["return_so_far"] = np.array([dialogue.return_so_far for dialogue in self.dialogues])
        terminated = np.array([i in first_new and d.progress.terminated for i, d in enumerate(self.dialogues)])
        truncated = np.array([i in first_new and d.progress.truncated for i, d in enumerate(self.dialogues)])
        ended = terminated | truncated
        if self.rollout_mode is RolloutMode.TREE:
            self._branch(first_new, results["rewards"])
        final = self._restart(ended) if self.autoreset_mode == AutoresetMode.SAME_STEP and ended.any() else {}
        facts = self._facts(**results)
        info = {**self._info(facts, stepped=True), **final}
        return self._observations(), facts.rewards, terminated, truncated, info

    def _say(self, env_index: int, messages: Sequence[str]) -> np.ndarray:
        """Appends the acting slots' messages (clipped) to env ``env_index``'s transcript; returns which
        slots' messages were clipped [A]."""
        dialogue, limit = self.dialogues[env_index], self.task.max_step_chars
        clipped = np.zeros(self.num_agents, dtype=bool)
        for slot in dialogue.progress.slots:
            clipped[slot] = len(messages[slot]) > limit
            text = messages[slot][:limit].strip()
            dialogue.transcript.append(Message(dialogue.progress.turn, slot, self.roles[slot], text))
        dialogue.progress = self.workflow.progress(dialogue.transcript, self.limits)
        return clipped

    def _score(self, first_new: dict[int, int]) -> dict[str, Any]:
        """The ``StepFacts`` fields of the messages from ``first_new`` on (but ``clipped``), ``answers`` the final
        answer [N] of each episode that ended, all comparisons decided in one grading call (``envs.credit``); the
        rewards [N, A] are every reward source's, combined by the mixture."""
        new_messages = [(i, index) for i, start in first_new.items()
                        for index in range(start, len(self.dialogues[i].transcript))]
        ended = [i for i in first_new if self.dialogues[i].progress.ended]
        credit = self.credit.step(self.dialogues, new_messages, ended, self.grade_timeout)
        source_rewards, sources = self._solution_sources(new_messages)
        if "outcome" in self.reward.weights:
            source_rewards["outcome"] = credit.rewards
            sources["outcome"] = np.where(credit.credited, credit.rewards, np.nan)
        return {"rewards": self.reward.combine(source_rewards), "sources": sources, "correct": credit.correct,
                "answers": credit.final_answers, "outputs": credit.outputs}

    def _solution_sources(self, new_messages: list[MessageRef]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every reward source but "outcome" on the solution messages among ``new_messages`` (answering roles'),
        each scoring all of them in one call: its rewards {source: [N, A]} (0 where a slot said no solution)
        and what each reported {name: [N, A]} (the ``StepFacts.sources``), NaN where a slot said no solution."""
        shape = (self.num_envs, self.num_agents)
        models = {name: model for name, model in self.reward.models.items() if name != "outcome"}
        source_rewards = {name: np.zeros(shape) for name in models}
        solutions = [(i, index) for i, index in new_messages
                     if self.workflow.roles[self.dialogues[i].transcript[index].slot].answers]
        if not solutions:
            return source_rewards, {}
        contexts = [self._solution_context(i, index) for i, index in solutions]
        envs = [i for i, _ in solutions]
        slots = [self.dialogues[i].transcript[index].slot for i, index in solutions]
        sources = {}
        for name, model in models.items():
            output = score_batch(model, contexts)
            source_rewards[name][envs, slots] = output.rewards
            reported = dict(output.sources)
            reported.setdefault(name, output.rewards)
            for key, values in reported.items():
                sources[key] = np.full(shape, np.nan)
                sources[key][envs, slots] = values
        return source_rewards, sources

    def _solution_context(self, env_index: int, index: int) -> StepContext:
        """Message ``index`` of env ``env_index`` as one finished solution, as the single-agent env gives a
        solution-level action at its episode's end."""
        dialogue = self.dialogues[env_index]
        return StepContext(dialogue.problem, (), self.workflow.solution_of(dialogue.transcript, index), done=True,
                           group_id=dialogue.group_id)

    def _branch(self, stepped: Sequence[int], rewards: np.ndarray) -> None:
        """Tree rollouts: the envs ``stepped`` whose episodes go on, by group and turn, continue from the one
        whose messages of this step earned the most (``rewards`` [N, A] summed over its slots; a tie: the first),
        each keeping its own return so far."""
        going_on: dict[tuple[int, int], list[int]] = {}
        for i in stepped:
            dialogue = self.dialogues[i]
            if not dialogue.progress.ended:
                going_on.setdefault((dialogue.group_id, dialogue.progress.turn), []).append(i)
        for members in going_on.values():
            best = self.dialogues[members[int(np.argmax(rewards[members].sum(1)))]]
            for i in members:
                self.dialogues[i] = dataclasses.replace(best, transcript=list(best.transcript),
                                                        return_so_far=self.dialogues[i].return_so_far)

    def _restart(self, ended: np.ndarray) -> dict[str, Any]:
        """SAME_STEP autoreset: starts the next episode of every ``ended`` env; returns gymnasium's
        ``final_obs`` and ``final_info`` (the ended episodes' metadata) with their masks."""
        final_obs = np.full(self.num_envs, None, dtype=object)
        for i in np.flatnonzero(ended):
            final_obs[i] = self._prompts(self.dialogues[i], self.dialogues[i].progress.slots)
        final = {"final_obs": final_obs, "_final_obs": ended.copy(), "final_info": self._info(self._facts()),
                 "_final_info": ended.copy()}
        for i in np.flatnonzero(ended):
            # the problem_env's own per-env draw (what its autoreset runs): the members of a group that finish
            # at different times still get the group's same next problem
            self.problem_env.episodes[i] = self.problem_env._start_episode(int(i))
            self.dialogues[i] = self._new_dialogue(int(i))
        return final

    def _new_dialogue(self, env_index: int) -> Dialogue:
        episode = self.problem_env.episodes[env_index]
        return Dialogue(episode.problem, episode.group_id, [], self.workflow.progress((), self.limits),
                        np.zeros(self.num_agents))

    def _prompts(self, dialogue: Dialogue, slots: Sequence[int]) -> tuple[str, ...]:
        """[A] the prompts of ``slots`` ("" for the other slots)."""
        prompts = [""] * self.num_agents
        earlier = tuple(dialogue.transcript)
        for slot in slots:
            context = TurnContext(dialogue.problem.problem, self.task.template, earlier, slot, dialogue.progress.turn)
            prompts[slot] = self.workflow.roles[slot].build_prompt(context)
        return tuple(prompts)

    def _observations(self) -> tuple[tuple[str, ...], ...]:
        return tuple(self._prompts(d, () if d.progress.ended else d.progress.slots) for d in self.dialogues)

    def _states(self) -> np.ndarray:
        """[N, A] object: the centralized critic's view before each acting slot acts ("" elsewhere)."""
        states = np.full((self.num_envs, self.num_agents), "", dtype=object)
        for i, dialogue in enumerate(self.dialogues):
            if dialogue.progress.ended:
                continue
            for slot in dialogue.progress.slots:
                context = TurnContext(dialogue.problem.problem, self.task.template, tuple(dialogue.transcript), slot,
                                      dialogue.progress.turn)
                states[i, slot] = state_prompt(self.workflow.roles[slot], context)
        return states

    def _facts(self, **results: Any) -> StepFacts:
        """The facts of the episodes now running and ``results``, the ``StepFacts`` fields of the messages just
        taken (none: a reset's)."""
        acting = np.zeros((self.num_envs, self.num_agents), dtype=bool)
        for i, dialogue in enumerate(self.dialogues):
            if not dialogue.progress.ended:
                acting[i, list(dialogue.progress.slots)] = True
        return StepFacts(problem_ids=np.array([d.problem.id for d in self.dialogues], dtype=object),
                         group_ids=np.array([d.group_id for d in self.dialogues], dtype=np.int64),
                         turns=np.array([d.progress.turn for d in self.dialogues], dtype=np.int64),
                         acting=acting, states=self._states(), **results)

    def _info(self, facts: StepFacts, stepped: bool = False) -> dict[str, Any]:
        """``facts`` under ``FACTS``, and as the plain arrays the module docstring lists (the results of the
        messages only when ``stepped``)."""
        info = {FACTS: facts, "problem_id": facts.problem_ids, "group_id": facts.group_ids, "turn": facts.turns,
                "acting": facts.acting, "state": facts.states, "roles": self.roles}
        if stepped:
            info.update(correct=facts.correct, final_answer=facts.answers, action_clipped=facts.clipped,
                        **facts.outputs)
            info.update({f"reward/{name}": values for name, values in facts.sources.items()})
        return info

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable: the workflow's name and roles, the ``problem_env``'s state (problem sampler, each
        env's problem and group, group bookkeeping), every env's transcript as [turn, slot, text] and its
        slots' returns so far."""
        return {"workflow": self.workflow.name, "roles": list(self.roles), "draws": self.problem_env.get_state(),
                "transcripts": [[[m.turn, m.slot, m.text] for m in d.transcript] for d in self.dialogues],
                "return_so_far": [d.return_so_far.tolist() for d in self.dialogues]}

    def set_state(self, state: dict[str, Any]) -> tuple[tuple[tuple[str, ...], ...], dict]:
        """Continues exactly where ``get_state`` was called (same workflow, problems, ``num_envs`` and
        ``group_size``), or where an older build's ``get_state`` was called (``renamed_state_keys``); returns the
        observations and metadata of the restored episodes."""
        state = renamed_state_keys(state)
        if (state["workflow"], list(state["roles"])) != (self.workflow.name, list(self.roles)):
            raise ValueError(f"the saved env state is of workflow {state['workflow']!r} with roles {state['roles']}, "
                             f"this env runs {self.workflow.name!r} with {list(self.roles)}; restore it into an env of "
                             "the same workflow")
        self.problem_env.set_state(state["draws"])
        self.dialogues = []
        for episode, transcript, return_so_far in zip(self.problem_env.episodes, state["transcripts"],
                                                      saved_return_so_far(state)):
            messages = [Message(turn, slot, self.roles[slot], text) for turn, slot, text in transcript]
            self.dialogues.append(Dialogue(episode.problem, episode.group_id, messages,
                                           self.workflow.progress(messages, self.limits), np.array(return_so_far)))
        return self._observations(), self._info(self._facts())

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """One state of all the envs from the ``get_state`` of consecutive shards (MathVectorEnv.merge_states)."""
        return {**states[0], "draws": MathVectorEnv.merge_states([state["draws"] for state in states]),
                **{key: [item for state in states for item in state[key]] for key in ("transcripts", "return_so_far")}}

    @staticmethod
    def split_state(state: dict[str, Any], group_offset: int, num_groups: int) -> dict[str, Any]:
        """The state of the shard of ``num_groups`` groups from ``group_offset`` (inverse of ``merge_states``)."""
        state = renamed_state_keys(state)
        group_size = state["draws"]["group_size"]
        envs = slice(group_offset * group_size, (group_offset + num_groups) * group_size)
        return {**state, "draws": MathVectorEnv.split_state(state["draws"], group_offset, num_groups),
                "transcripts": state["transcripts"][envs], "return_so_far": saved_return_so_far(state)[envs]}


class MultiAgentMathEnv(gymnasium.Env):
    """One episode at a time: a ``MultiAgentMathVectorEnv`` of one env (autoreset off) seen through its one
    slot tuple. Observation: A prompts; action: A messages; reward: float64 [A]; info: the vector
    env's arrays at this env (``acting`` [A], ``roles``). ``reset(options={"problem_id": ...})`` picks
    the problem. Keywords as the vector env's."""

    metadata = {"render_modes": []}

    def __init__(self, **kwargs: Any):
        self.vector_env = MultiAgentMathVectorEnv(num_envs=1, autoreset_mode=AutoresetMode.DISABLED, **kwargs)
        self.observation_space = self.vector_env.single_observation_space
        self.action_space = self.vector_env.single_action_space

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[tuple[str, ...], dict[str, Any]]:
        super().reset(seed=seed)
        problem_id = (options or {}).get("problem_id")
        options = None if problem_id is None else {"problem_ids": [problem_id]}
        obs, info = self.vector_env.reset(seed=seed, options=options)
        return obs[0], self._first(info)

    def step(self, action: Sequence[str]) -> tuple[tuple[str, ...], np.ndarray, bool, bool, dict[str, Any]]:
        obs, rewards, terminated, truncated, info = self.vector_env.step([action])
        return obs[0], rewards[0], bool(terminated[0]), bool(truncated[0]), self._first(info)

    @staticmethod
    def _first(info: dict[str, Any]) -> dict[str, Any]:
        return {key: value if key in ("roles", FACTS) else value[0] for key, value in info.items()}


def register_builtin() -> None:
    """Registers ``Arith-Chain-v0``, ``Arith-Debate-v0``, ``Arith-Prefix-v0`` and the same three ``MATH-*``
    ids (idempotent). Each family takes its single-agent id's registered keywords (Arith's problem knobs and
    limits, MATH's bundled MATH-500), so ``envs`` must have registered ``Arith-v0`` and ``MATH-v0`` first."""
    if "Arith-v0" not in gymnasium.registry or "MATH-v0" not in gymnasium.registry:
        raise RuntimeError("register_builtin() reads Arith-v0's and MATH-v0's keywords: call it after envs "
                           "registers them")
    families = {family: gymnasium.spec(f"{family}-v0").kwargs for family in ("Arith", "MATH")}
    for family, kwargs in families.items():
        for name in WORKFLOWS:
            env_id = f"{family}-{name.capitalize()}-v0"
            if env_id not in gymnasium.registry:
                gymnasium.register(env_id, entry_point="envs.multi_agent:MultiAgentMathEnv",
                                   vector_entry_point="envs.multi_agent:MultiAgentMathVectorEnv",
                                   kwargs={**kwargs, "workflow": name})
