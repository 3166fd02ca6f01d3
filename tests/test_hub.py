"""models.hub.resolve_model against a Hugging Face cache in the hub's own layout, made here, with the hub offline:
local directories pass through, ids resolve to their snapshot (default branch, tag, commit), and an id that is
not cached fails in one line naming the flag, the id and how to fetch it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.hub import resolve_model

ROOT = Path(__file__).resolve().parents[1]
MAIN_SHA = "a" * 40
TAGGED_SHA = "b" * 40


def make_cache(hf_home: Path) -> Path:
    """HF_HOME with hub/models--org--tiny-math: refs/main and refs/v1 pointing at two snapshots."""
    repo = hf_home / "hub" / "models--org--tiny-math"
    for ref, sha in (("main", MAIN_SHA), ("v1", TAGGED_SHA)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
        snapshot = repo / "snapshots" / sha
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "revision": ref}))
    return repo


def resolve_offline(hf_home: Path, calls: list[tuple[str, str | None]]) -> list[str]:
    """Each call's resolved path, or 'ValueError: <message>', from a fresh process whose HF_HOME is
    ``hf_home`` and HF_HUB_OFFLINE=1 (huggingface_hub reads both when it is imported)."""
    script = (
        "import json, sys\n"
        "from models.hub import resolve_model\n"
        "out = []\n"
        "for name, revision in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        out.append(str(resolve_model(name, revision, flag='--target_model_name_or_path')))\n"
        "    except ValueError as error:\n"
        "        out.append(f'ValueError: {error}')\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", script, json.dumps(calls)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_local_directory_is_returned_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(str(tmp_path), revision="v1") == tmp_path


def test_hub_ids_resolve_to_cached_snapshots_offline(tmp_path):
    repo = make_cache(tmp_path)
    main, tag, commit = resolve_offline(tmp_path, [("org/tiny-math", None), ("org/tiny-math", "v1"),
                                                   ("org/tiny-math", MAIN_SHA)])
    assert Path(main) == repo / "snapshots" / MAIN_SHA
    assert json.loads((Path(main) / "config.json").read_text())["revision"] == "main"
    assert Path(tag) == repo / "snapshots" / TAGGED_SHA
    assert Path(commit) == repo / "snapshots" / MAIN_SHA


def test_uncached_ids_fail_in_one_line_saying_how_to_fetch(tmp_path):
    make_cache(tmp_path)
    missing, revision, path = resolve_offline(tmp_path, [("Qwen/Qwen2.5-Math-1.5B", None), ("org/tiny-math", "v2"),
                                                         ("runs/x/best", None)])
    assert missing.startswith("ValueError: --target_model_name_or_path='Qwen/Qwen2.5-Math-1.5B' is not a local "
                              "directory and not in the Hugging Face cache")
    assert "`hf download Qwen/Qwen2.5-Math-1.5B`" in missing and "pass a local directory" in missing
    assert str(tmp_path / "hub") in missing
    assert revision.startswith("ValueError: --target_model_name_or_path='org/tiny-math' at revision 'v2' is not")
    assert "`hf download org/tiny-math --revision v2`" in revision
    assert path.startswith("ValueError: --target_model_name_or_path='runs/x/best' is neither an existing local "
                           "directory nor a hub id")
    assert all("\n" not in message for message in (missing, revision, path))


@pytest.mark.parametrize("name", ["org//x", "org/-bad-", "a..b"])
def test_malformed_ids_are_refused_before_any_lookup(name):
    with pytest.raises(ValueError, match=r"^--model_name_or_path='.*' is neither an existing local directory"):
        resolve_model(name)
