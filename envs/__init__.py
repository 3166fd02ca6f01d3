"""mathrl environments. Importing this package registers the built-in gymnasium ids:

- ``MATH-v0``: problems from a dataset (``dataset_path=`` a JSONL/JSON file or ``hf://NAME[:split]``; by
  default MATH-500, shipped with the package; filters ``split``, ``subjects``, ``levels``, ``limit``),
  step- or token-level (``mode=``).
- ``Arith-v0``: procedural arithmetic (``arith=`` knobs of ``envs.datasets.Arith``), the task the
  built-in tiny models learn on a CPU; no data file needed.
- ``ReasoningGym-v0``: a reasoning-gym dataset (``reasoning_gym=`` its name, config and split sizes; default
  chain_sum, ``envs.reasoning_gym_source``), each answer scored by the dataset's own scorer; needs the ``rg``
  extra.
- ``MATH-Tool-v0``, ``Arith-Tool-v0``: the same tasks with a Python tool (``tools="python"``, step mode):
  a step ending in a fenced python block runs in a sandbox and its output is the next observation's tail.
- ``Arith-Chain-v0``, ``Arith-Debate-v0``, ``Arith-Prefix-v0`` and the same three ``MATH-*`` ids: the
  multi-agent workflows of ``envs.workflows`` (solver -> verifier -> refiner; a debate with a majority
  vote; Prefix-RL's writer and solver) over the same tasks (``envs.multi_agent``).

All have a ``vector_entry_point``, so
``gymnasium.make_vec("Arith-v0", num_envs=64, vectorization_mode="vector_entry_point")`` returns
one ``MathVectorEnv`` that scores all envs' rewards in one batch.

Each id declares the reward it trains on by default (``default_reward(env_id)``, the trainer's
``--reward`` default): Arith-v0 the verified outcome plus the exact step reward of its canonical
solutions (``outcome:1.0,steps:1.0``), every other id the outcome.
"""

import inspect

import gymnasium

from envs.datasets import MATH500, Arith, Problem, load_problems
from envs.math_env import MathEnv, MathTask, build_problems
from envs.multi_agent import MultiAgentMathEnv, MultiAgentMathVectorEnv, register_builtin
from envs.reasoning_gym_source import SIZES as REASONING_GYM_SIZES
from envs.vector import MathVectorEnv

DEFAULT_ARITH = {"digits": 2, "min_ops": 1, "max_ops": 3, "operators": "+-", "num_train": 20_000, "num_test": 1_000,
                 "seed": 0}

DEFAULT_REWARDS: dict[str, str] = {}
"""Each registered id's default ``--reward`` spec (weighted sources, see ``reward_models.mixture``)."""
FALLBACK_REWARD = "outcome"
"""The default reward of an id that declares none (your own envs): the verified final answer."""


def _register(env_id: str, reward: str, **kwargs) -> None:
    if env_id not in gymnasium.registry:
        gymnasium.register(
            env_id,
            entry_point="envs.math_env:MathEnv",
            vector_entry_point="envs.vector:MathVectorEnv",
            kwargs=kwargs,
        )
    DEFAULT_REWARDS[env_id] = reward


def default_reward(env_id: str) -> str:
    """The reward ``env_id`` trains on unless told otherwise: its declared spec, else ``FALLBACK_REWARD``."""
    return DEFAULT_REWARDS.get(env_id, FALLBACK_REWARD)


TRAINER_KWARGS = {"num_envs": "--n_rollout_threads", "group_size": "--group_size", "autoreset_mode": "the algorithm",
                  "group_offset": "torchrun", "total_groups": "torchrun", "reward_model": "--reward",
                  "template": "--prompt_template", "tokenizer": "the policy", "mode": "--action_level",
                  "end_marker": "--action_level", "handoff_steps": "--handoff_steps",
                  "split": "the train/held-out split",
                  "problems": "--dataset_path", "dataset_path": "--dataset_path", "workflow": "--env_id",
                  "reward_assignment": "--reward_assignment", "tool_turn": "--prompt_template", "sandbox": "--tool_url"}
