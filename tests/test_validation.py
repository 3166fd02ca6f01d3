"""One validation for both ways into a run: every check refuses a config from flags and the same config built in
code with the same one-line message (``train.validation.validate``, run by ``train.resolve.resolved``)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from absl import flags

from envs.datasets import MATH500
from train.config import FLOAT16_TRAINING, EnvConfig, RunConfig
from train.flags import FLAGS, config_from_flags
from train.resolve import resolved
from train.validation import OPTIONS

ROOT = Path(__file__).resolve().parents[1]
A_DIRECTORY, A_FILE, TARGET = str(ROOT / "docs"), str(MATH500), {"reward": "target", "target_url": "http://127.0.0.1:9"}


def without(package: str) -> pytest.MarkDecorator:
    """Runs a row only where ``package`` is not installed (its refusal names the extra that installs it)."""
    return pytest.mark.skipif(importlib.util.find_spec(package) is not None, reason=f"{package} is installed here")


REFUSED = [
    # each option alone
    ({"lr": -1.0}, "--lr=-1.0: must be > 0"),
    ({"entropy_coef": -0.1}, "--entropy_coef=-0.1: must be >= 0"),
    ({"top_p": 0.0}, "--top_p=0.0: must be in (0, 1]"),
    ({"gamma": 1.5}, "--gamma=1.5: must be in [0, 1]"),
    ({"dtype": "float16"}, FLOAT16_TRAINING),
    ({"device": "gpu"}, "--device=gpu: must be auto, cpu, cuda, cuda:N or mps"),
    ({"experiment_name": "a/b"}, "(it names a directory)"),
    ({"dataset_path": "/no/such/problems.jsonl"}, "does not exist; pass an existing path or leave --dataset_path out"),
    ({"model_name_or_path": "./no/such/dir"}, "leave --model_name_or_path out"),
    ({"model_name_or_path": A_FILE}, "is not a directory"),
    ({"resume": A_DIRECTORY}, "has no manifest.json: pass 'auto' or a complete checkpoint"),
    ({"eval_dataset_path": "a=x.jsonl,a="}, "names the set 'a' twice"),
    ({"prm_url": "localhost:8000"}, "--prm_url='localhost:8000': must be http(s)://HOST:PORT"),
    pytest.param({"generation_backend": "vllm"}, "pip install 'mathrl[vllm]'", marks=without("vllm")),
    pytest.param({"grader": "math_verify"}, "--grader): the 'math_verify' scorer needs the math_verify package",
                 marks=without("math_verify")),
    pytest.param({"dataset_path": "hf://HuggingFaceH4/MATH-500"}, "is a Hugging Face hub dataset, which needs the "
                 "datasets package", marks=without("datasets")),
    # the algorithm's options, groups and critic
    ({"algorithm_name": "GRPO", "gae_lambda": 0.9}, "--gae_lambda applies to APPO/TPPO"),
    ({"algorithm_name": "APPO", "kl_coef": 0.1}, "--kl_coef applies to GRPO/TPPO/RLOO"),
    ({"algorithm_name": "GRPO", "accuracy_lower_bound": 0.1}, "--accuracy_lower_bound applies to RLOO"),
    ({"algorithm_name": "GRPO", "process_credit_assignment": "min_form"},
     "--process_credit_assignment applies to RLOO"),
    ({"algorithm_name": "RLOO", "min_form_temperature": 0.5}, "shapes --process_credit_assignment min_form"),
    ({"algorithm_name": "RLOO", "process_credit_assignment": "min_form", "min_form_temperature": 0.0},
     "must be > 0"),
    ({"algorithm_name": "RLOO", "scale_rewards": "none"}, "--scale_rewards applies to GRPO;"),
    ({"n_rollout_threads": 12, "group_size": 8}, "--n_rollout_threads=12 must be a multiple of --group_size=8"),
    ({"algorithm_name": "REINFORCE_PP_BASELINE", "group_size": 1}, "--group_size=1 must be >= 2"),
    ({"algorithm_name": "TPPO", "critic": "off"}, "needs a critic (its advantages come from V)"),
    ({"algorithm_name": "GRPO", "critic": "on"}, "is critic-free; drop --critic=on or use APPO/TPPO"),
    ({"algorithm_name": "RLOO", "env_id": "Arith-Chain-v0", "agent_groups": "at_grpo"},
     "--algorithm_name=RLOO compares whole episodes: use GRPO, or --agent_groups role or joint"),
    # generation
    ({"generation_backend": "vllm_server", "vllm_url": "http://127.0.0.1:9", "async_rollouts": True},
     "--async_rollouts generates with an HF copy of the policy"),
    ({"generation_backend": "vllm_server"}, "--generation_backend=vllm_server needs --vllm_url"),
    ({"vllm_model_name": "policy"}, "--vllm_model_name is for --generation_backend=vllm_server"),
    ({"data_parallel": "fsdp", "lora_rank": 8}, "use --data_parallel ddp (or auto)"),
    ({"max_policy_lag": 2, "async_rollouts": False}, "--max_policy_lag bounds asynchronous rollouts"),
    # rewards
    ({"reward": "outcome:1.0,prm:0.2"}, "neither --prm_model_name_or_path nor --prm_url is given"),
    ({"prm_model_name_or_path": A_DIRECTORY, "prm_url": "http://127.0.0.1:9"}, "on a server: give one"),
    ({"target_url": "http://127.0.0.1:9"}, "does not use 'target'; add it (e.g. 'target:0.2')"),
    ({"prm_model_name": "prm"}, "--prm_model_name names the model served at --prm_url"),
    ({"prm_checkpoint_path": A_DIRECTORY}, "--prm_checkpoint_path is an adapter for a local PRM"),
    ({"prm_type": "classifier", "prm_kv_cache_mb": 8.0}, "--prm_kv_cache_mb=8.0 needs --prm_type=shepherd"),
    ({"env_id": "MATH-v0", "reward": "steps"}, "Drop 'steps' or use an Arith env"),
    ({"reward": "outcom"}, "unknown source"),
    ({"reward": "implicit_prm"}, "'implicit_prm' is not a --reward source"),
    # the env, its prompts, Prefix-RL and multi-agent options
    ({"env_id": "Arith-v0", "dataset_path": A_FILE}, "generates its problems; drop --dataset_path"),
    ({"dataset_name": "Algebra"}, "--dataset_name filters a MATH dataset's subjects"),
    ({"answer_instruction": "Box it."}, "--answer_instruction ends the user turn of --prompt_template chat"),
    ({"system_prompt": "Be brief."}, "--system_prompt needs a chat prompt template"),
    ({"handoff_steps": 1}, "add 'target' to --reward"),
    ({"handoff_steps": 1, "action_level": "token", **TARGET}, "--handoff_steps counts actions"),
    ({"handoff_steps": 2, **TARGET}, "use --handoff_steps 1, or --action_level step"),
    ({"handoff_steps": 1, "env_id": "Arith-Chain-v0", **TARGET}, "Prefix-RL is Arith-Prefix-v0 there"),
    ({"reward_assignment": "individual"}, "--reward_assignment concerns the roles of a multi-agent env"),
    ({"eval_temperature": 0.6}, "--eval_temperature sets how --eval_samples are drawn"),
    ({"algorithm_name": "APPO", "critic": "centralized"}, "--critic=centralized concerns the roles of a multi-agent"),
    ({"env_id": "Arith-Chain-v0", "share_policy": False}, "--noshare_policy gives each role a LoRA adapter"),
    ({"env_id": "Arith-Chain-v0", "action_level": "step"}, "every action is one role's whole message"),
    ({"env_id": "Arith-Chain-v0", "reward": "steps"}, "its 'outcome' source is the --reward_assignment credit"),
    ({"env_id": "No-Such-v0"}, "'No-Such-v0' is not a registered gymnasium id"),
    ({"env_kwargs": "{"}, "--env_kwargs='{'"),
    ({"max_tool_calls": 2}, "--max_tool_calls sets the policy's tool"),
    ({"env_id": "Arith-Tool-v0"}, "add --action_level step (not solution), or --tools none"),
    # losses
    ({"clip_ratio_low": 1.0}, "--clip_ratio_low=1.0 must be in [0, 1)"),
    ({"clip_ratio_high": -0.1}, "--clip_ratio_high=-0.1 must be >= 0"),
    ({"clip_ratio_c": 0.5}, "--clip_ratio_c=0.5 must be > 1"),
    ({"kl_loss_type": "k2"}, "--kl_loss_type sets the KL to the reference, but --kl_coef is 0"),
    ({"kl_coef": 0.1, "kl_penalty": "k3"}, "--kl_penalty is the estimator of the KL in the reward"),
    ({"kl_coef": 0.1, "use_kl_in_reward": True, "kl_loss_type": "k2"}, "--kl_loss_type is the estimator of the KL"),
    ({"loss_scale_factor": 100}, "--loss_scale_factor divides seq-mean-token-sum-norm's token sums"),
    ({"algorithm_name": "RLOO", "accuracy_lower_bound": 0.9, "accuracy_upper_bound": 0.1},
     "need 0 <= --accuracy_lower_bound (0.9) <= --accuracy_upper_bound (0.1) <= 1"),
    # rollouts: dynamic sampling, cut-off answers, rollout correction
    ({"max_num_gen_batches": 3}, "--max_num_gen_batches bounds the rounds of --filter_groups"),
    ({"algorithm_name": "APPO", "filter_groups": True}, "--algorithm_name=APPO collects no groups"),
    ({"algorithm_name": "RLOO", "filter_groups": True}, "pass --oversample_factor 1"),
    ({"overlong_penalty_factor": 0.5}, "--overlong_penalty_factor shapes the penalty of --overlong_buffer"),
    ({"mask_truncated_completions": True, "action_level": "token"}, "every action is one token"),
    ({"overlong_buffer": True, "overlong_buffer_len": 65}, "--overlong_buffer_len=65 is longer than"),
    ({"rollout_is_level": "sequence"}, "--rollout_is_level sets how --rollout_is corrects"),
    ({"rollout_is": True, "rollout_is_threshold": 0.5}, "--rollout_is_threshold=0.5 < 1 would cut"),
    ({"rollout_is": True, "rollout_is_threshold_lower": 0.5}, "the band's lower end of --rollout_is_mode mask"),
    ({"rollout_is": True, "rollout_is_mode": "mask", "rollout_is_level": "sequence",
      "rollout_is_threshold_lower": 1.5}, "--rollout_is_threshold_lower=1.5 must be in (0, 1]"),
    ({"rollout_is": True, "algorithm_name": "APPO"}, "APPO's loss takes one ratio per action"),
    ({"rollout_is": True, "rollout_is_mode": "mask"}, "use --rollout_is_level sequence or geometric"),
    # a workflow's roles: frozen, trained, on base models of their own
    ({"env_id": "no_such_module:Arith-v0"}, "cannot import registration module 'no_such_module'"),
    ({"env_id": "Arith-Chain-v0", "frozen_role": ("judge",)},
     "--frozen_role judge: the workflow 'chain' has the roles ['solver', 'verifier', 'refiner']"),
    ({"env_id": "Arith-Debate-v0", "frozen_role": ("debater_0", "debater_1", "debater_2")}, "nothing would train"),
    ({"env_id": "Arith-Chain-v0", "role_model": ("solver=tests",)},
     "--role_model solver=...: the frozen roles of --env_id=Arith-Chain-v0 are none"),
    ({"env_id": "Arith-Prefix-v0", "role_base_model": ("solver=tests",)},
     "--role_base_model solver=...: the trained roles of --env_id=Arith-Prefix-v0 are ['prefix_writer']"),
    ({"env_id": "Arith-Prefix-v0", "reward": "outcome,target", "target_url": "http://127.0.0.1:9"},
     "whose solver role already is the frozen target finishing the prefix"),
    ({"env_id": "Arith-Chain-v0", "tools": "python"}, "--tools=python: the multi-agent --env_id=Arith-Chain-v0"),
    ({"env_id": "Arith-Chain-v0", "role_lr": ("verifier=1e-3",)},
     "--role_lr verifier=...: role 'verifier' has no --role_base_model"),
    ({"env_id": "Arith-Chain-v0", "role_lora_rank": ("verifier=4",)},
     "--role_lora_rank verifier=...: role 'verifier' has no --role_base_model"),
    ({"env_id": "Arith-Chain-v0", "role_base_model": ("verifier=tests",), "algorithm_name": "APPO"},
     "--role_base_model verifier=... trains critic-free; --algorithm_name=APPO needs a critic"),
    ({"env_id": "Arith-Chain-v0", "role_base_model": ("verifier=tests",), "algorithm_name": "RLOO"},
     "RLOO's implicit PRM (--process_coef=1.0) learns on the policy's base alone"),
    ({"env_id": "Arith-Chain-v0", "role_base_model": ("verifier=tests",), "async_rollouts": True},
     "collects synchronously: drop --async_rollouts"),
    ({"env_id": "Arith-Chain-v0", "role_base_model": ("verifier=tests",), "generation_backend": "vllm_server",
      "vllm_url": "http://127.0.0.1:9"}, "generates with HF: use --generation_backend hf (not vllm_server)"),
    ({"env_id": "Arith-Chain-v0", "role_base_model": ("verifier=tests",), "data_parallel": "fsdp"},
     "every model of the team is replicated under DDP"),
]


def from_code(overrides: dict) -> RunConfig:
    """RunConfig() with each option (named by its flag) set as ``overrides`` say, as a library user writes it."""
    fields: dict[str, dict] = {}
    for name, value in overrides.items():
        section, field = OPTIONS[name]
        fields.setdefault(section, {})[field.name] = value
    default = RunConfig()
    return dataclasses.replace(default, **{section: dataclasses.replace(getattr(default, section), **values)
                                           for section, values in fields.items()})


def command_line(overrides: dict) -> list[str]:
    """``overrides`` as train_math.py flags (a tuple as its repeatable flag, once per item)."""
    argv = []
    for name, value in overrides.items():
        if isinstance(value, bool):
            argv.append(f"--{'' if value else 'no'}{name}")
        else:
            argv += [f"--{name}={item}" for item in (value if isinstance(value, tuple) else (value,))]
    return argv


def refusal_from_flags(overrides: dict) -> str:
    FLAGS.unparse_flags()
    try:
        FLAGS(["train_math", *command_line(overrides)])
        with pytest.raises(flags.ValidationError) as error:  # a usage error: train_math.py prints its one line
            config_from_flags(FLAGS)
    finally:
        FLAGS.unparse_flags()
    return str(error.value)


@pytest.mark.parametrize(("overrides", "message"), REFUSED)
def test_each_check_refuses_flags_and_code_alike(overrides, message):
    with pytest.raises(ValueError) as error:
        resolved(from_code(overrides))
    in_code = str(error.value)
    assert message in in_code and "\n" not in in_code
    assert refusal_from_flags(overrides) == in_code


def test_every_option_wrong_alone_is_refused_on_a_line_of_its_own():
    """As absl reported its validators: all options wrong alone at once; the checks of options against each other
    only once each option is right alone."""
    overrides = {"lr": -1.0, "top_p": 0.0, "device": "gpu", "clip_ratio_c": 0.5}
    with pytest.raises(ValueError) as error:
        resolved(from_code(overrides))
    assert str(error.value).splitlines() == ["--lr=-1.0: must be > 0", "--top_p=0.0: must be in (0, 1]",
                                             "--device=gpu: must be auto, cpu, cuda, cuda:N or mps"]
    assert refusal_from_flags(overrides) == str(error.value)
    with pytest.raises(ValueError) as error:
        resolved(from_code({"clip_ratio_c": 0.5, "max_num_gen_batches": 3, "system_prompt": "Be brief."}))
    assert [line.split(" ")[0] for line in str(error.value).splitlines()] == [
        "--system_prompt", "--clip_ratio_c=0.5", "--max_num_gen_batches"]


def test_the_checks_pass_what_they_do_not_concern():
    """The default config, a resolved one (idempotent), and the options each algorithm reads pass."""
    for overrides in ({}, {"algorithm_name": "APPO", "gae_lambda": 0.9},
                      {"algorithm_name": "RLOO", "process_coef": 0.5},
                      {"algorithm_name": "REINFORCE_PP", "group_size": 1, "kl_coef": 0.1, "kl_penalty": "k3"},
                      {"handoff_steps": 1, **TARGET}, {"eval_samples": 4, "eval_temperature": 0.6}):
        config = resolved(from_code(overrides))
        assert resolved(config) == config


def test_a_declared_bound_refuses_code_as_absl_refuses_the_flag():
    with pytest.raises(ValueError, match=r"^--n_rollout_threads=0: must be >= 1$"):
        resolved(RunConfig(env=EnvConfig(num_envs=0)))
    FLAGS.unparse_flags()
    try:
        with pytest.raises(flags.IllegalFlagValueError, match="n_rollout_threads"):
            FLAGS(["train_math", "--n_rollout_threads=0"])
    finally:
        FLAGS.unparse_flags()


def test_an_option_counts_as_given_when_it_differs_from_its_default():
    """A config built in code cannot say which fields were passed, so the flags' path reads "given" the same way:
    an algorithm's option at its default passes with any algorithm."""
    config = resolved(from_code({"algorithm_name": "GRPO", "value_coef": 0.5}))
    assert config.learning.value_coef == 0.5
    FLAGS.unparse_flags()
    try:
        FLAGS(["train_math", "--algorithm_name=GRPO", "--value_coef=0.5"])
        assert dataclasses.replace(config_from_flags(FLAGS), flags={}) == config
    finally:
        FLAGS.unparse_flags()
