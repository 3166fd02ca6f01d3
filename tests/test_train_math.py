"""train_math.py: flag parsing and validation (unknown flags, bad paths, contradictory combinations,
--flagfile, --helpfull), a smoke run of every algorithm on the untrained tiny policy, and (slow)
OpenR's command with the tiny models writing TensorBoard event files that read back."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from absl import flags

from envs.datasets import MATH500
from envs.rewards import StepContext
from event_files import read_scalars
from test_trainer import run_train_math
from train import flags as train_flags
from train.flags import config_from_flags

ROOT = Path(__file__).resolve().parents[1]
FLAGS = train_flags.FLAGS


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train_math.py"), *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def parse(*argv: str):
    """Parses ``argv`` into the global FLAGS (validators run) and resolves them into a RunConfig, leaving
    the flags unparsed afterwards."""
    FLAGS.unparse_flags()
    try:
        FLAGS(["train_math", *argv])
        return config_from_flags(FLAGS)
    finally:
        FLAGS.unparse_flags()


def test_unknown_flag_is_an_error():
    result = run_cli("--num_mini_batchs", "4")
    assert result.returncode != 0
    assert "num_mini_batchs" in result.stderr


def test_bad_path_fails_fast_naming_the_flag():
    started = time.perf_counter()
    result = run_cli("--dataset_path", "/no/such/math_500.jsonl")
    elapsed = time.perf_counter() - started
    assert result.returncode != 0
    assert "--dataset_path" in result.stderr and "does not exist" in result.stderr
    # Interpreter start plus absl only (no torch, no model); generous for a loaded 2-core machine.
    assert elapsed < 15, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("argv, message", [
    (["--algorithm_name", "GRPO", "--group_size", "1"], "group_size=1 must be >= 2"),
    (["--algorithm_name", "RLOO", "--group_size", "1"], "group_size=1 must be >= 2"),
    (["--algorithm_name", "TPPO", "--critic", "off"], "needs a critic"),
    (["--n_rollout_threads", "12", "--group_size", "8"], "multiple of --group_size"),
    (["--reward", "outcome:1.0,prm:0.2"], "neither --prm_model_name_or_path nor --prm_url"),
    (["--target_url", "http://127.0.0.1:9"], "does not use .target."),
    (["--prm_url", "localhost:8000"], "must be http"),
    (["--generation_backend", "vllm_server"], "needs --vllm_url"),
    (["--reward", "outcom"], "unknown source"),
    (["--env_id", "Arith-v0", "--dataset_path", str(MATH500)], "drop --dataset_path"),
    (["--env_id", "MATH-v0", "--reward", "steps"], "Drop 'steps'"),
    (["--accuracy_lower_bound", "0.9", "--accuracy_upper_bound", "0.1", "--algorithm_name", "RLOO"], "<="),
    (["--accuracy_lower_bound", "0.1"], "applies to RLOO"),
    (["--algorithm_name", "GRPO", "--gae_lambda", "0.9"], "applies to APPO/TPPO"),
    (["--lr", "-1"], "must be > 0"),
    (["--top_p", "0"], "(0, 1]"),
    (["--data_parallel", "fsdp", "--lora_rank", "8"], "use --data_parallel ddp"),
    (["--model_name_or_path", str(MATH500)], "not a directory"),
    (["--system_prompt", "Be brief."], "--system_prompt needs a chat prompt template"),
    (["--model_name_or_path", "./no/such/dir"], "does not exist"),  # a path, not a hub id
])
def test_bad_values_and_contradictions_fail_naming_the_flag(argv, message):
    with pytest.raises((flags.Error, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        parse(*argv)


@pytest.mark.parametrize("argv, expected", [
    (["--algorithm_name", "GRPO"], True),  # this machine has no GPU: a second core generates
    (["--algorithm_name", "RLOO", "--device", "cpu"], True),
    (["--algorithm_name", "GRPO", "--device", "cuda"], False),  # one GPU: not worth a second copy
    (["--algorithm_name", "APPO", "--device", "cuda"], True),  # APPO is asynchronous by design
    (["--algorithm_name", "TPPO", "--noasync_rollouts"], False),
])
def test_async_rollouts_default(argv, expected):
    assert parse(*argv).generation.async_rollouts is expected


def test_max_policy_lag_without_async_rollouts_fails():
    with pytest.raises(flags.Error, match="bounds asynchronous rollouts"):
        parse("--noasync_rollouts", "--max_policy_lag", "2")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_backend_without_vllm_fails_early():
    with pytest.raises(flags.Error, match="pip install 'mathrl\\[vllm\\]'"):
        parse("--generation_backend", "vllm")


def test_openr_command_parses_unchanged(tmp_path):
    model, prm = tmp_path / "Qwen2.5-Math-1.5B", tmp_path / "Qwen2.5-Math-7B-Instruct"
    model.mkdir()
    prm.mkdir()
    config = parse("--dataset_path", str(MATH500), "--model_name_or_path", str(model),
                   "--prm_model_name_or_path", str(prm), "--algorithm_name", "APPO", "--num_mini_batch", "4",
                   "--ppo_epoch", "1", "--dataset_name", "Algebra", "--num_env_steps", "100", "--episode_length", "4",
                   "--n_rollout_threads", "4", "--eval_interval", "5", "--log_interval", "1", "--save_interval", "10",
                   "--prm_type", "MS", "--max_new_tokens", "256", "--gradient_cp_steps", "2", "--seed", "10",
                   "--experiment_name", "ms_single")
    assert config.env.env_id == "MATH-v0" and config.env.dataset_name == "Algebra"
    assert config.rewards.spec == "outcome:1.0,prm:0.2" and config.rewards.prm_type == "shepherd"
    assert config.rewards.prm_model == str(prm) and config.model.name_or_path == str(model)
    assert config.generation.async_rollouts is True
    assert config.learning.num_mini_batch == 4 and config.learning.gradient_cp_steps == 2  # nothing overridden
    assert config.budget.num_iterations == 7 and config.logging.experiment_name == "ms_single"  # ceil(100 / 16)


@pytest.mark.parametrize("argv, experiment", [((), "GRPO_Arith-v0"), (("--algorithm_name", "RLOO"), "RLOO_Arith-v0"),
                                               (("--experiment_name", "mine"), "mine")])
def test_resume_auto_looks_where_the_config_puts_the_run(tmp_path, argv, experiment):
    """``--resume auto`` is resolved from the flags before the config is built: it looks in the experiment
    directory the config then names, <logdir>/<experiment> (default <algorithm>_<env>)."""
    from train.flags import experiment_dir

    given = ("--model_name_or_path", str(tmp_path), "--logdir", str(tmp_path / "runs"), *argv)
    config = parse(*given)
    FLAGS(["train_math", *given])
    try:
        assert experiment_dir(FLAGS) == tmp_path / "runs" / experiment
    finally:
        FLAGS.unparse_flags()
    assert Path(config.logging.logdir) / config.logging.experiment_name == tmp_path / "runs" / experiment


def test_flagfile_is_read(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("--algorithm_name=RLOO\n--group_size=4\n--n_rollout_threads=16\n")
    FLAGS.unparse_flags()
    FLAGS(["train_math", f"--flagfile={flagfile}"])
    try:
        assert (FLAGS.algorithm_name, FLAGS.group_size, FLAGS.n_rollout_threads) == ("RLOO", 4, 16)
    finally:
        FLAGS.unparse_flags()


def listed_flags(help_text: str) -> list[str]:
    return re.findall(r"^  --(?:\[no\])?(\w+):", help_text, re.M)


def test_help_shows_the_newcomer_flags_grouped():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert re.findall(r"^(\w[\w ]*):$", result.stdout, re.M) == ["model", "data", "algorithm", "budget", "logging"]
    listed = listed_flags(result.stdout)
    assert listed == [name for names in train_flags.NEWCOMER_FLAGS.values() for name in names]
    assert 10 <= len(listed) <= 16 and "--helpfull lists every flag" in result.stdout
    assert "(default: 'GRPO')" in result.stdout  # a flag's default is shown


def test_helpfull_groups_every_flag_by_section():
    result = run_cli("--helpfull")
    assert result.returncode == 0, result.stderr
    assert sorted(listed_flags(result.stdout)) == sorted(train_flags.flag_dict())  # every flag, once
    titles = list(train_flags.SECTIONS)
    assert re.findall(r"^(\S.*):$", result.stdout, re.M)[-len(titles):] == titles
    sections = dict(zip(titles, re.split(r"^(?:" + "|".join(map(re.escape, titles)) + r"):$", result.stdout,
                                         flags=re.M)[1:]))
    for title, name in (("multi-agent", "agent_groups"), ("PRIME (RLOO)", "process_coef"),
                        ("Prefix-RL", "handoff_steps"), ("services", "prm_url"), ("distributed", "data_parallel"),
                        ("model", "revision"), ("data and env", "prompt_template")):
        assert name in listed_flags(sections[title]), (title, name)


def test_flag_help_quotes_no_measurement():
    measured = re.compile(r"\d\.\d+\s*(->|against|instead of)|\d+x (slower|faster)|ROC-AUC|accuracy \d")
    for name in train_flags.flag_dict():
        assert not measured.search(FLAGS[name].help), (name, FLAGS[name].help)


@pytest.mark.parametrize("name, extra", [
    ("GRPO", []), ("APPO", []), ("TPPO", []),
    # RLOO: 4x oversampled envs; every group kept, so that the implicit PRM scores and learns from every episode
    ("RLOO", ["--num_env_steps", "64", "--accuracy_lower_bound", "0", "--accuracy_upper_bound", "1"]),
    ("RLOO", ["--num_env_steps", "64", "--process_coef", "0"]),  # the outcome stream alone: no implicit PRM
    ("GRPO", ["--kl_coef", "0.05", "--loss_agg_mode", "seq-mean-token-mean", "--scale_rewards", "none",
              "--lora_rank", "4"]),
    ("REINFORCE_PP", ["--group_size", "1", "--action_level", "step", "--episode_length", "2", "--num_env_steps", "32"]),
    ("TPPO", ["--action_level", "step", "--episode_length", "2", "--gradient_cp_steps", "3", "--num_mini_batch", "2",
              "--num_env_steps", "32"]),
])
def test_every_algorithm_runs_an_iteration(untrained_policy_dir, tmp_path, name, extra):
    run_dir = run_train_math(["--algorithm_name", name, "--model_name_or_path", str(untrained_policy_dir),
                              "--num_env_steps", "16", "--n_rollout_threads", "8", "--group_size", "4",
                              "--max_new_tokens", "6", "--eval_interval", "2", "--eval_limit", "4",
                              "--eval_batch_size", "4", "--logdir", str(tmp_path), *extra])  # later flags win
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["eval/accuracy"]] == [0, 2]
    assert len(scalars["train/reward"]) == 2 and "grad/norm" in scalars and "time/generate" in scalars
    # asynchronous by default on a CPU: the second batch was generated by the previous policy
    assert [lag for _, lag in scalars["train/policy_lag"]] == [0.0, 1.0]
    assert (Path(run_dir) / "checkpoints" / "iter_2" / "policy" / "mathrl_policy.json").is_file()
    with_implicit_prm = name == "RLOO" and "--process_coef" not in extra
    assert ("implicit_prm/heldout_accuracy" in scalars) == with_implicit_prm
    if with_implicit_prm:  # before its first step the PRM is its reference: every outcome score is 0, "wrong"
        (_, heldout), (_, accuracy) = scalars["implicit_prm/heldout_accuracy"][0], scalars["train/accuracy"][0]
        assert heldout == pytest.approx(1.0 - accuracy)


@pytest.mark.parametrize("val_before_train, evaluated", [(True, [0, 2, 3]), (False, [2, 3])])
def test_a_run_builds_from_a_run_config_without_absl(untrained_policy_dir, tmp_path, val_before_train, evaluated):
    """A library user's run: a RunConfig built by hand, no flag parsed, trains and evaluates every second
    iteration and at the end (before the first iteration too unless ``val_before_train`` is off)."""
    from tensorboardX import SummaryWriter

    from train.builders import build_runner
    from train.config import BudgetConfig, EnvConfig, GenerationConfig, LoggingConfig, ModelConfig, RunConfig

    FLAGS.unparse_flags()
    config = RunConfig(model=ModelConfig(name_or_path=str(untrained_policy_dir), device="cpu"),
                       env=EnvConfig(num_envs=8, group_size=4), generation=GenerationConfig(max_new_tokens=6),
                       budget=BudgetConfig(num_iterations=3, eval_interval=2, eval_limit=4, eval_batch_size=4,
                                           val_before_train=val_before_train),
                       logging=LoggingConfig(save_interval=0, save_best=False))
    writer = SummaryWriter(str(tmp_path))
    history = build_runner(config, tmp_path, writer).run()
    writer.close()
    assert not FLAGS.is_parsed()
    assert [h["iteration"] for h in history] == evaluated
    assert [step for step, _ in read_scalars(tmp_path)["eval/accuracy"]] == evaluated
    assert (tmp_path / "checkpoints" / "iter_3" / "manifest.json").is_file()
    assert [step for step, _ in read_scalars(tmp_path)["train/reward"]] == [0, 1, 2]


def test_a_run_config_defaults_to_what_the_command_line_defaults_to():
    """A library user's ``RunConfig()`` and ``train_math.py`` with no flag are the same run by construction:
    every flag is generated from its field (tests/test_options.py), and both resolve the options left None
    and the derived values through ``train.resolve.resolved``."""
    import dataclasses

    from train.config import RunConfig
    from train.flags import config_from_flags
    from train.resolve import resolved

    FLAGS.unparse_flags()
    FLAGS(["train_math"])
    try:
        from_flags = config_from_flags(FLAGS)
    finally:
        FLAGS.unparse_flags()
    from_code = resolved(RunConfig())
    assert dataclasses.replace(from_flags, flags={}) == from_code
    assert (from_code.env.env_id, from_code.env.group_size, from_code.env.envs_stepped) == ("Arith-v0", 4, 128)
    assert from_code.rewards.spec == "outcome:1.0,steps:1.0" and from_code.budget.num_iterations == 640
    assert resolved(from_code) == from_code  # idempotent: a resolved config resolves to itself


def test_the_algorithm_reads_the_options_of_the_run_as_given():
    """``AlgorithmConfig`` holds the options the learning, PRIME and multi-agent sections extend (declared once,
    in algorithms.config) as the run gives them, and RLOO's kept groups per rank from --n_rollout_threads /
    --group_size; the KL in the reward is left to the algorithm until resolved."""
    from algorithms.config import AlgorithmConfig
    from train.builders import algorithm_config
    from envs.modes import AgentGroups
    from train.config import LearningConfig, MultiAgentConfig, PrimeConfig, RunConfig
    from train.distributed import Ranks
    from train.resolve import resolved

    assert algorithm_config(RunConfig()) == AlgorithmConfig()
    assert algorithm_config(resolved(RunConfig())) == AlgorithmConfig(use_kl_in_reward=False, max_groups=128 // 4)
    assert algorithm_config(resolved(RunConfig()), Ranks(world_size=2)).max_groups == 128 // 4 // 2
    config = RunConfig(learning=LearningConfig(clip_param=0.1, value_clip_param=0.0, huber_delta=2.0),
                       prime=PrimeConfig(process_coef=0.5, oversample_factor=1),
                       multi_agent=MultiAgentConfig(agent_groups=AgentGroups.JOINT))
    assert algorithm_config(config) == AlgorithmConfig(clip_param=0.1, value_clip_param=0.0, huber_delta=2.0,
                                                       process_coef=0.5, agent_groups=AgentGroups.JOINT)


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_gradient_checkpointing_holds_fewer_activations_in_the_update(untrained_policy_dir, tmp_path, lora_rank):
    """``--gradient_checkpointing`` acts in the runner's update (the layers checkpoint only in training mode),
    and the policy is back in eval mode for sampling after it."""
    from tensorboardX import SummaryWriter

    from train.builders import build_runner
    from train.config import (BudgetConfig, EnvConfig, GenerationConfig, LearningConfig, LoggingConfig, ModelConfig,
                              RunConfig)

    def saved_bytes_in_update(checkpointing: bool) -> int:
        torch.manual_seed(0)
        config = RunConfig(model=ModelConfig(name_or_path=str(untrained_policy_dir), device="cpu", lora_rank=lora_rank,
                                             gradient_checkpointing=checkpointing),
                           env=EnvConfig(num_envs=8), generation=GenerationConfig(max_new_tokens=6),
                           learning=LearningConfig(algorithm="APPO"),  # its value loss trains every row
                           budget=BudgetConfig(num_iterations=1, eval_interval=0),
                           logging=LoggingConfig(save_interval=0, save_best=False))
        runner = build_runner(config, tmp_path / str(checkpointing), SummaryWriter(str(tmp_path / str(checkpointing))))
        saved, train = [0], runner.learner.train

        def count(tensor: torch.Tensor) -> torch.Tensor:
            saved[0] += tensor.numel() * tensor.element_size()
            return tensor

        def counted_train(*args):
            with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
                return train(*args)

        runner.learner.train = counted_train
        runner.train_iteration(0, {})
        assert not runner.policy.training
        return saved[0]

    plain, checkpointed = saved_bytes_in_update(False), saved_bytes_in_update(True)
    assert checkpointed < plain / 2, (checkpointed, plain)


def test_a_micro_batch_token_budget_bounds_each_pass_and_trains_the_same_weights(untrained_policy_dir, tmp_path):
    """``--micro_batch_tokens``: every update pass forwards at most the budget (a shared prompt once, then each
    action, padding included), and the logged losses and the step are those of a single micro-batch."""
    from tensorboardX import SummaryWriter

    from algorithms.buffer import forwarded_positions
    from models.packing import distinct_rows, token_lengths
    from train.builders import build_runner
    from train.config import (BudgetConfig, EnvConfig, GenerationConfig, LearningConfig, LoggingConfig, ModelConfig,
                              RunConfig)

    def one_iteration(budget: int) -> tuple[list[int], dict[str, float], list[torch.Tensor]]:
        torch.manual_seed(0)
        config = RunConfig(model=ModelConfig(name_or_path=str(untrained_policy_dir), device="cpu"),
                           env=EnvConfig(num_envs=8), generation=GenerationConfig(max_new_tokens=6),
                           learning=LearningConfig(algorithm="APPO", micro_batch_tokens=budget),  # every row trains
                           budget=BudgetConfig(num_iterations=1, eval_interval=0),
                           logging=LoggingConfig(save_interval=0, save_best=False))
        runner = build_runner(config, tmp_path / str(budget), SummaryWriter(str(tmp_path / str(budget))))
        forwarded, parallel_module, learner_train, losses = [], runner.learner.parallel_module, runner.learner.train, {}

        def counted(prompts, actions, *args, **kwargs):
            distinct, _ = distinct_rows([list(prompt) for prompt in prompts])
            forwarded.append(forwarded_positions(list(map(len, distinct)), token_lengths(actions)))
            return parallel_module(prompts, actions, *args, **kwargs)

        def logged(*args, **kwargs):
            trained = learner_train(*args, **kwargs)
            losses.update({key: value for key, value in trained.stats.items() if key.startswith("loss/")})
            return trained

        runner.learner.parallel_module, runner.learner.train = counted, logged
        runner.train_iteration(0, {})
        return forwarded, losses, [p.detach().clone() for p in runner.policy.actor_parameters()]

    whole, whole_losses, whole_weights = one_iteration(0)
    budget = whole[0] // 3
    cut, cut_losses, cut_weights = one_iteration(budget)
    assert len(whole) == 1 and len(cut) >= 3 and max(cut) <= budget
    assert whole_losses.keys() == cut_losses.keys() and "loss/policy_loss" in whole_losses
    for key, value in whole_losses.items():
        assert cut_losses[key] == pytest.approx(value, abs=1e-5), key
    for expected, got in zip(whole_weights, cut_weights):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat_policy(policy_dir: Path, out: Path) -> Path:
    """``policy_dir``'s weights with its tokenizer given a ChatML chat template."""
    from transformers import AutoTokenizer

    out.mkdir()
    for item in Path(policy_dir).iterdir():
        if "token" not in item.name and item.name != "special_tokens_map.json":
            (out / item.name).symlink_to(item)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(out)
    return out


