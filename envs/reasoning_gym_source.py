"""Problems from reasoning-gym (Apache-2.0; ``pip install 'mathrl[rg]'``): procedural generators of verifiable
tasks (chain_sum, basic_arithmetic, gsm_symbolic and about a hundred more), each answer scored by its own
dataset's ``score_answer``, offline.

A source is the env keyword ``reasoning_gym={"name": DATASET, "config": {FIELD: VALUE, ...}, "num_train": N,
"num_test": M, "seed": S}`` (``config``: the fields of that dataset's config class, e.g. chain_sum's
``min_terms``, ``max_digits``). Train and held-out problems are entries [0, N) and [N, N + M) of one dataset of
N + M entries made with ``seed``; reasoning-gym draws entry i from its own ``Random(seed + i)``, so the split
follows from the seed, and a train entry whose question a held-out one also asks is dropped.

Each problem names its scorer (``Problem.scorer``: dataset, config and index), so the grading workers regenerate
the entry and score the answer there, time-bounded like every grade (``envs.grader.reasoning_gym_scores``): a
scorer may parse model text with sympy, which never happens in the trainer's process. The answer is what the
env extracts: the last ``\\boxed{}``, else the last ``<answer>...</answer>`` (the format of reasoning-gym's own
prompts and examples), else what follows "The answer is".
"""

from __future__ import annotations

import functools
import json

from envs.datasets import Problem

SIZES = {"num_train": 20_000, "num_test": 1_000, "seed": 0}
"""A source's split sizes and seed when it leaves them out."""
SYSTEM_PROMPT = ("Given a problem, your task is to answer the question by thinking step-by-step in a clear and "
                 "specific manner.\nOnce you have thought about the reasoning process, provide the answer in the "
                 "following format:\n<answer>answer here</answer>\nDo not explain your reasoning inside the answer "
                 "tags, provide only the final answer. When an example is provided, you should strictly follow the "
                 "format of the output/answer in that example.")
"""reasoning-gym's default system prompt (``reasoning_gym.utils.SYSTEM_PROMPTS["default"]``), for a chat policy:
``--system_prompt`` with ``--answer_instruction ''``."""


def reasoning_gym_problems(source: dict, split: str | None) -> list[Problem]:
    """The train (``split`` "train" or None) or held-out ("test") problems of ``source`` (module docstring).
    Raises ValueError naming a bad key, split or dataset, ImportError naming the extra."""
    if not isinstance(source, dict) or not isinstance(source.get("name"), str):
        raise ValueError(f"reasoning_gym={source!r} must be a dict with 'name' (a reasoning-gym dataset, e.g. "
                         "'chain_sum') and optionally 'config', 'num_train', 'num_test', 'seed'")
    unknown = sorted(set(source) - {"name", "config"} - set(SIZES))
    if unknown:
        raise ValueError(f"reasoning_gym source takes no key {unknown}; it takes name, config, {', '.join(SIZES)}")
    if split not in (None, "train", "test"):
        raise ValueError(f"reasoning_gym split={split!r} must be 'train' or 'test'")
    config = source.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"reasoning_gym config={config!r} must be a dict of the dataset's config fields")
    sizes = {key: source.get(key, default) for key, default in SIZES.items()}
    for key, value in sizes.items():
        if not isinstance(value, int) or value < (0 if key == "seed" else 1):
            raise ValueError(f"reasoning_gym {key}={value!r} must be an integer >= {0 if key == 'seed' else 1}")
    train, test = _split(source["name"], json.dumps(config, sort_keys=True), **sizes)
    return list(test if split == "test" else train)


@functools.lru_cache(maxsize=4)
def _split(name: str, config: str, num_train: int, num_test: int, seed: int) -> tuple[tuple[Problem, ...], ...]:
    """(train, test) of one source; made once per process (the train and held-out envs ask for the same)."""
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("a reasoning_gym source needs the reasoning-gym package: pip install 'mathrl[rg]'") from None
    if name not in reasoning_gym.factory.DATASETS:
        raise ValueError(f"reasoning_gym name={name!r} is not a reasoning-gym dataset; some of its "
                         f"{len(reasoning_gym.factory.DATASETS)}: {sorted(reasoning_gym.factory.DATASETS)[:12]}")
    full_config = {**json.loads(config), "seed": seed, "size": num_train + num_test}
    try:
        dataset = reasoning_gym.create_dataset(name, **full_config)
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"reasoning_gym {name} config {json.loads(config)}: {error}") from None
    problems = [_problem(name, full_config, index, dataset[index]) for index in range(num_train + num_test)]
    test = problems[num_train:]
    held_out = {p.problem for p in test}
    return tuple(p for p in problems[:num_train] if p.problem not in held_out), tuple(test)


def _problem(name: str, config: dict, index: int, entry: dict) -> Problem:
    scorer = json.dumps({"name": name, "config": config, "index": index}, sort_keys=True)
    return Problem(id=f"rg:{name}:{index}", problem=entry["question"], answer=str(entry["answer"]), subject=name,
                   scorer=scorer)
