"""A run's configuration: one typed, frozen dataclass per part, and the single source of each option.

A user option is a field declared with ``algorithms.options.option`` (its default and help written once);
its absl flag is generated from it (train/flags.py, section by section, in --helpfull's order), so
``RunConfig()`` and ``train_math.py`` without flags start from the same values. A default of None means
"resolved from other options": the help says to what, and ``train.resolve.resolved`` works it out, in
one place, for a config from flags and one built in code alike. Fields declared without ``option`` are
resolved values (the env's workflow, envs per iteration, ...), not options. The builders
(train/builders.py) each take their part, so a library user builds a run without absl:
``build_runner(RunConfig(...), run_dir, writer)``. The options an algorithm reads are declared in
``algorithms.config``, below this layer: the learning, PRIME and multi-agent sections extend them.

Light on purpose: the flags are generated from these classes before torch is imported (the env package,
no torch in it, is: the options' types are the house's modes, ``envs.modes``).
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING

from algorithms.config import LossOptions, MultiAgentOptions, PrimeOptions
from algorithms.options import option
from algorithms.registry import ALGORITHMS, named
from envs.modes import (ActionLevel, Backend, Critic, DataParallel, DType, Grader, ImplicitPrmGranularity, LrSchedule,
                        PrimeNorm, PrimeUpdate, PrmType, ProcessCredit, PromptTemplate, RewardAssignment,
                        RolloutIsLevel, RolloutIsMode, RolloutMode, Tool)

if TYPE_CHECKING:
    from envs.workflows import Workflow
    from models.remote import ClientSettings

REWARD_SOURCES = ("outcome", "prm", "target", "steps")
DEFAULT_PRM_REWARD = "outcome:1.0,prm:0.2"


FLOAT16_TRAINING = ("float16 training needs a loss scaler (torch.amp.GradScaler), which the trainer does not have, "
                    "so small gradients would underflow to 0; use --dtype bfloat16 (or float32)")
"""Why --dtype float16 (``ModelConfig.dtype``) is refused, and the fix; float16 remains a --save_dtype."""


PRM_TYPE_ALIASES = {"ms": "shepherd", "qwen": "classifier"}
"""OpenR's names of the PRM kinds, which --prm_type accepts too."""


AlgorithmName = enum.StrEnum("AlgorithmName", {name: name for name in ALGORITHMS})
"""The registered algorithms (``algorithms.registry.ALGORITHMS``)."""


@dataclass(frozen=True)
class ModelConfig:
    """The policy's weights and how it runs. Model paths are local directories once resolved (hub ids become
    their snapshots)."""

    name_or_path: str | None = option(
        None, "Policy model: a Hugging Face model directory or a hub id (e.g. Qwen/Qwen2.5-Math-1.5B, resolved "
        "through the Hugging Face cache; HF_HUB_OFFLINE=1 is honoured). Default: the tiny Arith policy shipped in "
        "the package (models/tiny/shipped; on a multi-agent env the tiny team model, which knows the workflows' "
        "roles).", flag="model_name_or_path")
    revision: str | None = option(None, "Hub revision (branch, tag or commit) of every model flag given as a hub "
                                  "id. Default: the hub's default branch.")
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps.")
    dtype: DType = option(DType.FLOAT32, "Compute dtype: matmuls run in it under autocast; trained weights stay fp32 "
                          "(master weights) and a LoRA's frozen base is stored in it.")
    lora_rank: int = option(0, "LoRA rank; 0 trains all weights.", lower_bound=0)
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass.")
    return_freed_memory: bool = option(
        True, "On a CPU device, freed tensors of 1 MiB or more go back to the OS at once, so the resident set "
        "follows the live tensors, for more system time per allocation; --noreturn_freed_memory keeps glibc's "
        "default, which holds on to freed memory.")
    torch_threads: int = option(1, "torch intra-op CPU threads. 1 by default: on a machine whose cores other "
                                "processes share, more threads oversubscribe OpenMP.", lower_bound=1)
    role_adapters: tuple[str, ...] = ()  # resolved: trained roles with a LoRA adapter of their own
    value_heads: int = 1  # resolved: one per role with a per-role critic


ANSWER_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
"""What a chat prompt's user turn ends with by default: the answer format, as verl's MATH and GSM8K recipes
ask for it (an instruct model that is not told where to put its answer rarely boxes it)."""


@dataclass(frozen=True)
class EvalSet:
    """A held-out set: its name (None: the one unnamed set, logged under ``eval/``; else under ``eval/<name>/``)
    and where its problems come from (None: the env's own held-out split, or --dataset_path)."""

    name: str | None = None
    path: str | None = None


