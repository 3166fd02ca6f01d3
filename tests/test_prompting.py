"""models.prompting.build_template: the plain and Qwen-Math templates, and the tokenizer's own chat template,
whose filled-in prompts tokenize to exactly the ids ``apply_chat_template`` gives."""

from __future__ import annotations

import copy

import pytest

from envs.datasets import Arith
from envs.rewards import StepContext
from envs.multi_agent import MultiAgentMathVectorEnv
from envs.prompts import DEFAULT_TEMPLATE, TEMPLATES, format_prompt
from envs.workflows import VERIFIER_INSTRUCTIONS, chain
from models.prompting import build_template
from train.config import ANSWER_INSTRUCTION
from reward_models.target_solver import TargetSolver

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
          "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA_STYLE = ("{{ bos_token }}{% for message in messages %}{{ '[' + message['role'] + '] ' + message['content'] }}"
               "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}")
PROBLEMS = [p.problem for p in Arith().problems(4, seed=3)] + ["What is $\\frac{1}{2}$ of {x}?"]


@pytest.fixture
def chat_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = CHATML
    return tokenizer


def by_hand(tokenizer, user: str, system: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("system", [None, "Answer in \\boxed{}."])
def test_chat_prompts_tokenize_as_the_chat_template_applied_by_hand(chat_tokenizer, system):
    template = build_template("chat", chat_tokenizer, system_prompt=system)
    for problem in PROBLEMS:
        ids = chat_tokenizer(format_prompt(problem, template))["input_ids"]
        assert ids == by_hand(chat_tokenizer, problem, system)
    assert format_prompt("1 + 2", template).endswith("<|im_start|>user\n1 + 2<|im_end|>\n<|im_start|>assistant\n")


def test_the_answer_instruction_ends_the_user_turn(chat_tokenizer):
    template = build_template("chat", chat_tokenizer, answer_instruction=ANSWER_INSTRUCTION)
    context = "[solver]\n1 + 2 = 3\n\n"
    for problem in PROBLEMS:
        ids = chat_tokenizer(format_prompt(problem, template, context))["input_ids"]
        assert ids == by_hand(chat_tokenizer, f"{context}{problem} {ANSWER_INSTRUCTION}")
    assert build_template("chat", chat_tokenizer, answer_instruction="") == build_template("chat", chat_tokenizer)


def test_a_roles_context_goes_inside_the_user_turn(chat_tokenizer):
    template = build_template("chat", chat_tokenizer)
    context = "[solver]\n1 + 2 = 3\n\nCheck the solution.\n\n"
    ids = chat_tokenizer(format_prompt(PROBLEMS[0], template, context))["input_ids"]
    assert ids == by_hand(chat_tokenizer, context + PROBLEMS[0])
    # The plain template keeps the context in front of the whole prompt, as workflows always wrote it.
    assert format_prompt("1 + 2", DEFAULT_TEMPLATE, context) == context + "Problem: 1 + 2\nSolution:\n"


def test_every_role_of_a_workflow_reads_one_conversation(chat_tokenizer):
    template = build_template("chat", chat_tokenizer, system_prompt="Solve it.")
    arith = Arith().problems(4, seed=1)
    env = MultiAgentMathVectorEnv(num_envs=1, problems=arith, workflow=chain("line"), template=template)
    obs, info = env.reset(seed=0)
    problem = next(p for p in arith if p.id == info["problem_id"][0])
    assert chat_tokenizer(obs[0][0])["input_ids"] == by_hand(chat_tokenizer, problem.problem, "Solve it.")
    obs, *_ = env.step([[problem.solution, "", ""]])
    verifier_reads = f"[solver]\n{problem.solution}\n\n{VERIFIER_INSTRUCTIONS['line']}\n\n{problem.problem}"
    assert chat_tokenizer(obs[0][1])["input_ids"] == by_hand(chat_tokenizer, verifier_reads, "Solve it.")


def test_the_target_solver_continues_the_prefix_in_its_assistant_turn(chat_tokenizer):
    problem = Arith().problems(1, seed=2)[0]
    steps = problem.solution.split("\n\n")
    solver = TargetSolver(generator=None, template=build_template("chat", chat_tokenizer))
    prompt, = solver.prompts([StepContext(problem, tuple(steps[:1]), steps[1], done=True)])
    expected = by_hand(chat_tokenizer, problem.problem) + chat_tokenizer(f"{steps[0]}\n\n{steps[1]}")["input_ids"]
    assert chat_tokenizer(prompt)["input_ids"] == expected
    assert TargetSolver(generator=None, template="qwen_math").template == TEMPLATES["qwen_math"]


def test_a_bos_the_tokenizer_adds_itself_is_not_doubled(chat_tokenizer):
    chat_tokenizer.chat_template = LLAMA_STYLE
    chat_tokenizer.bos_token = "<|endoftext|>"
    chat_tokenizer.add_bos_token = True
    template = build_template("chat", chat_tokenizer)
    assert not template.startswith("<|endoftext|>")
    ids = chat_tokenizer(format_prompt(PROBLEMS[1], template))["input_ids"]
    assert ids == by_hand(chat_tokenizer, PROBLEMS[1]) and ids.count(chat_tokenizer.bos_token_id) == 1


def test_plain_and_qwen_math_templates(tiny_tokenizer):
    assert build_template("default", tiny_tokenizer) == DEFAULT_TEMPLATE
    assert build_template("qwen_math", tiny_tokenizer) == TEMPLATES["qwen_math"]
    assert format_prompt("1 + 2", "qwen_math") == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\n1 + 2<|im_end|>\n<|im_start|>assistant\n")
    mine = build_template("qwen_math", tiny_tokenizer, system_prompt="Be brief.")
    assert format_prompt("1 + 2", mine).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1 + 2")


def test_what_cannot_be_built_fails_in_one_line(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"^the tokenizer of .* has no chat template: use --prompt_template default"):
        build_template("chat", tiny_tokenizer)
    with pytest.raises(ValueError, match=r"^--system_prompt needs a chat prompt template"):
        build_template("default", tiny_tokenizer, system_prompt="Be brief.")
    with pytest.raises(ValueError, match=r"^prompt_template='chatml' must be one of 'default', 'qwen_math', 'chat'$"):
        build_template("chatml", tiny_tokenizer)
