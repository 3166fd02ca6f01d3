"""The layers of the house, read from every import statement (module level and inside functions):

    envs -> algorithms -> models -> reward_models -> train (loop) -> train_math

A module may import its own layer and the ones below it, never one above, and so may a folder: each
top-level package imports only the packages below it. The tiny-model build tool (models.tiny) is a
subpackage of the model layer, imported only by itself and by the default-model path (train.builders).
The house's modes (envs.modes, stdlib enums) are the one module of envs the algorithms import: tensor math
compares modes as members and knows nothing else of the env. envs import no torch; algorithms import no model
library; the modules that parse flags import nothing heavy at module level, so a bad flag fails before torch
loads. No line of Python in the repository runs past the house limit (setup.cfg's max-line-length).
"""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envs", "algorithms", "models", "reward_models", "train")
LAYERS = {"envs": 0, "algorithms": 1, "models": 2, "reward_models": 3, "models.tiny": 2, "train": 4,
          "train_math": 5}
TINY_IMPORTERS = ("models.tiny", "train.builders")
ALGORITHMS_MAY_IMPORT = ("algorithms", "envs.modes")  # the house's modes are the algorithms' only view of envs
FORBIDDEN = {  # layer -> third-party packages it must not import
    "envs": ("torch", "transformers", "peft", "safetensors", "vllm"),
    "algorithms": ("transformers", "peft", "safetensors", "vllm", "gymnasium"),
}
HEAVY = ("torch", "transformers", "peft", "vllm", "numpy", "sympy")


def project_modules() -> dict[str, Path]:
    modules = {"train_math": ROOT / "train_math.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = project_modules()
LIGHT_AT_IMPORT = ("algorithms.config", "algorithms.options", "algorithms.registry", "envs.modes", "train.config",
                   "train.options", "train.validation", "train_math",
                   *sorted(m for m in MODULES if m == "train.flags" or m.startswith("train.flags.")))


def layer_of(module: str) -> str:
    """The longest LAYERS key that is ``module`` or a package above it."""
    return max((key for key in LAYERS if module == key or module.startswith(key + ".")), key=len)


def imports(module: str, top_level_only: bool = False) -> list[tuple[str, int]]:
    """(imported name, line) of every import in ``module``; ``from pkg import sub`` names pkg.sub when
    sub is a module. Relative imports are resolved against the module's package."""
    tree = ast.parse(MODULES[module].read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".strip(".")
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((name if name in MODULES else base, node.lineno))
    return found


def is_project(name: str) -> bool:
    return name.split(".")[0] in (*PACKAGES, "train_math")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_back_up(module):
    mine = LAYERS[layer_of(module)]
    for name, line in imports(module):
        if not is_project(name):
            continue
        assert LAYERS[layer_of(name)] <= mine, (f"{module}:{line} imports {name} from layer {layer_of(name)!r}, "
                                                f"above its own {layer_of(module)!r}")
        if layer_of(name) == "models.tiny":
            assert module.startswith(TINY_IMPORTERS), f"{module}:{line} imports the build tool {name}"


def test_no_folder_imports_a_folder_above_it():
    """The folders read bottom to top with no circle: envs, algorithms, models, reward_models, train."""
    order = [*PACKAGES, "train_math"]
    for module in MODULES:
        folder = module.split(".")[0]
        for name, line in imports(module):
            if is_project(name):
                assert order.index(name.split(".")[0]) <= order.index(folder), f"{module}:{line} imports {name}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) == "algorithms"))
def test_algorithms_import_of_envs_only_the_modes(module):
    for name, line in imports(module):
        if is_project(name):
            assert name.startswith(ALGORITHMS_MAY_IMPORT), f"{module}:{line} imports {name}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) in FORBIDDEN))
def test_lower_layers_stay_free_of_model_libraries(module):
    forbidden = FORBIDDEN[layer_of(module)]
    for name, line in imports(module):
        assert name.split(".")[0] not in forbidden, f"{module}:{line} imports {name}"


@pytest.mark.parametrize("module", LIGHT_AT_IMPORT)
def test_flag_parsing_modules_import_nothing_heavy_at_module_level(module):
    for name, line in imports(module, top_level_only=True):
        assert name.split(".")[0] not in HEAVY, f"{module}:{line} imports {name} at module level"
        if is_project(name):
            assert name in LIGHT_AT_IMPORT, f"{module}:{line} imports {name}, which is not light"


def test_no_two_modules_import_each_other():
    """No circle of two within a layer either: if a module imports another (at module level or in a function),
    that one imports nothing of it back."""
    imported = {module: {name for name, _ in imports(module) if name in MODULES and name != module}
                for module in MODULES}
    both_ways = sorted(f"{a} <-> {b}" for a in imported for b in imported[a] if a < b and a in imported[b])
    assert not both_ways, both_ways
    assert "envs.sandbox" in imported["envs.sandbox_server"]


def test_the_layer_map_covers_every_module():
    assert set(MODULES) >= {"envs.rewards", "algorithms.buffer", "models.policy", "reward_models.prm",
                            "train.runner", "models.tiny.build"}
    assert layer_of("models.generation") == "models" and layer_of("train.collector") == "train"


@pytest.mark.parametrize("module", ["envs.rewards", "reward_models.mixture", "algorithms.base", "train.flags",
                                    "train.runner"])
def test_a_fresh_interpreter_imports_any_module_first(module):
    """No import cycle: each entry point imports cleanly before anything else is loaded."""
    result = subprocess.run([sys.executable, "-c", f"import {module}; import envs; envs.MathVectorEnv"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_no_line_is_longer_than_the_house_limit():
    """Every .py line of the project, its tests and benchmarks fits in setup.cfg's ``max-line-length``."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    limit = setup.getint("flake8", "max-line-length")
    assert limit == setup.getint("pycodestyle", "max-line-length")
    paths = [ROOT / "train_math.py", *(path for folder in (*PACKAGES, "bench", "tests")
                                       for path in sorted((ROOT / folder).rglob("*.py")))]
    assert ROOT / "train" / "runner.py" in paths and ROOT / "tests" / "test_layers.py" in paths
    too_long = [f"{path.relative_to(ROOT)}:{number} ({len(line)} characters)" for path in paths
                for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]
    assert not too_long, f"{len(too_long)} lines over {limit} characters:\n" + "\n".join(too_long)


def test_parsing_flags_loads_no_torch():
    """The light modules at run time: importing the flags (and the env package, home of the mode enums the
    options take) loads no model library, so a bad flag fails before torch loads."""
    code = "import sys, train.flags; print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
