"""Every command and snippet of README.md and docs/*.md that claims to run does run, from the repo root.

How a fenced block is treated:
- ```python runs in a fresh interpreter (default suite: a snippet takes seconds), with the paths a user
  must substitute replaced by small real files (``placeholders``).
- ```bash runs as one bash script (slow: the quickstart trains on the tiny models, which it builds on
  first use), with every budget shrunk (``--num_env_steps``, ``--env_steps``; ``SMOKE_STEPS``), run
  directories in a temporary directory, and its background jobs (servers) killed at the end. Variables
  a page sets in a runnable block (``TINY=$(...)`` lines) carry to its later blocks, as in one shell.
- A block whose first line is ``# needs: REASON`` is illustrative (GPU recipes, several nodes, an
  hour-long grid): skipped with that reason. Its ``train_math.py`` flags are still checked to exist.
- A block of ``pip install`` commands is a set-up command: .ci/run runs the test command in a fresh venv.
- Other fences (```text) are never run.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = re.compile(r"^# needs: (.+)$")
SMOKE_STEPS = 256  # env steps of each quickstart run here: one or two iterations
README_MAX_LINES = 350
BUNDLED_MATH500 = ROOT / "envs" / "data" / "math500.jsonl"


class Block(NamedTuple):
    page: str  # path relative to the repo root
    index: int  # 1-based among the page's blocks of this language
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.language}{self.index}"

    @property
    def needs(self) -> str | None:
        """The reason a block does not run here, or None when it does."""
        first = self.code.splitlines()[0] if self.code.strip() else ""
        if match := NEEDS.match(first):
            return match.group(1)
        if self.language == "bash" and all(line.startswith("pip install") for line in commands(self.code)):
            return "a set-up command: .ci/run runs it in a fresh venv"
        return None


def fenced_blocks(page: Path) -> list[Block]:
    """The page's ```python and ```bash blocks, in order."""
    blocks, counts = [], {}
    for language, code in re.findall(r"^```(python|bash)\n(.*?)^```", page.read_text(), flags=re.M | re.S):
        counts[language] = counts.get(language, 0) + 1
        blocks.append(Block(str(page.relative_to(ROOT)), counts[language], language, code))
    return blocks


def commands(code: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
PYTHON = [block for block in BLOCKS if block.language == "python"]
BASH = [block for block in BLOCKS if block.language == "bash"]


@pytest.fixture(scope="module")
def placeholders(untrained_policy_dir, tmp_path_factory) -> dict[str, str]:
    """Placeholder in a snippet -> the file that stands in for it."""
    problems = tmp_path_factory.mktemp("readme") / "my_problems.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"What is {k} squared?", "answer": str(k * k)}) + "\n"
                                for k in (3, 4)))
    return {"path/to/target": str(untrained_policy_dir), "path/to/policy": str(untrained_policy_dir),
            "my_problems.jsonl": str(problems)}


def path_literals(code: str) -> set[str]:
    """String literals of ``code`` that name a file or directory: no spaces, and a '/' or a file suffix; a key
    in a subscript (``history[-1]["eval/accuracy"]``) names a metric, not a path."""
    tree = ast.parse(code)
    keys = {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
               and isinstance(node.value, str) and id(node) not in keys}
    return {s for s in strings if s and not re.search(r"\s", s) and ("/" in s or re.search(r"\.[a-z]{2,5}$", s))}


def test_pages_have_runnable_blocks():
    assert len([block for block in PYTHON if block.needs is None]) >= 5, "did the ```python fence style change?"
    assert len([block for block in BASH if block.needs is None]) >= 6, "did the ```bash fence style change?"


def test_readme_is_a_short_guide_with_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines; at most " \
        f"{README_MAX_LINES}: move detail to docs/"
    setup = [block for block in BASH if block.page == "README.md" and block.needs and "set-up" in block.needs]
    assert [commands(block.code) for block in setup] == [
        ['pip install "torch==2.13.0" -e . && python train_math.py'],
        ['pip install "torch==2.13.0" -e ".[dev]" && python -m pytest']]
    # .ci/run reads the line after the marker and the fence: the test command, verbatim
    lines = text.splitlines()
    marker = lines.index("<!-- test-command -->")
    assert lines[marker + 1:marker + 3] == ["```bash", 'pip install "torch==2.13.0" -e ".[dev]" && python -m pytest']