def parse_eval_sets(value: str | None) -> tuple[EvalSet, ...]:
    """--eval_dataset_path as EvalSets: None -> one unnamed set, the env's own held-out split; a value without
    '=' -> one unnamed set at that path; else comma-separated NAME=PATH entries, an empty PATH naming the env's
    own held-out split. Names are letters, digits, '.', '-', '_', each once. Raises ValueError."""
    if value is None or "=" not in value:
        return (EvalSet(None, value),)
    sets = []
    for entry in value.split(","):
        name, _, path = entry.strip().partition("=")
        if re.fullmatch(r"[\w.\-]+", name) is None or "=" in path:
            raise ValueError(f"--eval_dataset_path entry {entry!r} must be NAME=PATH (NAME of letters, digits, '.', "
                             "'-', '_'; an empty PATH: the env's own held-out split), e.g. "
                             "math500=envs/data/math500.jsonl,arith=")
        if name in [known.name for known in sets]:
            raise ValueError(f"--eval_dataset_path names the set {name!r} twice; give each set its own name")
        sets.append(EvalSet(name, path or None))
    return tuple(sets)


@dataclass(frozen=True)
class EnvConfig:
    """The problems and the train and held-out envs: a registered id, where problems come from, what one action
    is, the prompt."""

    dataset_path: str | None = option(
        None, "Problems to train on: a JSONL/JSON file (MATH-500 or OpenR schema), a directory holding "
        "{split}.jsonl, or hf://NAME[:split] (needs the datasets package). Given alone, the env is MATH-v0.")
    dataset_name: str | None = option(None, "OpenR's subject filter for a MATH dataset (e.g. 'prealgebra'); default: "
                                      "all subjects.")
    eval_dataset_path: str | None = option(
        None, "Held-out problems for evaluation: a path as --dataset_path takes, logged under eval/; or "
        "comma-separated NAME=PATH sets, each evaluated and logged under eval/NAME/ (an empty PATH: the default "
        "set), e.g. math500=envs/data/math500.jsonl,arith= ; eval/accuracy and the best checkpoint then follow the "
        "first set. Default: the env's test split (Arith-v0), or --dataset_path itself (e.g. MATH-500).")
    env_id: str | None = option(
        None, "A registered gymnasium id with a vector entry point (MathVectorEnv or compatible), or "
        "'module:EnvId' to import a registration module first (on PYTHONPATH). Default: MATH-v0 with "
        "--dataset_path, else Arith-v0.")
    action_level: ActionLevel = option(
        ActionLevel.SOLUTION, "What one env action is: a whole solution (one generate call per episode), one "
        "reasoning step (generation stops at the step delimiter) or one token (the env's token mode; "
        "--episode_length then counts tokens).")
    prompt_template: PromptTemplate = option(
        PromptTemplate.DEFAULT, "How a problem becomes a prompt: default ('Problem: ...\\nSolution:\\n'), qwen_math "
        "(Qwen2.5-Math's ChatML prompt), or chat (the tokenizer's own chat template, generation prompt added; for "
        "instruct models).")
    env_kwargs: str | None = option(
        None, "JSON object of keywords for the env id (gymnasium.make's kwargs), e.g. '{\"arith\": {\"digits\": 1, "
        "\"max_ops\": 2, \"num_train\": 3000}}' for Arith-v0's knobs or '{\"levels\": [1, 2]}' for MATH-v0; a dict "
        "value updates the registered dict key by key. Applies to the train and held-out envs.")
    answer_instruction: str = option(
        ANSWER_INSTRUCTION, "Sentence appended to the user turn of --prompt_template chat, telling an instruct model "
        "where to put its answer (verl's math recipes append the same); '' for none. Every role of a workflow "
        "reads it.")
    system_prompt: str | None = option(None, "System message of --prompt_template chat (and qwen_math). Default: the "
                                       "template's own.")
    episode_length: int | None = option(
        None, "Env steps per env per iteration (episodic algorithms: the longest episode; longer ones are cut). "
        "Default: 1 with --action_level solution, else 8; in a multi-agent env one step per turn, the workflow's "
        "most turns (or the env's max_steps).", lower_bound=1)
    num_envs: int = option(128, "Parallel envs (= samples per iteration); groups of --group_size consecutive envs "
                           "share a problem.", flag="n_rollout_threads", lower_bound=1)
    group_size: int | None = option(
        None, "Samples per problem (consecutive envs sharing one). Default: 4 for "
        f"{named(lambda spec: spec.episodic)} (whole episodes, compared within a group where the baseline is the "
        f"group's), 1 for {named(lambda spec: not spec.episodic)}.", lower_bound=1)
    tools: Tool | None = option(
        None, "Tool the policy may call (--action_level step): 'python' runs a step that ends in a fenced ```python "
        "block in a sandbox and shows its output as the next turn (never trained on, never scored as a step); "
        "'none' turns off an env id's tool. Default: the env id's own, or none (MATH-Tool-v0, Arith-Tool-v0: python).")
    max_tool_calls: int | None = option(None, "Tool calls per episode; a call beyond them ends the episode "
                                        "(truncated). Default: the env's (4).", lower_bound=1)
    max_tool_output_chars: int | None = option(None, "A tool call's output is cut to this many characters. Default: "
                                               "the env's (1024).", flag="max_tool_response_length", lower_bound=1)
    tool_timeout: float | None = option(None, "Wall-clock seconds one tool call may run. Default: the env's (5).",
                                        lower_bound=0.001)
    workflow: Workflow | None = None  # resolved: a multi-agent env's roles
    envs_stepped: int | None = None  # resolved: envs stepped per iteration (num_envs, times RLOO's oversampling)
    whole_episodes: bool | None = None  # resolved: one episode per env per iteration (no autoreset)

    @property
    def eval_sets(self) -> tuple[EvalSet, ...]:
        """The held-out sets of ``eval_dataset_path``; the first one's greedy accuracy picks the best checkpoint."""
        return parse_eval_sets(self.eval_dataset_path)

    @property
    def user_kwargs(self) -> dict:
        """``env_kwargs`` parsed and checked against the env id (``envs.override_kwargs``); {} when not given.
        A fresh dict each call, parsed once per config."""
        return dict(self._parsed_env_kwargs)

    @functools.cached_property
    def _parsed_env_kwargs(self) -> dict:
        import json

        import envs  # here: the flags are generated from this module before the env is imported

        if self.env_kwargs is None:
            return {}
        return envs.override_kwargs(self.env_id or "Arith-v0", json.loads(self.env_kwargs))


