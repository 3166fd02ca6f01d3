"""What a grading worker runs on a request: this project's symbolic verdict, math-verify's equivalence or a
reasoning-gym dataset's own scorer, each a score in [0, 1].

The external scorers build sympy objects from model text or parse it their own way, so they run only in the
bounded workers (``workers``), never in the caller's process; ``scorer_packages`` names what the workers
must import ahead and fails early, naming the extra, when this interpreter lacks it.
"""

from __future__ import annotations

import functools
import importlib.util
import json

from .comparison import symbolic_verdict

EXTRAS = {"math_verify": "math-verify", "reasoning_gym": "rg"}  # scorer -> the mathrl extra that installs it


def math_verify_equiv(pred: str, gold: str) -> bool:
    """math-verify's verdict on the answer ``pred`` against the reference ``gold``, each parsed inside
    ``\\boxed{}`` as LaTeX alone (TRL's ``accuracy_reward`` parses a completion so: its plain-expression parser
    would hand the text to sympy's ``parse_expr``, an ``eval``), as ``verify(gold, target)`` takes them. It
    builds sympy objects from model text: it runs in the grading workers (``grade_batch(...,
    grader="math_verify")``), never in the caller's process."""
    from math_verify import LatexExtractionConfig, parse, verify

    latex = [LatexExtractionConfig()]
    return bool(verify(parse(f"\\boxed{{{gold}}}", extraction_config=latex),
                       parse(f"\\boxed{{{pred}}}", extraction_config=latex)))


@functools.lru_cache(maxsize=16)
def _reasoning_gym_dataset(name: str, config: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config))


def reasoning_gym_score(answer: str, source: str) -> float:
    """reasoning-gym's own score in [0, 1] of ``answer`` to the problem ``source`` names (JSON
    ``{"name", "config", "index"}``: entry ``index`` of ``create_dataset(name, **config)``, regenerated here,
    since its generators are seeded per index), by that dataset's ``score_answer``. Runs in the grading
    workers (``reasoning_gym_scores``): a scorer may parse the answer with sympy."""
    spec = json.loads(source)
    dataset = _reasoning_gym_dataset(spec["name"], json.dumps(spec["config"], sort_keys=True))
    return float(dataset.score_answer(answer, dataset[spec["index"]]))


SCORERS = {"mathrl": symbolic_verdict, "math_verify": math_verify_equiv, "reasoning_gym": reasoning_gym_score}
"""What a worker runs for a request [name, *arguments]; a score in [0, 1] (a verdict: 1.0 or 0.0). Keyed by the
names requests carry (a ``Grader``'s value, or reasoning-gym's), as strings: the workers import nothing of envs."""


def scorer_packages(scorer: str) -> frozenset[str]:
    """The package the workers must import ahead for ``scorer`` (a key of ``SCORERS``): an ImportError naming
    the extra that installs it when this interpreter lacks it (a worker would only score 0)."""
    if scorer not in SCORERS:
        raise ValueError(f"scorer {scorer!r} must be one of {sorted(SCORERS)}")
    if scorer not in EXTRAS:  # this project's own: sympy, which every worker imports
        return frozenset()
    package = str(scorer)
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"the {package!r} scorer needs the {package} package: "
                          f"pip install 'mathrl[{EXTRAS[package]}]'")
    return frozenset({package})

