"""The tiny tool model: the policy taught to compute with the env's Python tool.

The tiny policy has only seen Arith's step format; it never writes code, so RL with ``tools="python"``
has no call to reinforce. The tool model is the policy checkpoint fine-tuned for ``tool_steps`` on the
two turns of a tool-using solution, each as the env presents it to the policy:

- the prompt -> one step, a fenced python block printing the problem's expression
  (```python\\nprint(57 + 25 - 43)\\n```);
- the prompt, that step and the env's tool turn with the expression's value (``plain_tool_turn``)
  -> the boxed answer step, copying the output.

The tool output is never a reply token (as in RL, where it is observation only). With the tool the
model's accuracy is the tool's. Without it (the block left unrun) the model stops: each reply is trained
to end in EOS, the call's included, so after an unrun call it ends the solution without an answer.
"""

from __future__ import annotations

import logging
from typing import Iterator

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from envs.datasets import Problem
from envs.math_env import OUTPUT_SLOT, plain_tool_turn
from envs.prompts import format_prompt, join_steps
from models.tiny.config import TinyConfig
from models.tiny.data import parse_arith, reply_batch
from models.tiny.evaluation import first_boxed_integer, greedy_completions
from models.tiny.training import adamw, sft_loss, train_step, warmup_cosine

log = logging.getLogger(__name__)


def code_step(problem: Problem) -> str:
    """The step that computes ``problem``'s expression with the tool (no step delimiter)."""
    operands, operators = parse_arith(problem)
    expression = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(operators, operands[1:])])
    return f"```python\nprint({expression})\n```"


def answer_step(value: str) -> str:
    return f"The answer is \\boxed{{{value}}}."


def tool_prompts(problem: Problem) -> tuple[str, str]:
    """(the prompt, the observation after the call and its tool turn): the two prompts of a tool-using solution."""
    prompt = format_prompt(problem.problem)
    return prompt, prompt + code_step(problem) + plain_tool_turn().replace(OUTPUT_SLOT, problem.answer)


def tool_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """``data.reply_batch`` of both turns of each problem: [2B, L] ids and [2B, L-1] target mask."""
    prompts, replies = [], []
    for problem in problems:
        first, second = tool_prompts(problem)
        prompts += [first, second]
        replies += [join_steps([code_step(problem)]), join_steps([answer_step(problem.answer)])]
    return reply_batch(tokenizer, prompts, replies)


def train_tool(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, config: TinyConfig,
               batches: Iterator[list[Problem]], device: str) -> LlamaForCausalLM:
    """``model`` (the policy checkpoint) fine-tuned on ``tool_steps`` ``tool_batch``es, every weight, lr ``tool_lr``
    with a short warmup and a cosine decay (no randomness but the batches')."""
    optimizer = adamw(model, config.tool_lr, config.weight_decay)
    model.train()
    for step in range(1, config.tool_steps + 1):
        ids, target_mask = tool_batch(tokenizer, next(batches))
        loss, _ = sft_loss(model, ids.to(device), target_mask.to(device))
        train_step(model, optimizer, loss, warmup_cosine(config.tool_lr, step, config.tool_steps, config.warmup_steps))
        if step % 25 == 0:
            log.info("tool sft step %d loss %.4f", step, loss.item())
    return model.eval()


def tool_metrics(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> dict:
    """Greedy measures on held-out ``problems``, turn by turn: ``call_accuracy``, the share whose first step is
    exactly ``code_step``; ``answer_accuracy``, the share that box the right answer after the right call and
    its output; ``no_output_accuracy``, the same after the call left unrun (the observation the env shows
    without the tool: the step and the step delimiter)."""
    prompts = [tool_prompts(p) for p in problems]
    calls = greedy_completions(model, tokenizer, [first for first, _ in prompts], max_new_tokens=48)
    answers = greedy_completions(model, tokenizer, [second for _, second in prompts], max_new_tokens=48)
    unrun = greedy_completions(model, tokenizer, [join_steps([first + code_step(p)]) for (first, _), p
                                                  in zip(prompts, problems)], max_new_tokens=48)
    return {"call_accuracy": float(np.mean([c.split("\n\n")[0] == code_step(p) for c, p in zip(calls, problems)])),
            "answer_accuracy": float(np.mean([first_boxed_integer(a) == p.answer for a, p in zip(answers, problems)])),
            "no_output_accuracy": float(np.mean([first_boxed_integer(a) == p.answer for a, p in zip(unrun, problems)]))}
