"""The tiny models that ship inside the package: one committed build, the default of every command that needs one.

A build's float sums differ from machine to machine (``models.tiny.build``), so a build of one's own
gives that build's figures. The package carries one finished build, made once with
``python -m models.tiny --out models/tiny/shipped`` and committed (policy, target, PRM, the team
model in ``team-<team hash>``, the tool model in ``tool-<tool hash>``, and metrics.json: the build's config hash,
knobs and held-out metrics),
so that every machine starts from the same weights, at once, and reproduces docs/results.md.

It is used only while its keys match the code's: a change to ``TinyConfig``, to ``BUILD_VERSION``,
``TEAM_VERSION`` or ``TOOL_VERSION``, or to the transformers major version makes it refuse to load, naming the fix
(rebuild and commit it, or build one's own). A user's own builds stay in ``$MATHRL_CACHE``.
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers

from models.tiny.build import TinyModels, read_build, team_dir, tool_dir
from models.tiny.config import TinyConfig, config_hash, team_hash, tool_hash

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
"""Where the package keeps its build (``[options.package_data]`` in setup.cfg carries it)."""

_OWN_BUILD = ("or build your own with `python -m models.tiny` (into $MATHRL_CACHE; it prints the directory) and "
              "pass its models by path (--model_name_or_path DIR/policy)")


def shipped_models(team: bool = True, root: Path = SHIPPED_DIR, tool: bool = False) -> TinyModels:
    """The shipped build of ``TinyConfig()``: its paths and metrics, the team and tool models' included.

    Raises FileNotFoundError when ``root`` holds no finished build (or, with ``team`` or ``tool``, no team or
    tool model of the expected key), and ValueError when it was built for another config hash than this code's.
    """
    config = TinyConfig()
    metrics_file = root / "metrics.json"
    if not metrics_file.is_file():
        raise FileNotFoundError(f"no shipped tiny models: {metrics_file} is missing (a copy of mathrl without "
                                f"models/tiny/shipped/); reinstall mathrl, {_OWN_BUILD}")
    found, expected = json.loads(metrics_file.read_text()).get("config_hash"), config_hash(config)
    if found != expected:
        raise ValueError(f"the shipped tiny models in {root} were built for config hash {found}, but this code with "
                         f"transformers {transformers.__version__} keys the tiny build {expected} "
                         "(models/tiny/config.py): "
                         f"rebuild them with `python -m models.tiny --out {root}` after removing it, {_OWN_BUILD}")
    for wanted, stage, stage_dir, key in (("team", team, team_dir, team_hash), ("tool", tool, tool_dir, tool_hash)):
        if stage and not (stage_dir(root, config) / "metrics.json").is_file():
            shipped = sorted(path.name for path in root.glob(f"{wanted}-*"))
            raise FileNotFoundError(f"the shipped tiny build in {root} has no {wanted} model of key {key(config)} "
                                    f"(it has {shipped or 'none'}): build it with "
                                    f"`python -m models.tiny --out {root}`, "
                                    f"{_OWN_BUILD}")
    return read_build(root, config)
