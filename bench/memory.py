"""Peak memory and time of one GRPO iteration (generation + update): ours against ``trl.GRPOTrainer``.

    pip install -e ".[bench]"        # trl==1.16.0
    python bench/memory.py [--device cpu|cuda] [--models 0.5b,1.5b] [--cases lora,full]
                           [--checkpointing on,off] [--prompts 8] [--samples 4]
                           [--prompt_tokens 256] [--response_tokens 512]
    python bench/memory.py --models small --prompts 2 --samples 2 --prompt_tokens 32 --response_tokens 16

Models are random-init at the real configs of Qwen2.5-0.5B and 1.5B (``small``: 2 layers of 64 at the
same vocabulary, for a quick check), written in bfloat16 with a byte-level tokenizer (built with the
``tokenizers`` library) that covers the whole 151,936-token vocabulary: no network, no hub. Every
prompt holds ``--prompt_tokens`` tokens; a random-init model almost never samples its end token, so
every response runs to ``--response_tokens``. Both sides see the same prompts and the same reward
(``bench/vs_trl.py``'s outcome plus a hash of the text, so no group has all-equal rewards and neither
side skips its update), bfloat16 compute, fp32 trainable weights (the frozen LoRA base in bfloat16),
rank-16 LoRA on all linear layers or full fine-tuning, the same activation checkpointing, one
optimizer step over all ``--prompts`` x ``--samples`` completions, no KL, no evaluation.

Ours runs as ``train_math.py`` runs it, with its process set-up (``train.host``: on a CPU, freed tensors go
back to the OS). Each case runs in a fresh process: peak memory is the peak resident set size on CPU and
``torch.cuda.max_memory_allocated`` on CUDA; time is the iteration's wall time (model loading
excluded). The floor is what weights, gradients and AdamW states alone take. Full fine-tuning at
1.5B is left out (the issue's grid); ask for it with ``--full_models``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN = {"vocab_size": 151_936, "max_position_embeddings": 32_768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "num_key_value_heads": 2}
MODELS = {  # the real Qwen2.5 configs (config.json of Qwen/Qwen2.5-0.5B and -1.5B), and a small check
    "0.5b": {**QWEN, "hidden_size": 896, "intermediate_size": 4_864, "num_hidden_layers": 24,
             "num_attention_heads": 14},
    "1.5b": {**QWEN, "hidden_size": 1_536, "intermediate_size": 8_960, "num_hidden_layers": 28,
             "num_attention_heads": 12},
    "small": {**QWEN, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
}
LORA_RANK = 16
LR = 1e-6
EOS = "<|endoftext|>"
RESULT = "RESULT "  # the prefix of a case process's one line of result


def write_model(name: str, out: Path) -> Path:
    """A random-init Qwen2 of config ``name`` in bfloat16 and a tokenizer covering its vocabulary, in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    config = Qwen2Config(**MODELS[name], eos_token_id=MODELS[name]["vocab_size"] - 1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    # Byte-level BPE without merges, as Qwen2's tokenizer class loads it: each byte of a text is one token;
    # the rest of the vocabulary are filler tokens a random-init model samples.
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {f"t{i}": i for i in range(len(vocab), config.vocab_size - 1)} | {EOS: config.vocab_size - 1}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS).save_pretrained(out)
    return out


def write_problems(out: Path, count: int, prompt_tokens: int) -> Path:
    """``count`` problems whose prompts (the env's default template) hold exactly ``prompt_tokens`` tokens:
    random lowercase letters, one token each."""
    from envs.prompts import format_prompt

    generator = torch.Generator().manual_seed(0)
    with out.open("w") as file:
        for i in range(count):
            letters = torch.randint(ord("a"), ord("z") + 1, (prompt_tokens - len(format_prompt("")),),
                                    generator=generator)
            file.write(json.dumps({"problem": "".join(map(chr, letters.tolist())), "answer": "1",
                                   "unique_id": f"p{i}"}) + "\n")
    return out