@dataclass(frozen=True)
class RewardConfig:
    """The weighted reward sources and the process reward model."""

    spec: str | None = option(
        None, "Weighted reward sources, e.g. 'outcome:1.0,prm:0.2' (sources: "
        f"{', '.join(REWARD_SOURCES)}). Default: {DEFAULT_PRM_REWARD!r} with a PRM, else the env id's declared "
        "default (Arith-v0: 'outcome:1.0,steps:1.0'; MATH and the workflows: 'outcome'). On a multi-agent env "
        "'outcome' is the --reward_assignment credit and the other sources score each answering role's message as "
        "one solution, paid to that role.", flag="reward")
    grader: Grader = option(
        Grader.MATHRL, "What grades a final answer against the reference, for the outcome reward and the held-out "
        "accuracy: mathrl (this project's grader) or math_verify (Hugging Face's math-verify, as TRL's "
        "accuracy_reward and verl's math_verify score grade; pip install 'mathrl[math-verify]'). Both run in the "
        "same time-bounded worker processes. A reasoning-gym problem is scored by its own dataset's scorer.")
    prm_model: str | None = option(
        None, "Process reward model: a directory or a hub id (see --model_name_or_path); enables the 'prm' reward "
        f"source (default --reward becomes {DEFAULT_PRM_REWARD!r}).", flag="prm_model_name_or_path")
    prm_checkpoint_path: str | None = option(None, "Optional LoRA adapter directory applied on top of the PRM.")
    prm_type: PrmType = option(PrmType.SHEPHERD, "PRM kind: shepherd (Math-Shepherd step tags; OpenR's 'MS') or "
                               "classifier (Qwen2.5-Math-PRM style; OpenR's 'Qwen').", aliases=PRM_TYPE_ALIASES)
    prm_step_tag: str | None = option(
        None, "The PRM's step marker: for shepherd PRMs the tag after each step whose '+' probability is the score "
        "(default 'ки', Math-Shepherd's); for classifier PRMs the separator after each step (default '<extra_0>', "
        "Qwen2.5-Math-PRM's). It must be one token of the PRM's tokenizer.")
    prm_kv_cache_mb: float | None = option(
        None, "MiB of PRM key/values kept between env steps, so each step runs only the new step's tokens (same "
        "scores); size it for every env's trajectory or it thrashes. 0 recomputes every text in full. Default: "
        "1024 for shepherd PRMs; classifier PRMs always recompute (only 0 is allowed).", lower_bound=0)

    @property
    def weights(self) -> dict[str, float]:
        """{source: weight} of ``spec`` (resolved: see ``train.resolve``)."""
        from reward_models.mixture import parse_reward_spec  # here: the flags are generated from this module

        return parse_reward_spec(self.spec, REWARD_SOURCES)


