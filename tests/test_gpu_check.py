"""bench/gpu_check.py: the published Qwen2.5 shapes, the full-vocabulary tokenizer and prompt lengths, the
peak table, and the whole check on a tiny model on the CPU (so the device run cannot rot)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import gpu_check
from envs.prompts import format_prompt

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, params", [("0.5b", 494_032_768), ("1.5b", 1_543_714_304)])
def test_shapes_have_the_published_parameter_counts(name, params):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gpu_check.qwen2_config(gpu_check.SHAPES[name]))
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as Qwen2.5's small models


def test_tokenizer_covers_the_vocabulary_and_prompts_have_the_asked_length(tmp_path):
    tokenizer = gpu_check.byte_level_tokenizer(1000)
    assert len(tokenizer) == 1000 and tokenizer.eos_token_id == tokenizer.pad_token_id == 999
    assert len(set(tokenizer.convert_ids_to_tokens(list(range(1000))))) == 1000
    assert "\n" not in tokenizer.decode(list(range(256, 999)))  # filler tokens never form a stop string
    gpu_check.write_problems(tmp_path / "problems.jsonl", 8, 40)
    texts = [json.loads(line)["problem"] for line in (tmp_path / "problems.jsonl").read_text().splitlines()]
    assert len(set(texts)) == 8
    assert {len(tokenizer(format_prompt(text))["input_ids"]) for text in texts} == {40}
    with pytest.raises(ValueError, match="--prompt_tokens=25 leaves 5 tokens"):
        gpu_check.write_problems(tmp_path / "short.jsonl", 8, 25)


def test_peak_flops_by_device_name():
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_check.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_check.peak_flops("NVIDIA H200") == 989e12
    assert gpu_check.peak_flops("cpu") is None


def test_tiny_check_on_cpu_prints_one_row_per_backend(tmp_path):
    out = tmp_path / "table.md"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--models", "tiny", "--device", "cpu", "--batch", "8",
         "--prompt_tokens", "32", "--new_tokens", "16", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    caption, _, *lines = out.read_text().splitlines()
    assert caption.startswith("cpu: train_math.py GRPO, full fine-tuning in bfloat16")
    assert "8 samples (2 prompts x 4) of 32 prompt + 16 new tokens, 4 micro-batches per update" in caption
    rows = {tuple(cells[:3]): cells[3:] for cells in (line.strip("| ").split(" | ") for line in lines[2:])}
    assert list(rows) == [("tiny", "0.1M", "hf"), ("tiny", "0.1M", "vllm")]
    tokens_per_second, iteration, generate, reward, update, sync, peak_gib, mfu = rows["tiny", "0.1M", "hf"]
    assert float(tokens_per_second.replace(",", "")) > 0 and float(peak_gib) > 0
    assert float(generate) > 0 and float(update) > 0 and float(sync) == 0.0  # HF generates with the live weights
    assert float(iteration) == pytest.approx(float(generate) + float(reward) + float(update), abs=0.02)
    assert mfu == "-"  # no peak FLOP/s for a CPU
    if importlib.util.find_spec("vllm") is None:
        assert rows["tiny", "0.1M", "vllm"] == ["vllm not installed"] + ["-"] * 7
    assert completed.stdout.splitlines()[:4] == lines[:4]  # the same table on stdout


def test_batch_must_hold_whole_groups():
    completed = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--batch", "6"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2
    assert "--batch=6 must be a positive multiple of the group size 4" in completed.stderr
