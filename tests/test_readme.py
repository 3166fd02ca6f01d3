"""Every ```python block of the README runs as written, each in a fresh interpreter from the repo root,
with only the paths a user must substitute replaced by real small files (``placeholders``)."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.MULTILINE | re.DOTALL)
SHARED_DATA = "../shared/data/"  # the shared data sets, as the README names them from the repo root


@pytest.fixture(scope="module")
def placeholders(untrained_policy_dir, tmp_path_factory) -> dict[str, str]:
    """README placeholder -> the file that stands in for it."""
    problems = tmp_path_factory.mktemp("readme") / "my_problems.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"What is {k} squared?", "answer": str(k * k)}) + "\n"
                                for k in (3, 4)))
    return {"path/to/target": str(untrained_policy_dir), "my_problems.jsonl": str(problems)}


def path_literals(code: str) -> set[str]:
    """String literals of ``code`` that name a file or directory: no spaces, and a '/' or a file suffix."""
    strings = {node.value for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Constant)
               and isinstance(node.value, str)}
    return {s for s in strings if s and not re.search(r"\s", s) and ("/" in s or re.search(r"\.[a-z]{2,5}$", s))}


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4, f"found {len(BLOCKS)} ```python blocks in README.md; did the fence style change?"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i + 1}")
def test_readme_python_block_runs(index, placeholders):
    code = BLOCKS[index]
    for literal in sorted(path_literals(code) - placeholders.keys()):
        if literal.startswith(SHARED_DATA) and not (ROOT / literal).exists():
            pytest.skip(f"README block {index + 1} reads {literal}, absent here (the shared data sets live there)")
        assert (ROOT / literal).exists(), (
            f"README block {index + 1} names {literal!r}, which is neither a path in the repo nor a placeholder "
            "this test knows: add it to the placeholders fixture")
    for placeholder, path in placeholders.items():
        code = code.replace(placeholder, path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, f"README block {index + 1} failed:\n{BLOCKS[index]}\n{result.stderr[-3000:]}"
