"""MathVectorEnv: N math episodes stepped together, every completed step scored in ONE batched
reward-model call (where a PRM or a target solver gets its speed).

Groups: with ``group_size=k`` the envs ``[g*k, (g+1)*k)`` form group g and always work on the same
problem (GRPO and RLOO compare samples within a group). When a member finishes, its next episode
takes the group's next problem: the j-th episode of every member of group g is the same problem,
drawn once from the shared sampler (without replacement per epoch, reproducible per seed), and
carries the same ``group_id`` (unique across the run).

Autoreset follows gymnasium 1.x ``AutoresetMode``: ``NEXT_STEP`` (gymnasium's default: the step
after an episode ends resets that env and ignores its action), ``SAME_STEP`` (the ending step
already returns the next episode's first observation; the final observation and info are in
``info["final_obs"]`` / ``info["final_info"]``, masked by ``info["_final_obs"]``), or ``DISABLED``
(a finished env stays finished, its actions ignored with reward 0, until
``reset(options={"reset_mask": mask})`` or a full reset: one episode per env, as GRPO wants).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from envs.math_env import Episode, MathTask, Transition


class MathVectorEnv(VectorEnv):
    """``num_envs`` MATH episodes; extra keyword arguments build the shared ``MathTask``
    (problem source, mode, tokenizer, reward model, limits: see ``envs.math_env.MathTask``).

    Observations are a tuple of N strings; actions a sequence of N strings (step mode) or an
    int array [N] (token mode). Infos hold per-env arrays ``problem_id``, ``group_id``, ``step``,
    and where an episode ended ``correct`` and ``reward/<source>`` (with gymnasium's ``_key`` masks).
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(
        self,
        num_envs: int,
        group_size: int = 1,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        **task_kwargs: Any,
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs} must be >= 1")
        if group_size < 1 or num_envs % group_size:
            raise ValueError(f"group_size={group_size} must be >= 1 and divide num_envs={num_envs}")
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.metadata = {**self.metadata, "autoreset_mode": self.autoreset_mode}
        self.num_envs = num_envs
        self.group_size = group_size
        self.task = MathTask(**task_kwargs)
        self.single_observation_space = self.task.observation_space
        self.single_action_space = self.task.action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.episodes: list[Episode] = []
        self.episode_counts = np.zeros(num_envs, dtype=np.int64)  # episodes started per env
        self.group_draws: dict[tuple[int, int], list] = {}  # (group, j) -> [problem, group_id, members left]
        self.next_group_id = 0
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
        return self._observations(), self._infos([self.task.info(e) for e in self.episodes])

    def step(self, actions: Sequence[Any]) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, dict]:
        if len(actions) != self.num_envs:
            raise ValueError(f"got {len(actions)} actions for {self.num_envs} envs")
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        env_infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        acting = [i for i in range(self.num_envs) if not self.needs_reset[i]]
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:  # this step resets, its action is ignored
            for i in np.flatnonzero(self.needs_reset):
                self.episodes[i] = self._start_episode(i)
        transitions: list[Transition] = []
        for i in acting:
            transition, env_infos[i] = self.task.apply(self.episodes[i], actions[i])
            self.episodes[i].done = transition.terminated or transition.truncated
            terminated[i], truncated[i] = transition.terminated, transition.truncated
            transitions.append(transition)
        results = self.task.score([self.episodes[i] for i in acting], transitions)
        for i, result in zip(acting, results):
            rewards[i] = result.pop("reward")
            env_infos[i] = {**self.task.info(self.episodes[i]), **env_infos[i], **result}
        for i in np.flatnonzero(self.needs_reset):
            env_infos[i] = self.task.info(self.episodes[i])
        ended = terminated | truncated
        if self.autoreset_mode == AutoresetMode.DISABLED:
            self.needs_reset |= ended
            return self._observations(), rewards, terminated, truncated, self._infos(env_infos)
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            self.needs_reset = ended
            return self._observations(), rewards, terminated, truncated, self._infos(env_infos)
        final_obs = {i: self.task.observation(self.episodes[i]) for i in np.flatnonzero(ended)}
        final_infos = {i: env_infos[i] for i in final_obs}
        for i in final_obs:
            self.episodes[i] = self._start_episode(i)
            env_infos[i] = self.task.info(self.episodes[i])
        infos = self._infos(env_infos)
        if final_obs:
            infos["final_obs"] = np.array([final_obs.get(i) for i in range(self.num_envs)], dtype=object)
            infos["_final_obs"] = ended.copy()
            infos["final_info"] = self._infos([final_infos.get(i, {}) for i in range(self.num_envs)])
            infos["_final_info"] = ended.copy()
        return self._observations(), rewards, terminated, truncated, infos

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
            "next_group_id": self.next_group_id,
            "needs_reset": self.needs_reset.tolist(),
        }

    def set_state(self, state: dict[str, Any]) -> tuple[tuple[str, ...], dict]:
        """Continues exactly where ``get_state`` was called (same problems, ``num_envs`` and
        ``group_size``); returns the observations and infos of the restored episodes, as ``reset`` does."""
        if (state["num_envs"], state["group_size"]) != (self.num_envs, self.group_size):
            raise ValueError(f"the saved env state has {state['num_envs']} envs in groups of {state['group_size']}, "
                             f"this env {self.num_envs} in groups of {self.group_size}; restore it into an env of "
                             "the same num_envs and group_size")
        self.task.sampler.set_state(state["sampler"])
        self.episodes = [self.task.restore_episode(episode) for episode in state["episodes"]]
        self.episode_counts = np.asarray(state["episode_counts"], dtype=np.int64)
        self.group_draws = {(group, j): [self.task.sampler.get(problem_id), group_id, left]
                            for group, j, problem_id, group_id, left in state["group_draws"]}
        self.next_group_id = state["next_group_id"]
        self.needs_reset = np.asarray(state["needs_reset"], dtype=bool)
        return self._observations(), self._infos([self.task.info(e) for e in self.episodes])

    def _start_episode(self, env_index: int, problem_ids: Sequence[str] | None = None) -> Episode:
        """The next episode of env ``env_index``: its group's j-th problem, drawn by the first
        member that gets there and forgotten once every member has taken it."""
        group = int(env_index) // self.group_size
        key = (group, int(self.episode_counts[env_index]))
        self.episode_counts[env_index] += 1
        if key not in self.group_draws:
            sampler = self.task.sampler
            problem = sampler.get(problem_ids[group]) if problem_ids is not None else sampler.draw()
            self.group_draws[key] = [problem, self.next_group_id, self.group_size]
            self.next_group_id += 1
        draw = self.group_draws[key]
        draw[2] -= 1
        if draw[2] == 0:
            del self.group_draws[key]
        return self.task.new_episode(draw[0], group_id=draw[1])

    def _observations(self) -> tuple[str, ...]:
        return tuple(self.task.observation(e) for e in self.episodes)

    def _infos(self, env_infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
        infos: dict[str, Any] = {}
        for i, env_info in enumerate(env_infos):
            infos = self._add_info(infos, env_info, i)
        return infos