def test_pages_point_only_inside_the_repo():
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text, f"{page.relative_to(ROOT)} points outside the repository (../shared)"
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and file.suffix == ".md":
                assert anchor in heading_anchors(file), f"{page.relative_to(ROOT)} links to {target}: no such heading"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.fixture(scope="module")
def train_math_flags() -> set[str]:
    """Every flag name ``python train_math.py --helpfull`` lists (booleans also with their ``no`` prefix)."""
    result = subprocess.run([sys.executable, "train_math.py", "--helpfull"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    listed = re.findall(r"^\s+--(\[no\])?([a-z0-9_]+):", result.stdout, flags=re.M)
    assert listed, f"train_math.py --helpfull listed no flags:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    return {name for _, name in listed} | {f"no{name}" for negatable, name in listed if negatable}


@pytest.mark.parametrize("block", [block for block in BASH if "train_math.py" in block.code], ids=lambda b: b.name)
def test_train_math_commands_name_real_flags(block, train_math_flags):
    for command in commands(block.code):
        if "train_math.py" not in command:
            continue
        named = set(re.findall(r"(?<=\s)--([a-z0-9_]+)", command.split("train_math.py", 1)[1]))
        assert named <= train_math_flags, f"{block.name} passes unknown flags {sorted(named - train_math_flags)}"


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.name)
def test_python_block_runs(block, placeholders):
    if block.needs:
        pytest.skip(f"{block.name} needs {block.needs}")
    if '"MATH-' in block.code and not BUNDLED_MATH500.exists():
        pytest.skip(f"{block.name} reads the bundled MATH-500, absent in this checkout ({BUNDLED_MATH500})")
    code = block.code
    for literal in sorted(path_literals(code) - placeholders.keys()):
        assert (ROOT / literal).exists(), (
            f"{block.name} names {literal!r}, which is neither a path in the repo nor a placeholder this test "
            "knows: add it to the placeholders fixture")
    for placeholder, path in placeholders.items():
        code = code.replace(placeholder, path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"{block.name} failed:\n{block.code}\n{result.stderr[-3000:]}"


def smoke_script(code: str, tmp: Path) -> str:
    """A quickstart block as the bash script this test runs: strict, budgets shrunk to ``SMOKE_STEPS`` (a
    train_math command without one gets it: the default budget is a ten-minute run), runs under ``tmp``,
    background jobs killed on exit."""
    def shrink(match: re.Match) -> str:
        return f"{match.group(1)} {min(int(match.group(2)), SMOKE_STEPS)}"

    code = re.sub(r"(--(?:num_)?env_steps) (\d+)", shrink, code)
    code = code.replace("train_math.py", f"train_math.py --logdir {tmp / 'runs'} --num_env_steps {SMOKE_STEPS}")
    code = code.replace(" runs/", f" {tmp}/runs/")  # a block's own --num_env_steps, shrunk above, comes later
    return "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + code


def test_smoke_script_shrinks_budgets_and_moves_runs(tmp_path):
    script = smoke_script("python train_math.py --num_env_steps 6400\npython train_math.py --seed 1\n"
                          "python -m bench.learning_table --env_steps 100 --out runs/grid\n", tmp_path)
    smoke = f"train_math.py --logdir {tmp_path / 'runs'} --num_env_steps {SMOKE_STEPS}"
    assert f"{smoke} --num_env_steps {SMOKE_STEPS}\n" in script and f"{smoke} --seed 1\n" in script
    assert f"--env_steps 100 --out {tmp_path}/runs/grid" in script


def variables_set_before(block: Block) -> str:
    """The ``NAME=...`` lines of the runnable bash blocks before ``block`` on its page."""
    earlier = [b for b in BASH if b.page == block.page and b.index < block.index and not b.needs]
    return "".join(line + "\n" for b in earlier for line in commands(b.code) if re.match(r"[A-Z][A-Z0-9_]*=", line))


def test_variables_carry_to_later_blocks_of_a_page():
    later = [block for block in BASH if "$TINY" in block.code and not block.needs]
    assert later and all(variables_set_before(block).startswith("TINY=$(") for block in later)


@pytest.mark.slow
@pytest.mark.parametrize("block", BASH, ids=lambda b: b.name)
def test_bash_block_runs(block, tmp_path):
    if block.needs:
        pytest.skip(f"{block.name} needs {block.needs}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = smoke_script(variables_set_before(block) + block.code, tmp_path)
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (f"{block.name} failed:\n{block.code}\n{result.stdout[-2000:]}\n"
                                    f"{result.stderr[-3000:]}")