@dataclass(frozen=True)
class LearningConfig(LossOptions):
    """The algorithm, the optimisation, and the losses' coefficients (``LossOptions``, which the algorithm reads)."""

    algorithm: AlgorithmName = option(
        AlgorithmName.GRPO, "RL algorithm; " + ", ".join(f"{name} is {spec.known_as}" for name, spec in
                                                         ALGORITHMS.items() if spec.known_as) + ".",
        flag="algorithm_name")
    num_mini_batch: int = option(1, "Minibatches (optimizer steps) per epoch over each rollout.", lower_bound=1)
    ppo_epoch: int = option(1, "Epochs over each rollout.", lower_bound=1)
    gradient_cp_steps: int = option(1, "Gradient accumulation: micro-batches per minibatch.", lower_bound=1)
    micro_batch_tokens: int = option(
        0, "Most positions one micro-batch forwards, padding included (its prompts once, padded to the longest, "
        "then each action, padded to the longest): micro-batches are cut further until each fits, rows of one prompt "
        "kept together, the gradient unchanged. It bounds the update's activation memory (the policy's and PRIME's "
        "implicit PRM's steps); 0: no limit.",
        lower_bound=0)
    lr: float = option(1e-4, "Policy learning rate (AdamW).")
    critic_lr: float = option(1e-3, "Critic learning rate (value head and critic adapter).")
    warmup_iterations: int = option(20, "Linear lr warm-up length in iterations (Adam's first steps move every weight "
                                    "by about lr; warm-up keeps them small).", lower_bound=0)
    lr_schedule: LrSchedule = option(
        LrSchedule.LINEAR, "After warm-up: linear decay to 0 at the last iteration, or constant. A run resumed with "
        "another --num_env_steps goes on at the new budget's lr for the step it has reached.")
    max_grad_norm: float = option(1.0, "Gradient norm clip (0: off).")
    target_kl: float = option(0.0, "Stop the update early once a minibatch's approx KL to the behaviour policy "
                              "exceeds this (0: off).")
    max_nonfinite_steps: int = option(
        3, "A non-finite loss or gradient skips that optimizer step; this many in a row stop the run with an error "
        "(the last checkpoint is kept as the last good one).", lower_bound=1)
    critic: Critic = option(
        Critic.AUTO, f"Train a critic: auto = {named(lambda spec: spec.critic is not None)} yes, the others no. On a "
        "multi-agent env (with a critic) it says "
        "what the critic reads: centralized (= auto, on): the joint transcript (every message so far) and the "
        "acting role's name, one value head (MAPPO); per_role: each role's own prompt, a value head per role.")
    prompt_groups: int | None = None  # resolved: RLOO oversampling: groups kept per iteration over every rank

    @property
    def critic_view(self) -> Critic:
        """What a multi-agent critic reads: the joint transcript (centralized), or each role's prompt (per_role)."""
        return Critic.PER_ROLE if self.critic == Critic.PER_ROLE else Critic.CENTRALIZED


@dataclass(frozen=True)
class PrimeConfig(PrimeOptions):
    """PRIME: RLOO with an implicit process reward model and accuracy-filtered prompt groups (``PrimeOptions``, which
    the algorithm reads, and the implicit PRM's own)."""

    oversample_factor: int = option(4, "PRIME: sample this many times the prompts, keep --n_rollout_threads / "
                                    "--group_size of those passing the accuracy filter.", lower_bound=1)
    implicit_prm_beta: float = option(0.05, "PRIME: implicit PRM beta.")
    implicit_prm_lr: float = option(1e-3, "PRIME: implicit PRM learning rate (PRIME's paper used 1e-6 on 7B models).")
    implicit_prm_grad_clip: float = option(10.0, "PRIME: the implicit PRM's gradient norm is clipped to this before "
                                           "each of its steps (PRIME's reward_model optim.grad_clip: 10).")
    implicit_prm_num_mini_batch: int = option(
        1, "PRIME: optimizer steps the implicit PRM takes on each batch, each on the next 1/N of the episodes it "
        "learns from (PRIME's reward_model.mini_batch_size is that batch / N; its run script's batch makes N 4).",
        lower_bound=1)
    prime_update: PrimeUpdate = option(PrimeUpdate.BEFORE, "PRIME: when the implicit PRM takes its step on a batch's "
                                       "trained episodes: before scoring them (their rewards then carry their own "
                                       "outcomes) or after the policy's update (one PRM forward pass fewer).")
    prime_norm: PrimeNorm = option(PrimeNorm.BATCH_NORM, "PRIME: batch_norm divides a batch's process rewards by their "
                                   "largest |return-to-go| (process returns in [-1, 1], as the outcome's); none: "
                                   "implicit_prm_beta * log-ratio as is.")
    prime_granularity: ImplicitPrmGranularity = option(
        ImplicitPrmGranularity.TOKEN, "PRIME: where the implicit PRM pays its rewards: token, a reward per token; "
        "whole, the response's sum at its last token; step, each step's sum at its last token, a step ending at a "
        "blank line (\"\\n\\n\", PURE's separator) or at the response's end.")
    process_credit_assignment: ProcessCredit = option(
        ProcessCredit.SUM_FORM, "PRIME: how a response's implicit-PRM rewards add up in its process return, in PURE's "
        "names (Cheng et al. 2025): sum_form pays each as it is (the return grows with the length), min_form weights "
        "them by softmax(-r / --min_form_temperature) over the response (a weighted mean near the lowest), before "
        "--prime_norm.")
    min_form_temperature: float = option(0.1, "PRIME with --process_credit_assignment min_form: the softmax "
                                         "temperature T (PURE's 0.1; large: the plain mean).")
    implicit_prm_heldout_all: bool = option(False, "PRIME: also score every sampled episode, the groups the prompt "
                                            "filter drops included, for implicit_prm/heldout_all_auc (one more "
                                            "PRM and reference pass over all of them).")