def peak_memory(device: str) -> float:
    """GiB: this process's peak resident set (cpu) or peak CUDA allocation (cuda)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_ours(args: argparse.Namespace, model_dir: Path, problems: Path, scratch: Path) -> float:
    """Seconds of one ``Runner.train_iteration`` built as train_math.py builds it."""
    from tensorboardX import SummaryWriter

    from train import builders, host
    from train.flags import FLAGS, config_from_flags
    from vs_trl import reward_every_group

    FLAGS(["memory", f"--model_name_or_path={model_dir}", "--algorithm_name=GRPO", "--env_id=MATH-v0",
           f"--dataset_path={problems}", f"--n_rollout_threads={args.prompts * args.samples}",
           f"--group_size={args.samples}", f"--num_env_steps={args.prompts * args.samples * 1000}",
           f"--max_new_tokens={args.response_tokens}", "--temperature=1.0", f"--lr={LR}", "--warmup_iterations=0",
           "--lr_schedule=constant", "--max_grad_norm=1.0", "--clip_param=0.2", "--kl_coef=0",
           "--loss_agg_mode=token-mean", "--scale_rewards=group", "--eval_interval=0", "--save_interval=0",
           "--nosave_best",
           "--seed=0", "--noasync_rollouts", f"--device={args.device}", "--dtype=bfloat16",
           f"--lora_rank={LORA_RANK if args.mode == 'lora' else 0}",
           f"--{'' if args.gc == 'on' else 'no'}gradient_checkpointing", f"--logdir={scratch}",
           f"--torch_threads={torch.get_num_threads()}"])
    config = config_from_flags(FLAGS)
    host.set_up(config.model)  # as train_math.py does
    writer = SummaryWriter(str(scratch))
    runner = builders.build_runner(config, scratch, writer)
    reward_every_group(runner)
    synchronize(args.device)
    started = time.perf_counter()
    runner.train_iteration(0, {})
    synchronize(args.device)
    writer.close()
    return time.perf_counter() - started


def run_trl(args: argparse.Namespace, model_dir: Path, problems: Path, scratch: Path) -> float:
    """Seconds of one ``GRPOTrainer`` step (``train()`` with ``max_steps=1``) at our settings."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from envs.datasets import load_problems
    from envs.prompts import format_prompt
    from vs_trl import TextHashOutcome, env_reward_function

    pool = load_problems(problems)
    dataset = Dataset.from_list([{"prompt": format_prompt(p.problem), "problem_id": p.id} for p in pool])
    batch = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=str(scratch), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=args.samples, max_completion_length=args.response_tokens, temperature=1.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, num_iterations=1,
        epsilon=0.2, scale_rewards="group", loss_type="dapo", bf16=True, use_cpu=args.device == "cpu",
        gradient_checkpointing=args.gc == "on", max_steps=1, seed=0, report_to="none",
        logging_strategy="no", save_strategy="no", disable_tqdm=True, shuffle_dataset=False,
        # ours: fp32 trainable weights under bf16 autocast; a frozen LoRA base in bf16
        model_init_kwargs={"dtype": torch.bfloat16 if args.mode == "lora" else torch.float32})
    lora = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=str(model_dir),
                          reward_funcs=env_reward_function(TextHashOutcome(), {p.id: p for p in pool}),
                          args=config, train_dataset=dataset, peft_config=lora if args.mode == "lora" else None)
    synchronize(args.device)
    started = time.perf_counter()
    trainer.train()
    synchronize(args.device)
    return time.perf_counter() - started


def floor_gib(model: str, mode: str) -> float:
    """GiB that weights, gradients and AdamW states take: fp32 weights + grads + 2 moments (16 B a parameter)
    for full fine-tuning; the bf16 base (2 B) plus that of the adapters for LoRA."""
    config = MODELS[model]
    hidden, inter, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                         "vocab_size"))
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter  # q, o, k, v; gate, up, down
    params = vocab * hidden + layers * per_layer
    if mode == "full":
        return 16 * params / 2**30
    lora_params = layers * LORA_RANK * (4 * hidden + 2 * (hidden + kv) + 3 * (hidden + inter))
    return (2 * params + 16 * lora_params) / 2**30


