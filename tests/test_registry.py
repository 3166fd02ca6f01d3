"""The registered env ids: MATH ids read the bundled MATH-500 with no dataset path, the data file ships with
the package, and every id declares a default reward the trainer's --reward accepts."""

from __future__ import annotations

import configparser
import fnmatch
from pathlib import Path

import gymnasium
import pytest

import envs
from envs.datasets import MATH500
from reward_models.mixture import parse_reward_spec
from train.config import REWARD_SOURCES

ROOT = Path(__file__).resolve().parents[1]


def test_math_ids_read_the_bundled_math500_without_a_dataset_path():
    env = gymnasium.make("MATH-v0")
    obs, info = env.reset(seed=0)
    problems = {p.id: p for p in envs.load_problems(MATH500)}
    assert len(problems) == 500 and info["problem_id"] in problems
    assert obs == f"Problem: {problems[info['problem_id']].problem}\nSolution:\n"
    chain = gymnasium.make("MATH-Chain-v0", levels=[1], limit=3)
    _, info = chain.reset(seed=0)
    assert problems[info["problem_id"]].level == 1
    assert gymnasium.make("MATH-v0", problems=[problems[info["problem_id"]]], dataset_path=None).reset(seed=0)[1][
        "problem_id"] == info["problem_id"]


def test_math500_is_package_data():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    patterns = [p.strip() for p in config["options.package_data"]["envs"].split(",")]
    shipped = MATH500.relative_to(ROOT / "envs").as_posix()
    assert any(fnmatch.fnmatch(shipped, pattern) for pattern in patterns)
    assert "MIT" in (MATH500.parent / "README.md").read_text()


def test_every_registered_id_declares_a_valid_default_reward():
    """The eleven built-in ids (other tests register ids of their own with envs' entry points)."""
    builtin = ("Arith", "MATH", "ReasoningGym")
    ids = [spec.id for spec in gymnasium.registry.values()
           if str(spec.entry_point).startswith("envs.") and spec.id.startswith(builtin)]
    assert sorted(envs.DEFAULT_REWARDS) == sorted(ids) and len(ids) == 11
    assert envs.default_reward("Arith-v0") == "outcome:1.0,steps:1.0"
    assert parse_reward_spec(envs.default_reward("Arith-v0"), REWARD_SOURCES) == {"outcome": 1.0, "steps": 1.0}
    for env_id in ids:
        parse_reward_spec(envs.default_reward(env_id), REWARD_SOURCES)
    assert {envs.default_reward(i) for i in ids if i != "Arith-v0"} == {"outcome"}
    assert envs.default_reward("my_workflows:Review") == envs.FALLBACK_REWARD == "outcome"


@pytest.mark.parametrize("env_id", ["MATH-v0", "Arith-v0"])
def test_a_registered_source_can_be_replaced(env_id, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text('{"problem": "What is 2 + 2?", "answer": "4"}\n')
    kwargs = {"dataset_path": str(data)} if env_id == "MATH-v0" else {"arith": None, "dataset_path": str(data)}
    obs, _ = gymnasium.make(env_id, **kwargs).reset(seed=0)
    assert "What is 2 + 2?" in obs
