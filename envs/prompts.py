"""Prompt templates and the step format shared by the env, the reward models and the tiny models.

A solution is a sequence of steps joined by ``STEP_DELIMITER``; the last step holds the final
answer in ``\\boxed{...}``. The policy generates one step at a time and stops at the delimiter.

A template is a string holding ``{problem}``. What a workflow's role reads before the problem (earlier
messages, its instruction) goes where the template holds ``{context}``: inside the user turn of a
chat template, so the whole prompt stays one conversation. A template without ``{context}`` (the
default plain one) gets it in front of the whole prompt.
"""

from __future__ import annotations

STEP_DELIMITER = "\n\n"
"""Separates reasoning steps. Two newlines: what Qwen-style math models emit between steps, and
one token in their tokenizers (and in the tiny tokenizer)."""

DEFAULT_TEMPLATE = "Problem: {problem}\nSolution:\n"
"""The prompt the policy sees; ``{problem}`` is replaced by the problem text."""

QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
"""The system prompt Qwen2.5-Math's model card evaluates with."""


def chatml_template(system_prompt: str) -> str:
    """A ChatML conversation (Qwen's format): ``system_prompt``, the user turn holding the context and the
    problem, then the opened assistant turn the policy writes in."""
    return (f"<|im_start|>system\n{system_prompt}<|im_end|>\n<|im_start|>user\n{{context}}{{problem}}<|im_end|>\n"
            "<|im_start|>assistant\n")


TEMPLATES = {
    "default": DEFAULT_TEMPLATE,
    "qwen_math": chatml_template(QWEN_MATH_SYSTEM),
}


def resolve_template(template: str) -> str:
    """Returns a template string: a key of ``TEMPLATES`` or a literal containing ``{problem}`` (and at most
    one ``{context}``)."""
    if template in TEMPLATES:
        return TEMPLATES[template]
    if "{problem}" not in template or template.count("{context}") > 1:
        raise ValueError(
            f"prompt template {template!r} is neither one of {sorted(TEMPLATES)} nor a format "
            "string containing '{problem}' (and at most one '{context}')"
        )
    return template


def format_prompt(problem: str, template: str = DEFAULT_TEMPLATE, context: str = "") -> str:
    """The prompt for ``problem``; ``template`` is a key of ``TEMPLATES`` or a string with ``{problem}``.
    ``context`` (text a role reads before the problem, ending in its own separator) goes where the template
    holds ``{context}``, or in front of the prompt when it holds none.

    Plain substitution, not ``str.format``: templates hold LaTeX braces such as ``\\boxed{}``; the context
    (model output) is inserted last, so a ``{problem}`` inside it stays as written.
    """
    pieces = [piece.replace("{problem}", problem) for piece in resolve_template(template).split("{context}")]
    if len(pieces) == 1:
        return context + pieces[0]
    return context.join(pieces)


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
