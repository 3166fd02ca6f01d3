"""mathrl environments. Importing this package registers the built-in gymnasium ids:

- ``MATH-v0``: problems from a dataset (``dataset_path=`` a JSONL/JSON file or ``hf://NAME[:split]``,
  filters ``split``, ``subjects``, ``levels``, ``limit``), step- or token-level (``mode=``).
- ``Arith-v0``: procedural arithmetic (``arith=`` knobs of ``envs.datasets.Arith``), the task the
  built-in tiny models learn on a CPU; no data file needed.
- ``Arith-Chain-v0``, ``Arith-Debate-v0``, ``Arith-Prefix-v0`` and the same three ``MATH-*`` ids: the
  multi-agent workflows of ``envs.workflows`` (solver -> verifier -> refiner; a debate with a majority
  vote; Prefix-RL's writer and solver) over the same tasks (``envs.multi_agent``).

All have a ``vector_entry_point``, so
``gymnasium.make_vec("Arith-v0", num_envs=64, vectorization_mode="vector_entry_point")`` returns
one ``MathVectorEnv`` that scores all envs' rewards in one batch.
"""

import gymnasium

from envs.datasets import Arith, Problem, load_problems
from envs.math_env import MathEnv, MathTask
from envs.multi_agent import MultiAgentMathEnv, MultiAgentMathVectorEnv, register_builtin
from envs.vector import MathVectorEnv

DEFAULT_ARITH = {"digits": 2, "min_ops": 1, "max_ops": 3, "operators": "+-", "num_train": 20_000, "num_test": 1_000,
                 "seed": 0}


def _register(env_id: str, **kwargs) -> None:
    if env_id not in gymnasium.registry:
        gymnasium.register(
            env_id,
            entry_point="envs.math_env:MathEnv",
            vector_entry_point="envs.vector:MathVectorEnv",
            kwargs=kwargs,
        )


_register("MATH-v0")
_register("Arith-v0", arith=DEFAULT_ARITH, max_steps=8)
register_builtin()  # after Arith-v0: the Arith-* workflow ids take its keywords

__all__ = ["Arith", "MathEnv", "MathTask", "MathVectorEnv", "MultiAgentMathEnv", "MultiAgentMathVectorEnv", "Problem",
           "load_problems"]
