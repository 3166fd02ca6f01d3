"""Shared fixtures: the tiny tokenizer and an untrained tiny policy (seconds), and the trained tiny models
(the build the package ships, models/tiny/shipped; only slow tests use it, but for the shipped tool model,
which a default test of the tool reads from the package because a run with the tool needs a policy that calls it).

Tests of mechanics pass model directories explicitly; only a test that needs a model that can do arithmetic
(model quality, learning curves, PRM accuracy) reads the trained build, and it is marked slow. Outside slow
tests the user cache ($MATHRL_CACHE, which child processes inherit) points below a file, so anything that
would build tiny models into it (minutes) fails at once naming ``NO_BUILD``, and the default suite does the
same work on a machine with the cache as on one without.
"""

import os
from pathlib import Path

import pytest
import torch
from xdist.scheduler import LoadScopeScheduling

from models.tiny import build_tokenizer, save_untrained_policy, shipped_models

NO_BUILD = "no-tiny-build-outside-slow-tests--pass-model-dirs"


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in each test process and, through OMP_NUM_THREADS, in each process a test starts: the
    suite already runs one worker per core (addopts -n 2), and OpenMP threads beyond the free cores ran the
    tiny model's training steps about 10x slower."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def untrained_policy_dir(tmp_path_factory) -> Path:
    """A random-init tiny Llama with the tiny tokenizer: a policy, target or team model, or (with
    ``check_labels=False``) a Math-Shepherd PRM, for tests of mechanics."""
    return save_untrained_policy(tmp_path_factory.mktemp("untrained_policy"))


@pytest.fixture(scope="session")
def smaller_policy_dir(tmp_path_factory) -> Path:
    """Another base: a random-init tiny Llama of other weights and shape (hidden size 48, 3 layers; the tiny
    tokenizer), for a role that learns on a base model of its own beside ``untrained_policy_dir``."""
    return save_untrained_policy(tmp_path_factory.mktemp("smaller_policy"), seed=1, hidden_size=48,
                                 num_hidden_layers=3)


@pytest.fixture(scope="session")
def tiny_models():
    """The shipped build: the same weights on every machine, so slow tests' thresholds hold on each."""
    return shipped_models()


OPT_IN = ("slow", "real_model")  # the markers of tests that may build into (and read) the user cache


def blocker(factory: pytest.TempPathFactory) -> str:
    path = factory.getbasetemp() / NO_BUILD
    path.touch()
    return str(path)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A run without opt-in tests (the default suite) blocks the build for the whole session, so that no
    fixture of any scope can build before a test's own guard below; a run with some blocks it per test."""
    if not any(item.get_closest_marker(marker) for item in session.items for marker in OPT_IN):
        os.environ["MATHRL_CACHE"] = blocker(session.config._tmp_path_factory)


@pytest.fixture(autouse=True)
def no_tiny_build_outside_slow_tests(request, tmp_path_factory, monkeypatch) -> None:
    """Opt-in tests (slow, real_model) keep the user cache: they may build into it."""
    if not any(request.node.get_closest_marker(marker) for marker in OPT_IN):
        monkeypatch.setenv("MATHRL_CACHE", blocker(tmp_path_factory))


# The files whose tests start torchrun ranks, servers and whole train_math runs (tens of seconds each),
# longest first. xdist hands out work units in collection order (--no-loadscope-reorder): starting with
# these lets the many short files fill in behind them, so that the two workers end together.
LONGEST_FILES = ("test_trainer.py", "test_distributed.py", "test_faults.py", "test_checkpoint.py",
                 "test_front_door.py", "test_train_math.py", "test_service_keys.py", "test_remote.py", "test_readme.py")

PER_TEST_FILES = ("test_trainer.py", "test_faults.py", "test_readme.py")
"""Files whose tests are work units of their own rather than the file as a whole: in the slow suite each of
their tests runs for minutes (the trainer's learning runs, 5-16 minutes each on idle cores; a SIGKILL
loop; the documents' commands), so that as one unit their file outlasted the rest of the suite on the other
worker. Their module fixtures are cheap (an untrained tiny policy, one ``--helpfull``)."""


class FilesAndLongTests(LoadScopeScheduling):
    """xdist's loadfile, except that each test of PER_TEST_FILES is a unit of its own."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return nodeid if Path(path).name in PER_TEST_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling | None:
    """--dist loadfile (addopts) runs FilesAndLongTests; any other --dist is xdist's own."""
    return FilesAndLongTests(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items
                if "tiny_models" in item.fixturenames and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError(f"{unmarked} use the trained tiny models (quality tests, minutes) without "
                                "@pytest.mark.slow: mark them slow, or pass untrained_policy_dir")
    rank = {name: k for k, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: the rest keep their order
