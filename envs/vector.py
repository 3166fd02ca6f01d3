"""MathVectorEnv: N math episodes stepped together, every completed step scored in ONE batched
reward-model call (where a PRM or a target solver gets its speed). It keeps the ``envs.contract``
with one agent slot: each step's ``StepFacts`` hold rewards [N, 1].

Groups: with ``group_size=k`` the envs ``[g*k, (g+1)*k)`` form group g and always work on the same
problem (GRPO and RLOO compare samples within a group). When a member finishes, its next episode
takes the group's next problem: the j-th episode of every member of group g is the same problem,
drawn once from the shared sampler (without replacement per epoch, reproducible per seed), and
carries the same ``group_id`` (unique across the run).

Split over processes (data parallelism), each process holds ``num_envs`` of the ``total_groups`` groups,
starting at global group ``group_offset``; group g's d-th draw is the sampler's position
``d * total_groups + g`` and that position is its ``group_id``, so every process sees the problems and
ids that one process holding all the groups would.

Autoreset follows gymnasium 1.x ``AutoresetMode``: ``NEXT_STEP`` (gymnasium's default: the step
after an episode ends resets that env and ignores its action), ``SAME_STEP`` (the ending step
already returns the next episode's first observation; the final observation and the ended
episode's metadata are in ``info["final_obs"]`` / ``info["final_info"]``, masked by
``info["_final_obs"]`` / ``info["_final_info"]``), or ``DISABLED``
(a finished env stays finished, its actions ignored with reward 0, until
``reset(options={"reset_mask": mask})`` or a full reset: one episode per env, as GRPO wants).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from envs.contract import FACTS, Agents, StepFacts
from envs.math_env import Episode, MathTask
from envs.modes import ActionLevel, Tool


class MathVectorEnv(VectorEnv):
    """``num_envs`` MATH episodes; extra keyword arguments build the shared ``MathTask``
    (problem source, mode, tokenizer, reward model, limits: see ``envs.math_env.MathTask``).

    Observations are a tuple of N strings; actions a sequence of N strings (step mode) or an
    int array [N] (token mode); rewards [N] (``info[FACTS].rewards`` [N, 1]: ``envs.contract``). Infos
    are a plain dict: ``info[FACTS]``, the ``StepFacts`` a trainer reads (one agent slot, never role
    metrics or critic states), and the same facts as full [N] arrays, without ``_key`` masks:

    - the episode whose observation is returned: ``problem_id`` (object), ``group_id``, ``step`` (int64);
    - from ``step`` only (``reset`` and ``set_state`` return the metadata alone), the results of the
      action just taken: ``correct`` (float64, 1.0 / 0.0 where an episode ended at this step, NaN
      elsewhere), ``final_answer`` (object: the answer it judged, None where none), ``reward/<source>``
      (float64, every source the reward model reported, NaN
      where no step was scored) and, in step mode, ``action_clipped`` (bool) and, with a tool,
      ``tool_called`` (bool: the action was a tool call, run; ``facts.tool_called[:, 0]``);
    - SAME_STEP autoreset: gymnasium's ``final_obs`` / ``_final_obs`` and ``final_info`` /
      ``_final_info``, where ``final_info`` holds the ended episodes' metadata arrays (their
      ``correct`` and ``reward/*`` are the top-level arrays already).
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(
        self,
        num_envs: int,
        group_size: int = 1,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        group_offset: int = 0,
        total_groups: int | None = None,
        **task_kwargs: Any,
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs} must be >= 1")
        if group_size < 1 or num_envs % group_size:
            raise ValueError(f"group_size={group_size} must be >= 1 and divide num_envs={num_envs}")
        total_groups = num_envs // group_size if total_groups is None else total_groups
        if not 0 <= group_offset <= total_groups - num_envs // group_size:
            raise ValueError(f"groups [{group_offset}, {group_offset + num_envs // group_size}) do not fit in "
                             f"total_groups={total_groups}")
        self.group_offset, self.total_groups = group_offset, total_groups
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.metadata = {**self.metadata, "autoreset_mode": self.autoreset_mode}
        self.num_envs = num_envs
        self.group_size = group_size
        self.task = MathTask(**task_kwargs)
        self.agents = Agents()
        self.single_observation_space = self.task.observation_space
        self.single_action_space = self.task.action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.episodes: list[Episode] = []
        self.episode_counts = np.zeros(num_envs, dtype=np.int64)  # episodes started per env
        self.group_draws: dict[tuple[int, int], list] = {}  # (group, j) -> [problem, group_id, members left]
        self.draws_made = np.zeros(num_envs // group_size, dtype=np.int64)  # problems each group has drawn
        self.needs_reset = np.zeros(num_envs, dtype=bool)  # ended, not reset yet (NEXT_STEP, DISABLED)

    @property
    def problems(self) -> list:
        return self.task.sampler.problems

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[tuple[str, ...], dict]:
        """Starts a new episode in every env, or only where ``options["reset_mask"]`` [N] is True
        (whole groups; the others keep their episodes). ``options={"problem_ids": [...]}`` gives one
        problem id per group (num_envs // group_size of them) instead of drawing."""
        super().reset(seed=seed)
        if seed is not None:
            self.task.sampler.seed(seed)
            self.action_space.seed(seed)
            self.draws_made[:] = 0
        options = options or {}
        problem_ids = options.get("problem_ids")
        num_groups = self.num_envs // self.group_size
        if problem_ids is not None and len(problem_ids) != num_groups:
            raise ValueError(f"options['problem_ids'] has {len(problem_ids)} ids; give one per group ({num_groups})")
        mask = np.asarray(options.get("reset_mask", np.ones(self.num_envs, dtype=bool)), dtype=bool)
        if mask.shape != (self.num_envs,) or not (mask.reshape(num_groups, self.group_size).all(1)
                                                  == mask.reshape(num_groups, self.group_size).any(1)).all():
            raise ValueError(f"options['reset_mask'] must be {self.num_envs} booleans covering whole groups of "
                             f"{self.group_size}")
        if mask.all():
            self.episode_counts[:] = 0
            self.group_draws.clear()
            self.episodes = [None] * self.num_envs
        for i in np.flatnonzero(mask):
            self.episodes[i] = self._start_episode(i, problem_ids)
        self.needs_reset[mask] = False
        return self._observations(), self._info(self._facts())

    def step(self, actions: Sequence[Any]) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, dict]:
        if len(actions) != self.num_envs:
            raise ValueError(f"got {len(actions)} actions for {self.num_envs} envs")
        acting = np.flatnonzero(~self.needs_reset)
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:  # this step resets, its action is ignored
            for i in np.flatnonzero(self.needs_reset):
                self.episodes[i] = self._start_episode(i)
        results, terminated, truncated = self._act(actions, acting)
        ended = terminated | truncated
        final = {}
        if self.autoreset_mode == AutoresetMode.DISABLED:
            self.needs_reset |= ended
        elif self.autoreset_mode == AutoresetMode.NEXT_STEP:
            self.needs_reset = ended
        elif ended.any():
            final = self._restart(ended)
        facts = self._facts(**results)
        info = {**self._info(facts, stepped=True), **final}
        return self._observations(), facts.rewards[:, 0], terminated, truncated, info

    def _act(self, actions: Sequence[Any], acting: np.ndarray) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        """Applies the actions of the ``acting`` envs, runs their tool calls in one batch and scores them in one
        reward-model call. Returns the
        ``StepFacts`` fields of the results (rewards, return_so_far, sources [N, 1], correct [N], clipped [N, 1],
        answers [N], with a tool tool_called [N, 1]; 0 / NaN / False for the envs that did not act), terminated
        and truncated [N]."""
        terminated, truncated, clipped, called = (np.zeros(self.num_envs, dtype=bool) for _ in range(4))
        transitions = []
        for i in acting:
            transition = self.task.apply(self.episodes[i], actions[i])
            terminated[i], truncated[i] = transition.terminated, transition.truncated
            clipped[i], called[i] = transition.action_clipped, transition.tool_code is not None
            transitions.append(transition)
        self.task.run_tools([self.episodes[i] for i in acting], transitions)
        scores = self.task.score([self.episodes[i] for i in acting], transitions)
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        rewards[acting] = scores.rewards
        for episode, reward in zip(self.episodes, rewards):
            episode.return_so_far += float(reward)
        # before an autoreset replaces them
        return_so_far = np.array([[episode.return_so_far] for episode in self.episodes])
        sources = {name: self._spread(values, acting)[:, None] for name, values in scores.sources.items()}
        answers = np.full(self.num_envs, None, dtype=object)
        answers[acting] = scores.answers
        results = {"rewards": rewards[:, None], "return_so_far": return_so_far, "sources": sources,
                   "correct": self._spread(scores.correct, acting), "clipped": clipped[:, None], "answers": answers}
        if self.task.tools != Tool.NONE:
            results["tool_called"] = called[:, None]
        return results, terminated, truncated

    def _restart(self, ended: np.ndarray) -> dict[str, Any]:
        """SAME_STEP autoreset: starts the next episode of every ``ended`` env; returns gymnasium's
        ``final_obs`` and ``final_info`` (the ended episodes' metadata) with their masks."""
        final = {"final_obs": np.array([self.task.observation(e) if end else None
                                        for e, end in zip(self.episodes, ended)], dtype=object),
                 "_final_obs": ended.copy(), "final_info": self._info(self._facts()), "_final_info": ended.copy()}
        for i in np.flatnonzero(ended):
            self.episodes[i] = self._start_episode(i)
        return final

    def close_extras(self, **kwargs: Any) -> None:
        """Stops the task's tool sandbox (``gymnasium.vector.VectorEnv.close`` calls this once)."""
        self.task.close()

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state of everything ``step`` and ``reset`` will read: the problem
        sampler, the episodes in progress and the group bookkeeping (checkpoints save it)."""
        return {
            "num_envs": self.num_envs,
            "group_size": self.group_size,
            "sampler": self.task.sampler.get_state(),
            "episodes": [episode.get_state() for episode in self.episodes],
            "episode_counts": self.episode_counts.tolist(),
            "group_draws": [[group, j, problem.id, group_id, left]
                            for (group, j), (problem, group_id, left) in self.group_draws.items()],
            "draws_made": self.draws_made.tolist(),
            "needs_reset": self.needs_reset.tolist(),
        }

    def set_state(self, state: dict[str, Any]) -> tuple[tuple[str, ...], dict]:
        """Continues exactly where ``get_state`` was called (same problems, ``num_envs`` and
        ``group_size``); returns the observations and infos of the restored episodes, as ``reset`` does."""
        if (state["num_envs"], state["group_size"]) != (self.num_envs, self.group_size):
            raise ValueError(f"the saved env state has {state['num_envs']} envs in groups of {state['group_size']}, "
                             f"this env {self.num_envs} in groups of {self.group_size}; restore it into an env of "
                             "the same num_envs and group_size")
        if "draws_made" not in state:
            raise ValueError("the saved env state is from an older mathrl (problems drawn in turn); start a new run")
        self.task.sampler.set_state(state["sampler"])
        self.episodes = [self.task.restore_episode(episode) for episode in state["episodes"]]
        self.episode_counts = np.asarray(state["episode_counts"], dtype=np.int64)
        self.group_draws = {(group, j): [self.task.sampler.get(problem_id), group_id, left]
                            for group, j, problem_id, group_id, left in state["group_draws"]}
        self.draws_made = np.asarray(state["draws_made"], dtype=np.int64)
        self.needs_reset = np.asarray(state["needs_reset"], dtype=bool)
        return self._observations(), self._info(self._facts())

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """One state of all the envs from the ``get_state`` of consecutive shards (offsets 0, 1, ... in
        group order): what one env holding every group would have saved."""
        group_size = states[0]["group_size"]
        merged = {"num_envs": sum(state["num_envs"] for state in states), "group_size": group_size,
                  "sampler": max((state["sampler"] for state in states), key=lambda sampler: sampler["epochs"]),
                  "group_draws": []}
        for key in ("episodes", "episode_counts", "draws_made", "needs_reset"):
            merged[key] = [item for state in states for item in state[key]]
        offset = 0
        for state in states:
            merged["group_draws"] += [[group + offset, *rest] for group, *rest in state["group_draws"]]
            offset += state["num_envs"] // group_size
        return merged

    @staticmethod
    def split_state(state: dict[str, Any], group_offset: int, num_groups: int) -> dict[str, Any]:
        """The state of the shard of ``num_groups`` groups from ``group_offset`` (inverse of ``merge_states``)."""
        group_size = state["group_size"]
        envs = slice(group_offset * group_size, (group_offset + num_groups) * group_size)
        return {**state, "num_envs": num_groups * group_size,
                **{key: state[key][envs] for key in ("episodes", "episode_counts", "needs_reset")},
                "draws_made": state["draws_made"][group_offset:group_offset + num_groups],
                "group_draws": [[group - group_offset, *rest] for group, *rest in state["group_draws"]
                                if group_offset <= group < group_offset + num_groups]}

    def _start_episode(self, env_index: int, problem_ids: Sequence[str] | None = None) -> Episode:
        """The next episode of env ``env_index``: its group's j-th problem, drawn by the first
        member that gets there (at the position the module docstring gives) and forgotten once every
        member has taken it."""
        group = int(env_index) // self.group_size
        key = (group, int(self.episode_counts[env_index]))
        self.episode_counts[env_index] += 1
        if key not in self.group_draws:
            sampler = self.task.sampler
            position = int(self.draws_made[group]) * self.total_groups + self.group_offset + group
            self.draws_made[group] += 1
            problem = sampler.get(problem_ids[group]) if problem_ids is not None else sampler.at(position)
            self.group_draws[key] = [problem, position, self.group_size]
        draw = self.group_draws[key]
        draw[2] -= 1
        if draw[2] == 0:
            del self.group_draws[key]
        return self.task.new_episode(draw[0], group_id=draw[1])

    def _observations(self) -> tuple[str, ...]:
        return tuple(self.task.observation(e) for e in self.episodes)

    def _facts(self, **results: Any) -> StepFacts:
        """The facts of the episodes now running (the one agent acts wherever the env needs no reset) and
        ``results``, the ``StepFacts`` fields of the actions just taken (none: a reset's)."""
        return self.task.facts(self.episodes, ~self.needs_reset, **results)

    def _info(self, facts: StepFacts, stepped: bool = False) -> dict[str, Any]:
        """``facts`` under ``FACTS``, and as the plain [N] arrays the class docstring lists (the results of
        the actions only when ``stepped``)."""
        info = {FACTS: facts, "problem_id": facts.problem_ids, "group_id": facts.group_ids, "step": facts.turns}
        if stepped:
            info["correct"], info["final_answer"] = facts.correct, facts.answers
            info.update({f"reward/{name}": values[:, 0] for name, values in facts.sources.items()})
            if self.task.mode == ActionLevel.STEP:
                info["action_clipped"] = facts.clipped[:, 0]
            if facts.tool_called is not None:
                info["tool_called"] = facts.tool_called[:, 0]
        return info

    def _spread(self, values: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """[N] float64: ``values`` at ``rows``, NaN at the other envs."""
        full = np.full(self.num_envs, np.nan)
        full[rows] = values
        return full
