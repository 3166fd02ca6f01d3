"""Prompt templates and the step format shared by the env, the reward models and the tiny models.

A solution is a sequence of steps joined by ``STEP_DELIMITER``; the last step holds the final
answer in ``\\boxed{...}``. The policy generates one step at a time and stops at the delimiter.
"""

from __future__ import annotations

STEP_DELIMITER = "\n\n"
"""Separates reasoning steps. Two newlines: what Qwen-style math models emit between steps, and
one token in their tokenizers (and in the tiny tokenizer)."""

DEFAULT_TEMPLATE = "Problem: {problem}\nSolution:\n"
"""The prompt the policy sees; ``{problem}`` is replaced by the problem text."""

TEMPLATES = {
    "default": DEFAULT_TEMPLATE,
    "qwen_math": (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within "
        "\\boxed{}.<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
    ),
}


def resolve_template(template: str) -> str:
    """Returns a template string: a key of ``TEMPLATES`` or a literal containing ``{problem}``."""
    if template in TEMPLATES:
        return TEMPLATES[template]
    if "{problem}" not in template:
        raise ValueError(
            f"prompt template {template!r} is neither one of {sorted(TEMPLATES)} nor a format "
            "string containing '{problem}'"
        )
    return template


def format_prompt(problem: str, template: str = DEFAULT_TEMPLATE) -> str:
    """The prompt for ``problem``; ``template`` is a key of ``TEMPLATES`` or a string with ``{problem}``.

    Plain substitution, not ``str.format``: templates hold LaTeX braces such as ``\\boxed{}``.
    """
    return resolve_template(template).replace("{problem}", problem)


def join_steps(steps: list[str] | tuple[str, ...], delimiter: str = STEP_DELIMITER) -> str:
    """The solution text of ``steps``, each followed by the delimiter (as the policy saw it)."""
    return "".join(step + delimiter for step in steps)


def split_steps(solution: str, delimiter: str = STEP_DELIMITER) -> list[str]:
    """The non-empty steps of a solution text."""
    return [step.strip() for step in solution.split(delimiter) if step.strip()]


SHEPHERD_STEP_TAG = "ки"
"""Math-Shepherd's step tag: the PRM reads P('+') vs P('-') at each tag position."""


def shepherd_text(prompt: str, steps: list[str] | tuple[str, ...], step_tag: str = SHEPHERD_STEP_TAG,
                  delimiter: str = STEP_DELIMITER) -> str:
    """PRM input in Math-Shepherd format: the prompt, then each step followed by ``' ' + step_tag``
    and the delimiter. The tiny PRM is trained on exactly this text."""
    return prompt + "".join(f"{step} {step_tag}{delimiter}" for step in steps)