"""Env keywords the trainer sets itself: {keyword: the flag (or the part of the run) that decides it}."""


def override_kwargs(env_id: str, overrides: dict) -> dict:
    """The keywords that ``overrides`` (a user's ``--env_kwargs``) passes to ``env_id``'s vector env: each
    replaces the registered value, except a dict (Arith's ``arith`` knobs), whose keys update the registered
    dict. Raises ValueError naming a keyword the trainer sets itself or the env does not take, and any
    problem source the result cannot build (Arith knobs, MATH ``levels``/``subjects`` that match nothing)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"env kwargs must be a JSON object such as '{{\"arith\": {{\"digits\": 1}}}}', got "
                         f"{overrides!r}")
    for key in overrides:
        if key in TRAINER_KWARGS:
            raise ValueError(f"env kwarg {key!r} is set by the trainer from {TRAINER_KWARGS[key]}; drop it")
    spec = gymnasium.spec(env_id)
    accepted = env_keywords(spec)
    unknown = sorted(set(overrides) - accepted) if accepted is not None else []
    if unknown:
        raise ValueError(f"{env_id} takes no keyword {unknown}; it takes {sorted(accepted - set(TRAINER_KWARGS))}")
    merged = {key: {**spec.kwargs[key], **value} if isinstance(value, dict) and isinstance(spec.kwargs.get(key), dict)
              else value for key, value in overrides.items()}
    if accepted is not None:  # a MathTask env: its problem source must build (Arith draws both splits at once)
        source = {key: value for key, value in {**spec.kwargs, **merged}.items()
                  if key in ("dataset_path", "subjects", "levels", "limit", "arith", "reasoning_gym")}
        build_problems(split="train", **source)
    return merged


def env_keywords(spec: gymnasium.envs.registration.EnvSpec) -> set[str] | None:
    """The keywords a vector env built on ``MathTask`` takes (its own and the task's); None for another env
    (not checked)."""
    vector_env = gymnasium.envs.registration.load_env_creator(spec.vector_entry_point)
    if not (isinstance(vector_env, type) and issubclass(vector_env, (MathVectorEnv, MultiAgentMathVectorEnv))):
        return None
    names = inspect.signature(vector_env).parameters.keys() | inspect.signature(MathTask).parameters.keys()
    return {name for name in names if name != "task_kwargs"}


_register("MATH-v0", reward="outcome", dataset_path=str(MATH500))
# Arith's canonical solutions make the matched share of their steps an exact process reward; with the
# outcome it trains the default run further than the outcome alone.
_register("Arith-v0", reward="outcome:1.0,steps:1.0", arith=DEFAULT_ARITH, max_steps=8)
_register("ReasoningGym-v0", reward="outcome", max_steps=8,
          reasoning_gym={"name": "chain_sum", "config": {}, **REASONING_GYM_SIZES})
_register("MATH-Tool-v0", reward="outcome", dataset_path=str(MATH500), tools="python")
# A code step matches no canonical step: the tool ids train on the outcome alone.
_register("Arith-Tool-v0", reward="outcome", arith=DEFAULT_ARITH, max_steps=8, tools="python")
register_builtin()  # after Arith-v0: the Arith-* workflow ids take its keywords
DEFAULT_REWARDS.update({spec.id: "outcome" for spec in gymnasium.registry.values()  # the --reward_assignment credit
                        if spec.entry_point == "envs.multi_agent:MultiAgentMathEnv"})

__all__ = ["DEFAULT_REWARDS", "Arith", "MathEnv", "MathTask", "MathVectorEnv", "MultiAgentMathEnv",
           "MultiAgentMathVectorEnv", "Problem", "default_reward", "load_problems", "override_kwargs"]
