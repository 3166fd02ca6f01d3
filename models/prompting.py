"""Prompt templates for a model: the plain ones of ``envs.prompts`` or the tokenizer's own chat template.

``build_template`` returns a template string holding ``{problem}`` (and ``{context}``), which the envs and
the target solver fill in without a tokenizer: ``chat`` renders the tokenizer's chat template once around
a placeholder user message, with the generation prompt, so an instruct model sees the conversation it
was tuned on. ``tool_turn_template`` does the same for what follows a tool call (the env's ``tool_turn``):
the chat template's tool role where it has one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envs.modes import PromptTemplate, member_of
from envs.prompts import QWEN_MATH_SYSTEM, TEMPLATES, chatml_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

USER_SLOT = "MATHRL-USER-TURN-7f3a9c"
"""Stands in for the user's message while the chat template renders; replaced by the env's placeholders."""
ASSISTANT_SLOT, TOOL_SLOT = "MATHRL-ASSISTANT-TURN-7f3a9c", "MATHRL-TOOL-TURN-7f3a9c"


def build_template(kind: PromptTemplate, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None,
                   answer_instruction: str = "") -> str:
    """A template for ``envs.prompts.format_prompt`` (the envs' ``template=``) of ``kind``: ``default``
    (plain text; takes no system prompt), ``qwen_math`` (ChatML with ``system_prompt``, Qwen-Math's by
    default, which already asks for a boxed answer) or ``chat`` (``tokenizer``'s chat template; a system turn
    only when ``system_prompt`` is given; the user turn ends with ``answer_instruction`` when it is not empty,
    e.g. a sentence asking for the answer in ``\\boxed{}``)."""
    kind = member_of(tuple(PromptTemplate), kind, "prompt_template")
    if kind is PromptTemplate.DEFAULT:
        if system_prompt is not None:
            raise ValueError("--system_prompt needs a chat prompt template (--prompt_template chat or qwen_math); "
                             "the default plain template has no system turn")
        return TEMPLATES[PromptTemplate.DEFAULT]
    if kind is PromptTemplate.QWEN_MATH:
        return chatml_template(QWEN_MATH_SYSTEM if system_prompt is None else system_prompt)
    return chat_template(tokenizer, system_prompt, answer_instruction)


def chat_template(tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None,
                  answer_instruction: str = "") -> str:
    """``tokenizer``'s chat template rendered around one user message (after a system message when
    ``system_prompt`` is given) with the generation prompt, the message replaced by ``{context}{problem}``
    and, when given, a space and ``answer_instruction`` (after the problem, where verl's recipes put it).
    A leading BOS the template writes is dropped when the tokenizer adds it itself, so tokenizing the
    filled-in prompt gives the ids ``apply_chat_template`` gives."""
    where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {where} has no chat template: use --prompt_template default or qwen_math, "
                         "or a model whose tokenizer_config.json has one")
    messages = [{"role": "user", "content": USER_SLOT}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(USER_SLOT) != 1 or "{problem}" in text or "{context}" in text:
        raise ValueError(f"the chat template of {where} does not render the user message once as written "
                         f"(or its text holds '{{problem}}'/'{{context}}'): use --prompt_template default or qwen_math")
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and adds_bos(tokenizer):
        text = text[len(bos):]
    user_turn = "{context}{problem}" + (f" {answer_instruction}" if answer_instruction else "")
    return text.replace(USER_SLOT, user_turn)


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer(text)`` puts the BOS token in front by itself."""
    ids = tokenizer("x")["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id and ids != plain


def tool_turn_template(kind: PromptTemplate, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """What follows a tool call's step in a ``kind`` prompt (``envs.math_env.MathTask``'s ``tool_turn``, holding
    ``{output}``): under ``chat``, the tokenizer's chat template from the end of an assistant message through a
    ``tool`` message and the next generation prompt, where the template renders a tool role; else None (the
    env's plain ```` ```output ```` block, which Qwen2.5-Math's tool-integrated reasoning also writes)."""
    if kind != PromptTemplate.CHAT or not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": USER_SLOT}, {"role": "assistant", "content": ASSISTANT_SLOT},
                {"role": "tool", "content": TOOL_SLOT}]
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:  # the template's raise_exception: it refuses a tool role, so it has none
        return None
    if text.count(ASSISTANT_SLOT) != 1 or text.count(TOOL_SLOT) != 1 or "{output}" in text:
        return None
    turn = text.split(ASSISTANT_SLOT, 1)[1]
    return turn.replace(TOOL_SLOT, "{output}") if TOOL_SLOT in turn else None