def test_chat_prompts_reach_the_train_and_eval_envs_and_the_target(untrained_policy_dir, tmp_path):
    from train.builders import build_runner
    from train.config import (ANSWER_INSTRUCTION, BudgetConfig, EnvConfig, ModelConfig, PrefixRLConfig, RewardConfig,
                              RunConfig)

    model = str(chat_policy(untrained_policy_dir, tmp_path / "chat_policy"))
    config = RunConfig(model=ModelConfig(name_or_path=model, device="cpu"),
                       env=EnvConfig(num_envs=4, group_size=4, prompt_template="chat", system_prompt="Be brief."),
                       rewards=RewardConfig(spec="outcome:1.0,target:0.5"),
                       prefix_rl=PrefixRLConfig(target_model=model),
                       budget=BudgetConfig(num_iterations=1, eval_interval=0, eval_batch_size=2))
    runner = build_runner(config, tmp_path / "run", writer=None)
    tokenizer = runner.policy.tokenizer
    for env in (runner.collector.env.unwrapped, runner.eval_envs[None].unwrapped):
        prompts, _ = env.reset(seed=0)
        problem = env.episodes[0].problem.problem
        by_hand = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": f"{problem} {ANSWER_INSTRUCTION}"}],
                                                tokenize=False, add_generation_prompt=True)
        assert prompts[0] == by_hand
        target = env.task.reward_model.models["target"]
        context = StepContext(problem=env.episodes[0].problem, previous_steps=(), new_step="2+2", done=True)
        assert target.prompts([context]) == [by_hand + "2+2"]


