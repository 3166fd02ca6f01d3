"""The runnable examples in the docstrings, run by doctest: the house's modes, a RunConfig built in code and
resolved, the env (gymnasium.make, reset, a step of text and its reward) and build_runner's one iteration of
the shipped tiny policy."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ("envs.modes", "envs.math_env", "train.config", "train.builders")


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (printed above)"