@dataclass(frozen=True)
class MultiAgentConfig(MultiAgentOptions):
    """Multi-agent workflows (Arith-Chain-v0, ...): roles' models, credit and group baselines (``MultiAgentOptions``,
    which the algorithm reads)."""

    role_models: tuple[str, ...] = option(
        (), "ROLE=DIR (repeatable; DIR a directory or a hub id): a frozen role of a multi-agent workflow (one its "
        "Workflow marks trainable=False, e.g. Arith-Prefix-v0's solver: Prefix-RL's frozen target) speaks with the "
        "model in DIR instead of the policy. Frozen roles are never trained on; without a model of their own they "
        "speak with the policy.", flag="role_model")
    frozen_roles: tuple[str, ...] = option(
        (), "ROLE (repeatable): a role of a multi-agent workflow that acts but is never trained on (as a role its "
        "Workflow marks trainable=False): it speaks with the policy (its starting weights under --noshare_policy, "
        "the policy as it trains otherwise), or with --role_model ROLE=DIR.", flag="frozen_role")
    role_base_models: tuple[str, ...] = option(
        (), "ROLE=DIR (repeatable; DIR a directory or a hub id): a trained role of a multi-agent workflow learns on "
        "a base model of its own (PettingLLMs' specialization full, its base_models), with its own optimizer, "
        "learning rate (--role_lr), LoRA or full fine-tuning (--role_lora_rank), lr schedule and checkpoint part; "
        "the other roles share the policy. Critic-free algorithms, synchronous HF generation.",
        flag="role_base_model")
    role_lrs: tuple[str, ...] = option(
        (), "ROLE=LR (repeatable): the learning rate of a --role_base_model role (default --lr).", flag="role_lr")
    role_lora_ranks: tuple[str, ...] = option(
        (), "ROLE=R (repeatable): the LoRA rank of a --role_base_model role, 0 training all its weights (default "
        "--lora_rank).", flag="role_lora_rank")
    reward_assignment: RewardAssignment = option(
        RewardAssignment.TEAM, "Multi-agent envs: how each role is credited. team: the verified final answer, to "
        "every role that acted; individual: each role's own verifiable output (its answer; a verifier's verdict "
        "against the truth); counterfactual: the team outcome minus the outcome with the role's messages replaced "
        "by its default (e.g. the verifier always accepting).")
    rollout_mode: RolloutMode = option(
        RolloutMode.INDEPENDENT, "Multi-agent envs, training: independent, each env of a group plays its own "
        "episode; tree, after every turn the envs of a group whose episodes go on continue from the one whose "
        "messages earned the most (PettingLLMs' tree rollouts for AT-GRPO: a role's actions at a turn of a group "
        "then answer one prompt). Needs --group_size >= 2; held-out episodes are always independent.")
    share_policy: bool = option(
        True, "Multi-agent envs: every role acts with the one policy, told apart by its prompt; --noshare_policy "
        "gives each trained role a LoRA adapter of its own on the shared base (needs --lora_rank > 0; generated by "
        "--generation_backend hf or vllm, every role in one call), all trained in the same optimizer step.")

    @property
    def models_by_role(self) -> dict[str, str]:
        """``role_models`` as {role: model directory or hub id}. Raises ValueError on an entry not ROLE=DIR."""
        return by_role(self.role_models, "role_model", "ROLE=DIR", "solver=/models/target")

    @property
    def base_models_by_role(self) -> dict[str, str]:
        """``role_base_models`` as {role: model directory or hub id}. Raises ValueError on an entry not ROLE=DIR."""
        return by_role(self.role_base_models, "role_base_model", "ROLE=DIR", "verifier=/models/verifier")

    @property
    def lrs_by_role(self) -> dict[str, float]:
        """``role_lrs`` as {role: learning rate}. Raises ValueError on an entry not ROLE=LR (LR > 0)."""
        given = by_role(self.role_lrs, "role_lr", "ROLE=LR", "verifier=1e-5")
        return {role: number(text, float, "role_lr", role, "a learning rate > 0") for role, text in given.items()}

    @property
    def lora_ranks_by_role(self) -> dict[str, int]:
        """``role_lora_ranks`` as {role: LoRA rank}. Raises ValueError on an entry not ROLE=R (R >= 0)."""
        given = by_role(self.role_lora_ranks, "role_lora_rank", "ROLE=R", "verifier=8")
        return {role: number(text, int, "role_lora_rank", role, "a LoRA rank >= 0 (0: full fine-tuning)")
                for role, text in given.items()}


def by_role(entries: tuple[str, ...], flag: str, shape: str, example: str) -> dict[str, str]:
    """Repeated ``--flag ROLE=VALUE`` entries as {role: value}. Raises ValueError on an entry not of ``shape``
    (e.g. ROLE=DIR), or a role given twice."""
    values: dict[str, str] = {}
    for entry in entries:
        role, sep, text = entry.partition("=")
        if not sep or not role or not text:
            raise ValueError(f"--{flag}={entry!r} must be {shape} (e.g. {example})")
        if role in values:
            raise ValueError(f"--{flag} gives role {role!r} twice ({values[role]!r} and {text!r}); give it once")
        values[role] = text
    return values