@pytest.mark.slow
def test_openr_command_runs_with_tiny_models_and_writes_readable_events(tiny_models, tmp_path):
    """OpenR's command, paths swapped for the tiny models and MATH-500, for two iterations."""
    result = run_cli("--dataset_path", str(MATH500), "--model_name_or_path", str(tiny_models.policy),
                     "--prm_model_name_or_path", str(tiny_models.prm), "--algorithm_name", "APPO",
                     "--num_mini_batch", "4", "--ppo_epoch", "1",
                     "--num_env_steps", "32", "--n_rollout_threads", "16", "--eval_interval", "1",
                     "--eval_limit", "16", "--eval_batch_size", "16", "--logdir", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "APPO_MATH-v0").glob("run_*")
    scalars = read_scalars(run_dir)
    for tag in ("eval/accuracy", "eval/prm_score", "train/reward/prm", "train/reward/outcome", "loss/value_loss",
                "loss/policy_loss", "grad/norm", "lr/actor", "time/generate", "time/update"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
    assert len(scalars["train/reward"]) == 2


def test_the_lr_factor_warms_up_from_the_first_update_then_holds_or_decays():
    from envs.modes import LrSchedule
    from train.builders import lr_factor

    assert [lr_factor(step, 2, LrSchedule.CONSTANT, 6) for step in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [lr_factor(step, 2, LrSchedule.LINEAR, 6) for step in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert lr_factor(0, 0, LrSchedule.CONSTANT, 6) == 1.0


def test_an_optimizer_step_allocates_no_temporary_of_a_parameters_size(untrained_policy_dir):
    """The update's memory peaks in the optimizer step (weights, gradients and both moments alive), so the
    step updates in place: after the first step has made the moments, nothing it allocates is as large as
    the largest parameter (the per-parameter loop allocates two, a 151,936 x 896 embedding's ~1 GB)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.policy import LanguagePolicy
    from train.builders import build_optimizer
    from train.config import LearningConfig

    class LargestNewTensor(TorchDispatchMode):
        """The largest tensor an op returns that is none of ``existing`` (an in-place op returns its input)."""

        def __init__(self, existing: set[int]):
            super().__init__()
            self.existing, self.largest = existing, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in torch.utils._pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.existing:
                    self.largest = max(self.largest, tensor.numel())
            return out

    policy = LanguagePolicy(untrained_policy_dir, device="cpu", with_critic=True)
    optimizer, _ = build_optimizer(LearningConfig(), policy, iterations=1)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for parameter in parameters:
        parameter.grad = torch.full_like(parameter, 0.01)
    optimizer.step()  # makes the moments
    existing = {t.untyped_storage().data_ptr() for p in parameters
                for t in (p, p.grad, *optimizer.state[p].values()) if t.numel() > 1}
    with LargestNewTensor(existing) as mode:
        optimizer.step()
    largest_parameter = max(p.numel() for p in parameters)
    assert largest_parameter > 10_000  # the embedding
    assert mode.largest < largest_parameter / 100, mode.largest


def test_no_gradient_is_held_after_an_update(untrained_policy_dir, tmp_path, monkeypatch):
    """The policy's and the implicit PRM's gradients are freed once their step has used them: held, each is a
    model's worth of memory through the next iteration's generation and evaluation."""
    from tensorboardX import SummaryWriter

    from test_env import StepLengthReward
    from train import builders
    from train.builders import build_runner
    from train.config import (BudgetConfig, EnvConfig, GenerationConfig, LearningConfig, LoggingConfig, ModelConfig,
                              PrimeConfig, RunConfig)

    monkeypatch.setattr(builders, "build_reward_model", lambda config, device, template: StepLengthReward())
    torch.manual_seed(0)  # the untrained policy never verifies: every group kept, rewards from the step lengths
    config = RunConfig(model=ModelConfig(name_or_path=str(untrained_policy_dir), device="cpu"),
                       env=EnvConfig(num_envs=8), generation=GenerationConfig(max_new_tokens=24),
                       learning=LearningConfig(algorithm="RLOO"),
                       prime=PrimeConfig(accuracy_lower_bound=0.0, oversample_factor=1),
                       budget=BudgetConfig(num_iterations=1, eval_interval=0),
                       logging=LoggingConfig(save_interval=0, save_best=False))
    runner = build_runner(config, tmp_path, SummaryWriter(str(tmp_path)))
    models = (runner.policy, runner.learner.implicit_prm.model)
    before = [[p.detach().clone() for p in model.actor_parameters()] for model in models]
    runner.train_iteration(0, {})
    for model, weights in zip(models, before):  # both stepped
        assert not all(torch.equal(a, b) for a, b in zip(weights, model.actor_parameters()))
    held = [name for model in models for name, p in model.named_parameters() if p.grad is not None]
    assert held == []


def prime_runner(policy_dir, logdir, monkeypatch, micro_batch_tokens: int = 0, **prime):
    """A runner of PRIME on the untrained policy (8 envs, 12-token actions, every group kept), rewarded by
    ``StepLengthReward``."""
    from tensorboardX import SummaryWriter

    from test_env import StepLengthReward
    from train import builders
    from train.builders import build_runner
    from train.config import (BudgetConfig, EnvConfig, GenerationConfig, LearningConfig, LoggingConfig, ModelConfig,
                              PrimeConfig, RunConfig)

    monkeypatch.setattr(builders, "build_reward_model", lambda config, device, template: StepLengthReward())
    torch.manual_seed(0)
    config = RunConfig(model=ModelConfig(name_or_path=str(policy_dir), device="cpu"),
                       env=EnvConfig(num_envs=8), generation=GenerationConfig(max_new_tokens=12),
                       learning=LearningConfig(algorithm="RLOO", micro_batch_tokens=micro_batch_tokens),
                       prime=PrimeConfig(accuracy_lower_bound=0.0, oversample_factor=1, implicit_prm_lr=1e-3, **prime),
                       budget=BudgetConfig(num_iterations=1, eval_interval=0),
                       logging=LoggingConfig(save_interval=0, save_best=False))
    with SummaryWriter(str(logdir)) as writer:
        return build_runner(config, logdir, writer)


@pytest.mark.parametrize("prime_update", ["before", "after"])
def test_the_implicit_prm_steps_before_or_after_scoring_a_batch(untrained_policy_dir, tmp_path, monkeypatch,
                                                                 prime_update):
    """PRIME's order (verl's reward_model.model.update): under ``before`` the PRM first learns from the batch's
    outcomes, so the rewards it then writes already rank them (every answer here is wrong: every episode's
    process return is negative, the largest |return-to-go| 1 under batch_norm); under ``after`` it scores the
    batch as its reference did (all 0) and learns only after the policy's update. Either way its held-out
    accuracy comes from scores taken before any step on the batch (all 0: "wrong", right for every episode), read
    off the pass its step or its rewards take, and its frozen reference scores the batch once for both."""
    runner = prime_runner(untrained_policy_dir, tmp_path, monkeypatch, prime_update=prime_update)
    buffer = runner.rollouts.next(0, 0, 0).buffer
    assert float(buffer.episode_correct().sum()) == 0  # the untrained policy never verifies
    prm = runner.learner.implicit_prm.model
    start = [p.detach().clone() for p in prm.actor_parameters()]
    passes = {"reference": 0, "psi": 0}
    for name, method in (("reference", "ref_log_probs"), ("psi", "score_actions")):
        def counted(*args, _name=name, _scored=getattr(prm, method), **kwargs):
            passes[_name] += 1
            return _scored(*args, **kwargs)
        monkeypatch.setattr(prm, method, counted)
    stats = runner.learner.process_rewards(buffer)
    assert passes == {"reference": 1, "psi": 2 if prime_update == "before" else 1}
    stepped = not all(torch.equal(a, b) for a, b in zip(start, prm.actor_parameters()))
    assert stats["implicit_prm/heldout_accuracy"] == 1.0
    assert ("implicit_prm/after_step_accuracy" in stats) == (prime_update == "before")
    order, token_mask = buffer.episode_token_order()
    returns = buffer.to_episodes(buffer.token_rewards, order)
    if prime_update == "before":
        assert stepped and "loss/implicit_prm" in stats and stats["implicit_prm/grad_norm"] > 0
        assert (returns.sum(-1) < 0).all()
        to_go = returns.flip(-1).cumsum(-1).flip(-1)
        assert float(to_go[token_mask].abs().max()) == pytest.approx(1.0, abs=1e-5)
    else:
        assert not stepped and "loss/implicit_prm" not in stats and "implicit_prm/grad_norm" not in stats
        assert float(returns.abs().max()) == 0.0


def test_the_implicit_prm_step_in_micro_batches_equals_one_batch(untrained_policy_dir, tmp_path, monkeypatch):
    """``--micro_batch_tokens`` bounds the implicit PRM's step as it bounds the policy's: the gradients of the
    micro-batches add up to the one batch's, so its loss, the scores it started from and its weights after the
    step equal those of one pass (to float error)."""
    runner = prime_runner(untrained_policy_dir, tmp_path, monkeypatch, micro_batch_tokens=40)
    learner, buffer = runner.learner, runner.rollouts.next(0, 0, 0).buffer
    prm = learner.implicit_prm
    rows = buffer.rows()
    assert len(learner.micro_batch_rows(buffer, rows)) > 2
    assert learner.micro_batch_rows(buffer, buffer.rows(torch.zeros_like(buffer.live))) == []  # a rank without rows
    weights, optimizer = copy.deepcopy(prm.model.state_dict()), copy.deepcopy(prm.optimizer.state_dict())
    stats, scores = learner.implicit_prm_step(buffer, rows)
    parts = [p.detach().clone() for p in prm.model.actor_parameters()]
    prm.model.load_state_dict(weights)
    prm.optimizer.load_state_dict(optimizer)
    learner.config = dataclasses.replace(learner.config, micro_batch_tokens=0)
    whole_stats, whole_scores = learner.implicit_prm_step(buffer, rows)
    assert stats["loss/implicit_prm"] == pytest.approx(whole_stats["loss/implicit_prm"], abs=1e-5)
    assert stats["implicit_prm/grad_norm"] == pytest.approx(whole_stats["implicit_prm/grad_norm"], rel=1e-4)
    torch.testing.assert_close(scores, whole_scores, atol=1e-5, rtol=0)
    for part, whole in zip(parts, prm.model.actor_parameters()):  # an AdamW step moves a weight ~lr = 1e-3
        torch.testing.assert_close(part, whole.detach(), atol=1e-5, rtol=0)


def test_the_implicit_prm_takes_one_step_per_mini_batch_each_on_the_next_share(untrained_policy_dir, tmp_path,
                                                                            monkeypatch):
    """``--implicit_prm_num_mini_batch 2`` (PRIME's reward_model.mini_batch_size at half the batch): two steps, the
    first on the first half of the rows and the second on the rest, each share's scores taken before its own
    step; the same as two one-step updates on the halves in order."""
    runner = prime_runner(untrained_policy_dir, tmp_path, monkeypatch, implicit_prm_num_mini_batch=2)
    learner, buffer = runner.learner, runner.rollouts.next(0, 0, 0).buffer
    prm = learner.implicit_prm
    rows = buffer.rows()
    weights, optimizer = copy.deepcopy(prm.model.state_dict()), copy.deepcopy(prm.optimizer.state_dict())
    steps = []
    monkeypatch.setattr(prm, "step", lambda *args, _step=prm.step: steps.append(_step(*args)) or steps[-1])
    stats, scores = learner.implicit_prm_step(buffer, rows)
    assert len(steps) == 2 and stats["implicit_prm/grad_norm"] == pytest.approx(sum(steps) / 2)
    two_steps = [p.detach().clone() for p in prm.model.actor_parameters()]
    prm.model.load_state_dict(weights)
    prm.optimizer.load_state_dict(optimizer)
    learner.prime = dataclasses.replace(learner.prime, implicit_prm_num_mini_batch=1)
    half = rows.num_samples // 2
    by_half = []
    for share in (torch.arange(half), torch.arange(half, rows.num_samples)):
        mask = torch.zeros(buffer.num_slots, dtype=torch.bool)
        mask[rows.index[share]] = True
        by_half.append(learner.implicit_prm_step(buffer, buffer.rows(mask.reshape(buffer.live.shape)))[1])
    torch.testing.assert_close(scores, torch.cat(by_half), atol=1e-6, rtol=0)
    assert float(scores[:half].abs().max()) == 0.0 < float(scores[half:].abs().max())  # psi = ref, then a step
    for stepped, sequential in zip(two_steps, prm.model.actor_parameters()):
        torch.testing.assert_close(stepped, sequential.detach(), atol=1e-6, rtol=0)


def test_val_only_evaluates_once_and_trains_and_saves_nothing(untrained_policy_dir, tmp_path):
    """verl's trainer.val_only: the held-out evaluation of the model as given, in eval_history.json and
    TensorBoard, with no iteration, checkpoint or best/ policy."""
    import json

    run_dir = run_train_math(["--model_name_or_path", str(untrained_policy_dir), "--val_only", "--eval_limit", "6",
                              "--eval_batch_size", "6", "--max_new_tokens", "6", "--logdir", str(tmp_path)])
    history = json.loads((Path(run_dir) / "eval_history.json").read_text())
    assert [(h["iteration"], h["env_steps"]) for h in history] == [(0, 0)]
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["eval/accuracy"]] == [0] and "train/reward" not in scalars
    assert not (Path(run_dir) / "checkpoints").exists() and not (Path(run_dir) / "best").exists()