def run_case(args: argparse.Namespace) -> None:
    """In a fresh process: one side's iteration; prints its ``RESULT`` line."""
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        run = run_ours if args.side == "ours" else run_trl
        seconds = run(args, args.model_dir, args.problems, Path(scratch))
    print(RESULT + json.dumps({"seconds": seconds, "peak_gib": peak_memory(args.device)}), flush=True)


def spawn(args: argparse.Namespace, side: str, model: str, mode: str, checkpointing: str, model_dir: Path,
          problems: Path) -> dict:
    command = [sys.executable, __file__, "--side", side, "--mode", mode, "--gc", checkpointing,
               "--model_dir", str(model_dir), "--problems", str(problems), "--device", args.device,
               "--threads", str(args.threads), "--prompts", str(args.prompts), "--samples", str(args.samples),
               "--response_tokens", str(args.response_tokens)]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{side} {model} {mode} checkpointing {checkpointing} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT):])


def main() -> None:
    args = parse_args()
    if args.side is not None:
        return run_case(args)
    print(f"one GRPO iteration, {args.prompts} prompts x {args.samples} samples, {args.prompt_tokens} prompt + "
          f"{args.response_tokens} response tokens, bf16, {args.device}\n")
    print(f"{'model':<6} {'mode':<5} {'ckpt':<4} {'ours GiB':>9} {'TRL GiB':>8} {'ratio':>6} {'floor GiB':>9} "
          f"{'ours s':>8} {'TRL s':>8}", flush=True)
    lora_ratio = None
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            model_dir = write_model(model, Path(scratch) / model)
            problems = write_problems(Path(scratch) / f"{model}.jsonl", args.prompts, args.prompt_tokens)
            for mode in [m for m in args.cases if m == "lora" or model in args.full_models]:
                for checkpointing in args.checkpointing:
                    ours, trl = (spawn(args, side, model, mode, checkpointing, model_dir, problems)
                                 for side in ("ours", "TRL"))
                    ratio = ours["peak_gib"] / trl["peak_gib"]
                    lora_ratio = ratio if mode == "lora" and lora_ratio is None else lora_ratio
                    print(f"{model:<6} {mode:<5} {checkpointing:<4} {ours['peak_gib']:9.2f} {trl['peak_gib']:8.2f} "
                          f"{ratio:6.2f} {floor_gib(model, mode):9.2f} {ours['seconds']:8.1f} {trl['seconds']:8.1f}",
                          flush=True)
    if lora_ratio is not None:
        print(f"peak memory ours/TRL = {lora_ratio:.2f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    listed = lambda text: text.split(",")  # noqa: E731
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", type=listed, default=["0.5b", "1.5b"], help=f"of {sorted(MODELS)}")
    parser.add_argument("--cases", type=listed, default=["lora", "full"], help="lora (rank 16) and/or full")
    parser.add_argument("--full_models", type=listed, default=["0.5b", "small"],
                        help="models run with full fine-tuning")
    parser.add_argument("--checkpointing", type=listed, default=["off", "on"], help="activation checkpointing: on, off")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt_tokens", type=int, default=256)
    parser.add_argument("--response_tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on cpu")
    for name in ("side", "mode", "gc", "model_dir", "problems"):  # a case's own process
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS,
                            type=Path if name in ("model_dir", "problems") else str)
    args = parser.parse_args()
    from envs.prompts import format_prompt

    bad = [m for m in args.models if m not in MODELS] + [c for c in args.cases if c not in ("lora", "full")] + [
        c for c in args.checkpointing if c not in ("on", "off")]
    if bad:
        parser.error(f"unknown {bad}: --models takes {sorted(MODELS)}, --cases lora,full, --checkpointing on,off")
    if args.prompt_tokens <= len(format_prompt("")):
        parser.error(f"--prompt_tokens={args.prompt_tokens} must exceed the template's own tokens")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")
    return args


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages
    main()
