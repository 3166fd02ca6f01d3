"""Shared fixtures: the tiny tokenizer and an untrained tiny policy (fast), and the trained tiny
models (the full cached build of models.tiny; only slow tests use it)."""

import pytest

from models.tiny import build_tiny_models, build_tokenizer, save_untrained_policy


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def untrained_policy_dir(tmp_path_factory):
    return save_untrained_policy(tmp_path_factory.mktemp("untrained_policy"))


@pytest.fixture(scope="session")
def tiny_models():
    """Built once per machine into the user cache ($MATHRL_CACHE), minutes when cold."""
    return build_tiny_models()
