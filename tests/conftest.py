"""Shared fixtures: the tiny tokenizer and an untrained tiny policy (fast), and the trained tiny
models (the full cached build of train.tiny; only slow tests use it)."""

import pytest

from train.tiny import build_tiny_models, build_tokenizer, save_untrained_policy

TINY_PRM_NOT_READY = pytest.mark.xfail(strict=True, reason=(
    "issue 3 open: the built tiny PRM does not yet judge arithmetic (held-out step accuracy 0.50, ROC-AUC 0.53 in "
    "the 2026-11-23 1.1M build). Outside the build, the target trunk plus 2 layers trained 3000 steps on per-digit "
    "'+'/'-' labels and a logit-lens denoising loss reached step ROC-AUC 0.92 (about 20 minutes). "
    "Cheaper variants read at the step tag (frozen or fine-tuned trunk, labels at every token, a hand-built "
    "previous-token head) stayed at ROC-AUC 0.70 after 300-500 steps; a build that fits 10 minutes is still to do "
    "(see the issue 3 notes)"))
"""Marks the tests that need a tiny PRM that judges Arith steps."""


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