def number(text: str, kind: type, flag: str, role: str, what: str) -> int | float:
    """``text`` as a ``kind`` (int or float), positive for a float and non-negative for an int. Raises ValueError
    naming ``--flag role=text`` and ``what`` it must be."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or (value <= 0 if kind is float else value < 0):
        raise ValueError(f"--{flag}={role}={text}: must be {what}")
    return value


@dataclass(frozen=True)
class PrefixRLConfig:
    """Prefix-RL: the policy writes a prefix and a frozen target solver finishes it."""

    handoff_steps: int | None = option(
        None, "Prefix-RL: an episode ends after this many policy actions and the frozen target "
        "(--target_model_name_or_path, reward 'target') solves on from the prefix. With --action_level solution "
        "and --max_new_tokens K the prefix is one action of at most K tokens.", lower_bound=1)
    target_model: str | None = option(None, "Frozen target solver for the 'target' reward source (Prefix-RL): a "
                                      "directory or a hub id (see --model_name_or_path).",
                                      flag="target_model_name_or_path")
    target_num_samples: int = option(1, "Completions the target samples from each prefix; the 'target' reward is the "
                                     "fraction that verify.", lower_bound=1)
    target_temperature: float = option(0.0, "Sampling temperature of the target, and of a frozen --role_model role "
                                       "(0: greedy; use > 0 with --target_num_samples > 1).", lower_bound=0.0)
    target_max_new_tokens: int = option(256, "Most tokens the target writes after the prefix, and a frozen "
                                        "--role_model role's messages.", lower_bound=1)


@dataclass(frozen=True)
class DistributedConfig:
    """Data-parallel training under torchrun."""

    dist_timeout: float = option(
        600.0, "Under torchrun: seconds any collective (gradient all-reduce, statistics) may wait for the other "
        "ranks before this rank fails with an error, so a rank that hangs or dies ends the job instead of stalling "
        "it.", lower_bound=1.0)
    data_parallel: DataParallel = option(
        DataParallel.AUTO, "Under torchrun: how the policy is split over the ranks. ddp: every rank holds the whole "
        "model and optimizer state, gradients all-reduced; fsdp: FSDP2 shards weights, gradients and optimizer "
        "state over the ranks (full fine-tuning only); auto: fsdp for full fine-tuning, ddp for LoRA.")


@dataclass(frozen=True)
class BudgetConfig:
    """How long the run trains, how it is evaluated, and its seed."""

    num_env_steps: int = option(
        81_920, "Env steps to take in all, oversampled and background batches included; iterations = "
        "ceil(num_env_steps / (episode_length * envs per iteration)), where envs per iteration = n_rollout_threads "
        f"(x oversample_factor for {named(lambda spec: spec.prime)}); --filter_groups' refill rounds come on top.",
        lower_bound=1)
    eval_interval: int = option(100, "Evaluate every this many iterations (and at the start and end); 0: never.",
                                lower_bound=0)
    eval_limit: int = option(1000, "Most held-out problems per evaluation.", lower_bound=1)
    eval_batch_size: int = option(500, "Solutions generated per evaluation batch (greedy ones, then --eval_samples "
                                  "per problem).", lower_bound=1)
    eval_samples: int = option(
        0, "Sampled solutions per held-out problem at each evaluation, besides the greedy one: logs pass@k (the "
        "unbiased estimator) as pass_at_k and maj@k (majority answer) as maj_at_k for k = 1, 2, 4, ... and this "
        "number, and mean_at_<this number> (0: greedy only).", lower_bound=0)
    eval_temperature: float = option(1.0, "Sampling temperature of --eval_samples (> 0).")
    eval_top_p: float = option(1.0, "Nucleus sampling of --eval_samples (1: off).")
    seed: int = option(0, "Seed of torch, numpy, the problem sampler and generation.")
    val_only: bool = option(False, "Evaluate the model once on the held-out set, train nothing, save no "
                            "checkpoint, and stop; its evaluation goes to TensorBoard and eval_history.json.")
    val_before_train: bool = option(True, "With --eval_interval: evaluate before the first iteration too "
                                    "(--noval_before_train skips it where the start is known, e.g. a variant of a "
                                    "run whose LoRA adapters start as the same base).")
    num_iterations: int | None = None  # resolved from num_env_steps (given in code: it wins)


@dataclass(frozen=True)
class GenerationConfig:
    """How rollouts are generated."""

    backend: Backend = option(Backend.HF, "Generation backend: HF transformers in this process, a vLLM engine in "
                              "this process, or vLLM servers at --vllm_url.", flag="generation_backend")
    max_new_tokens: int = option(64, "Most tokens per action (per step, or per solution).", lower_bound=1)
    temperature: float = option(0.5, "Sampling temperature for rollouts (> 0; evaluation is greedy). Large models "
                                "are commonly sampled at 1.0.")
    top_p: float = option(1.0, "Nucleus sampling for rollouts (1: off).")
    async_rollouts: bool | None = option(
        None, "Generate the next batch with a copy of the policy in a second thread while the current one trains "
        "(on a CPU: a second core), at most --max_policy_lag updates behind; ratios are taken against the "
        f"rollout log-probs recorded at generation. Default: on with --generation_backend=hf for "
        f"{named(lambda spec: spec.asynchronous)}, and for every algorithm on a CPU.")
    max_policy_lag: int = option(1, "With --async_rollouts: most policy updates a batch may lag.", lower_bound=1)


@dataclass(frozen=True)
class RolloutConfig:
    """What happens to the rollouts between generation and the loss: DAPO's dynamic sampling and overlong
    penalty, masking cut-off completions, and rollout correction (importance weights between the sampler's
    log-probs and the trainer's). Every option is off by default."""

    filter_groups: bool = option(
        False, "Dynamic sampling (DAPO; verl's algorithm.filter_groups.enable): keep drawing prompt groups until the "
        "batch holds --n_rollout_threads/--group_size groups whose episode returns are not all equal (on each rank "
        "its share), at most --max_num_gen_batches rounds; groups of equal returns leave the batch. "
        f"{named(lambda spec: spec.episodic)} ({named(lambda spec: spec.prime)} with --oversample_factor 1).")
    max_num_gen_batches: int = option(
        10, "With --filter_groups: most rounds of generation per iteration (verl's "
        "algorithm.filter_groups.max_num_gen_batches); after the last one the batch trains on the groups it holds.",
        lower_bound=1)
    mask_truncated_completions: bool = option(
        False, "Drop actions cut at --max_new_tokens from the loss (TRL's mask_truncated_completions); they still "
        "count in their group's baseline.")
    overlong_buffer: bool = option(
        False, "DAPO's soft overlong punishment (verl's reward_model.overlong_buffer.enable): an action longer than "
        "--max_new_tokens - --overlong_buffer_len tokens is paid a penalty growing linearly to "
        "-(--overlong_penalty_factor) at --max_new_tokens.")
    overlong_buffer_len: int = option(16, "With --overlong_buffer: tokens before --max_new_tokens over which the "
                                      "penalty grows (verl's overlong_buffer.len).", lower_bound=1)
    overlong_penalty_factor: float = option(1.0, "With --overlong_buffer: the penalty at --max_new_tokens (verl's "
                                            "overlong_buffer.penalty_factor).", lower_bound=0.0)
    rollout_is: bool = option(
        False, "Rollout correction (verl's algorithm.rollout_is): the trainer scores the batch before the update "
        "(its ratios are then taken against these log-probs) and weights (--rollout_is_mode truncate, TIS) or masks "
        "(mask) each action by its trainer/sampler probability ratio. The gap between the sampler's and the "
        "trainer's log-probs is logged under rollout/ in every run.")
    rollout_is_threshold: float = option(2.0, "With --rollout_is: the cap of the truncated weight (truncate), the "
                                         "upper end of the band (mask); verl's rollout_is_threshold.")
    rollout_is_threshold_lower: float | None = option(
        None, "With --rollout_is_mode mask: the lower end of the band (verl's rollout_is_threshold_lower). Default: "
        "1 / --rollout_is_threshold.")
    rollout_is_level: RolloutIsLevel = option(RolloutIsLevel.TOKEN, "With --rollout_is: the ratio per token, per "
                                              "action (product over its tokens) or their geometric mean (verl's "
                                              "rollout_is_level).")
    rollout_is_mode: RolloutIsMode = option(RolloutIsMode.TRUNCATE, "With --rollout_is: weight by the ratio capped "
                                            "at --rollout_is_threshold, or mask actions whose ratio leaves the band "
                                            "(verl's rollout_is_mode).")

    @property
    def rollout_is_band(self) -> tuple[float, float]:
        """(lower, upper) ends of the ratio band that --rollout_is_mode mask keeps."""
        upper = self.rollout_is_threshold
        return (self.rollout_is_threshold_lower or 1.0 / upper), upper


MAX_SERVICE_BACKOFF = 30.0
"""Most seconds between two retries of a request to a --*_url server."""


@dataclass(frozen=True)
class ServicesConfig:
    """Models behind servers and how their clients wait and retry (more patiently than a bare client: a batch
    of long completions takes a while, and a run would rather wait than lose an iteration)."""

    target_url: str | None = option(
        None, "The 'target' reward's frozen solver behind OpenAI-compatible completions servers (`vllm serve`), "
        "instead of --target_model_name_or_path: URL[,URL...]; each request goes to the URL with the fewest in "
        "flight.")
    target_model_name: str | None = option(None, "The target's served model name (default: the one model the "
                                           "--target_url servers serve).")
    prm_url: str | None = option(None, "PRM server(s) started with `python -m reward_models.serve`, instead of "
                                 "--prm_model_name_or_path: URL[,URL...]. Enables the 'prm' reward source.")
    prm_model_name: str | None = option(None, "The PRM's served model name (default: the one the server serves).")
    vllm_url: str | None = option(
        None, "--generation_backend=vllm_server: the vLLM server(s) serving --model_name_or_path, URL[,URL...] "
        "(see the README: LoRA policies need --enable-lora, full fine-tuning VLLM_SERVER_DEV_MODE=1).")
    vllm_model_name: str | None = option(None, "The policy's served model name on --vllm_url (default: the one "
                                         "model the servers serve).")
    tool_url: str | None = option(None, "The python tool's calls go to this Sandbox Fusion-style run_code service "
                                  "(`python -m envs.sandbox_server`), instead of sandbox processes on this machine.")
    vllm_sync_dir: str | None = option(None, "Where new policy weights are written for the --vllm_url servers to "
                                       "load (a path they can read). Default: <run dir>/sync.")
    connect_timeout: float = option(5.0, "Seconds to connect to a --*_url server before the attempt counts as "
                                    "failed.", flag="service_connect_timeout")
    read_timeout: float = option(300.0, "Seconds a --*_url server may stay silent on a request (a batch of long "
                                 "completions takes a while) before the attempt counts as failed.",
                                 flag="service_read_timeout")
    retries: int = option(4, "Retries of a request after connection errors, timeouts and HTTP 502/503/504 (never "
                          "after 4xx), with exponential backoff and jitter; then the iteration fails, its start "
                          "saved.", flag="service_retries", lower_bound=0)
    backoff: float = option(1.0, "Seconds before the first retry (doubling each time, at most 30).",
                            flag="service_backoff")
    max_in_flight: int = option(8, "Most requests in flight per --*_url server.", flag="service_max_in_flight",
                                lower_bound=1)
    api_key: str | None = option(
        None, "Key sent to every --*_url server as 'Authorization: Bearer KEY' (what `vllm serve --api-key` and "
        "`python -m reward_models.serve --api_key` expect). Default: $MATHRL_SERVICE_API_KEY (preferred: a flag "
        "shows in the process list). Never logged or saved: a resume takes it from this flag or the variable "
        "again.", flag="service_api_key", secret=True)

    @property
    def client(self) -> ClientSettings:
        """How each service client waits and retries."""
        from models.remote import ClientSettings  # here: http.client is no cost of parsing the flags

        return ClientSettings(connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                              retries=self.retries, backoff=self.backoff, max_backoff=MAX_SERVICE_BACKOFF,
                              max_in_flight=self.max_in_flight, api_key=self.api_key)


@dataclass(frozen=True)
class LoggingConfig:
    """Where the run writes, how often, and what it resumes."""

    logdir: str = option("runs", "TensorBoard and checkpoint root: <logdir>/<experiment>/<run>.")
    experiment_name: str | None = option(None, "Name of the run's directory under --logdir. Default: "
                                         "<algorithm>_<env>.")
    log_interval: int = option(1, "Write training scalars every this many iterations.", lower_bound=1)
    save_interval: int = option(100, "Save a checkpoint every this many iterations (and at the end); 0: only at the "
                                "end.", lower_bound=0)
    resume: str | None = option(
        None, "Continue a run from a checkpoint: 'auto' = the newest complete checkpoint under "
        "<logdir>/<experiment> (a fresh start if there is none), or a checkpoint directory "
        "<run>/checkpoints/iter_N. Restores weights, optimizer, scheduler, RNGs, the env's problem order and the "
        "counters; TensorBoard continues in the same run directory.")
    keep_checkpoints: int = option(2, "Keep only the newest this many checkpoints (older complete ones are deleted "
                                   "after each save; <run>/best is kept apart); 0: keep all. Hugging Face's "
                                   "save_total_limit, verl's max_actor_ckpt_to_keep.", lower_bound=0)
    save_best: bool = option(True, "After an evaluation whose held-out accuracy beats every earlier one, write the "
                             "policy to <run>/best (Hugging Face format; loadable by from_pretrained and "
                             "--model_name_or_path).")
    save_dtype: DType | None = option(None, "Dtype of the weights of exported policies (<run>/best): float32, bfloat16 "
                                    "or float16. Checkpoints keep the weights as the optimizer steps them, so that a "
                                    "resume continues exactly. Default: the training dtype (--dtype).")


@dataclass(frozen=True)
class RunConfig:
    """Every part of a run, one section per --helpfull section. ``flags``: the command line's flag values, saved
    with each checkpoint so a resume can inherit them (empty for a run built without flags).

    Built in code, a config leaves None what the command line would resolve; ``train.resolve.resolved`` works
    it out (the builders call it) and refuses a bad value as a bad flag is refused:

    >>> from train.resolve import resolved
    >>> config = RunConfig(learning=LearningConfig(algorithm="GRPO"), env=EnvConfig(num_envs=8),
    ...                    budget=BudgetConfig(num_env_steps=64))
    >>> run = resolved(config)
    >>> run.env.env_id, run.env.group_size, run.rewards.spec, run.budget.num_iterations
    ('Arith-v0', 4, 'outcome:1.0,steps:1.0', 8)
    >>> from envs.modes import LossAgg
    >>> run.learning.loss_agg_mode is LossAgg.TOKEN_MEAN
    True
    >>> resolved(RunConfig(learning=LearningConfig(scale_rewards="std")))
    Traceback (most recent call last):
    ValueError: LearningConfig.scale_rewards='std' (--scale_rewards) must be one of group, batch, none
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    learning: LearningConfig = field(default_factory=LearningConfig)
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    multi_agent: MultiAgentConfig = field(default_factory=MultiAgentConfig)
    prefix_rl: PrefixRLConfig = field(default_factory=PrefixRLConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    flags: dict = field(default_factory=dict)


def sections() -> dict[str, type]:
    """{RunConfig field: its section's dataclass}, in --helpfull's order."""
    default = RunConfig()
    return {part.name: type(getattr(default, part.name)) for part in fields(RunConfig)
            if is_dataclass(getattr(default, part.name))}
