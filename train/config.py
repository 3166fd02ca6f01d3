"""A run's configuration: one typed, frozen dataclass per part, and the single source of each option.

A user option is a field declared with ``train.options.option`` (its default and help written once);
its absl flag is generated from it (train/flags/), so ``RunConfig()`` and ``train_math.py`` without
flags start from the same values. A default of None means "resolved from other flags": the help says
to what, and ``train.resolve.config_from_flags`` resolves it, in one place. The builders
(train/builders.py) each take their part, so a library user builds a run without absl:
``build_runner(RunConfig(...), run_dir, writer)``.

Light on purpose: the flags are generated from these classes before torch (or the env) is imported.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from algorithms.registry import AlgorithmConfig
from train.options import option

if TYPE_CHECKING:
    from envs.workflows import Workflow
    from models.remote import ClientSettings

PRM_TYPES = {"shepherd": "shepherd", "classifier": "classifier", "ms": "shepherd", "qwen": "classifier"}
"""--prm_type's accepted names (OpenR's MS and Qwen included) -> the PRM kind."""
REWARD_SOURCES = ("outcome", "prm", "target", "steps")
DEFAULT_PRM_REWARD = "outcome:1.0,prm:0.2"


class ActionLevel(enum.StrEnum):
    """What one env action is."""

    SOLUTION = "solution"  # a whole solution: one generate call per episode
    STEP = "step"  # one reasoning step: generation stops at the step delimiter
    TOKEN = "token"  # one token (the env's token mode)


class RewardAssignment(enum.StrEnum):
    """How a multi-agent env credits each role."""

    TEAM = "team"  # the verified final answer, to every role that acted
    INDIVIDUAL = "individual"  # each role's own verifiable output
    COUNTERFACTUAL = "counterfactual"  # the team outcome minus the outcome without the role's messages


class LrSchedule(enum.StrEnum):
    """The learning rate after warm-up."""

    LINEAR = "linear"  # decays to 0 at the last iteration
    CONSTANT = "constant"


@dataclass(frozen=True)
class ModelConfig:
    """The policy's weights and how it runs. Model paths are local directories (hub ids already resolved)."""

    name_or_path: str | None = None  # None: the shipped tiny policy (the tiny team model on a workflow)
    revision: str | None = None  # the hub revision the model paths were resolved at
    device: str = "auto"
    dtype: str = "float32"
    lora_rank: int = 0
    gradient_checkpointing: bool = False
    role_adapters: tuple[str, ...] = ()  # trained roles with a LoRA adapter of their own
    role_models: dict[str, str] = field(default_factory=dict)  # frozen role -> its model directory
    value_heads: int = 1  # one per role with a per-role critic
    torch_threads: int = 1
    return_freed_memory: bool = True  # on a CPU device: freed tensors leave the resident set
    data_parallel: str = "auto"  # under torchrun: ddp, fsdp or auto
    dist_timeout: float = 600.0  # under torchrun: seconds a collective may wait


ANSWER_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
"""What a chat prompt's user turn ends with by default: the answer format, as verl's MATH and GSM8K recipes
ask for it (an instruct model that is not told where to put its answer rarely boxes it)."""


@dataclass(frozen=True)
class EvalSet:
    """A held-out set: its name (None: the one unnamed set, logged under ``eval/``; else under ``eval/<name>/``)
    and where its problems come from (None: the env's own held-out split, or --dataset_path)."""

    name: str | None = None
    path: str | None = None


@dataclass(frozen=True)
class EnvConfig:
    """The train and held-out envs: a registered id, where problems come from, what one action is."""

    env_id: str = "Arith-v0"  # registered gymnasium id (its module imported)
    workflow: Workflow | None = None  # a multi-agent env's roles
    dataset_path: str | None = None
    dataset_name: str | None = None
    eval_sets: tuple[EvalSet, ...] = (EvalSet(),)  # the first one's greedy accuracy picks the best checkpoint
    action_level: ActionLevel = ActionLevel.SOLUTION
    handoff_steps: int | None = None  # Prefix-RL: policy actions before the target takes over
    episode_length: int = 1
    num_envs: int = 128  # envs stepped per iteration (RLOO: times its oversampling)
    group_size: int = 4
    whole_episodes: bool = True  # one episode per env per iteration (no autoreset)
    eval_batch_size: int = 500
    reward_assignment: RewardAssignment = RewardAssignment.TEAM  # multi-agent credit
    prompt_template: str = "default"  # default, qwen_math or chat
    system_prompt: str | None = None
    answer_instruction: str = ANSWER_INSTRUCTION  # ends a chat prompt's user turn
    env_kwargs: dict = field(default_factory=dict)  # the user's keywords for the env id (envs.override_kwargs)
    tools: str | None = option(
        None, "Tool the policy may call (--action_level step): 'python' runs a step that ends in a fenced ```python "
        "block in a sandbox and shows its output as the next turn (never trained on, never scored as a step); "
        "'none' turns off an env id's tool. Default: the env id's own (MATH-Tool-v0, Arith-Tool-v0: python).")
    max_tool_calls: int | None = option(None, "Tool calls per episode; a call beyond them ends the episode "
                                        "(truncated). Default: the env's (4).", lower_bound=1)
    max_tool_output_chars: int | None = option(None, "A tool call's output is cut to this many characters. Default: "
                                               "the env's (1024).", flag="max_tool_response_length", lower_bound=1)
    tool_timeout: float | None = option(None, "Wall-clock seconds one tool call may run. Default: the env's (5).",
                                        lower_bound=0.001)


@dataclass(frozen=True)
class RewardConfig:
    """The weighted reward sources and the models behind them."""

    spec: str = "outcome"  # e.g. "outcome:1.0,prm:0.2"
    prm_model: str | None = None
    prm_checkpoint_path: str | None = None
    prm_type: str = "shepherd"  # shepherd or classifier
    prm_step_tag: str | None = None
    prm_kv_cache_mb: float | None = None
    target_model: str | None = None
    target_num_samples: int = 1
    target_temperature: float = 0.0
    target_max_new_tokens: int = 256

    @property
    def weights(self) -> dict[str, float]:
        """{source: weight} of ``spec``."""
        from reward_models.mixture import parse_reward_spec  # here: the flags are generated from this module

        return parse_reward_spec(self.spec, REWARD_SOURCES)


@dataclass(frozen=True)
class LearningConfig:
    """The algorithm, its losses' coefficients, and the optimisation."""

    algorithm: str = "GRPO"
    losses: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # max_groups: see prompt_groups
    prompt_groups: int | None = None  # RLOO oversampling: groups kept per iteration over every rank
    critic_view: str = "centralized"  # a multi-agent critic reads the joint transcript, or per_role prompts
    lr: float = 1e-4
    critic_lr: float = 1e-3
    warmup_iterations: int = 20
    lr_schedule: LrSchedule = LrSchedule.LINEAR
    num_mini_batch: int = 1
    ppo_epoch: int = 1
    gradient_cp_steps: int = 1
    micro_batch_tokens: int = 0
    max_grad_norm: float = 1.0
    target_kl: float = 0.0
    max_nonfinite_steps: int = 3
    implicit_prm_beta: float = 0.05
    implicit_prm_lr: float = 1e-3


class Backend(enum.StrEnum):
    """Where rollouts are generated."""

    HF = "hf"  # Hugging Face transformers, in this process
    VLLM = "vllm"  # a vLLM engine, in this process
    VLLM_SERVER = "vllm_server"  # vLLM servers at --vllm_url


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
        "behaviour log-probs recorded at generation. Default: on with --generation_backend=hf for APPO, and for "
        "every algorithm on a CPU.")  # None (RunConfig()): off
    max_policy_lag: int = option(1, "With --async_rollouts: most policy updates a batch may lag.", lower_bound=1)


@dataclass(frozen=True)
class BudgetConfig:
    """How long the run trains and how it is evaluated."""

    num_iterations: int = 640
    num_env_steps: int | None = None  # the budget the iterations came from (messages only)
    eval_interval: int = 100
    eval_limit: int = 1000
    eval_samples: int = 0  # sampled solutions per held-out problem (pass@k, maj@k, mean@k); 0: greedy only
    eval_temperature: float = 1.0
    eval_top_p: float = 1.0


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
                                  "(`python -m envs.sandbox serve`), instead of sandbox processes on this machine.")
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
    save_dtype: str | None = option(None, "Dtype of the weights of exported policies (<run>/best): float32, bfloat16 "
                                    "or float16. Checkpoints keep the weights as the optimizer steps them, so that a "
                                    "resume continues exactly. Default: the training dtype (--dtype).")


@dataclass(frozen=True)
class RunConfig:
    """Every part of a run. ``flags``: the command line's flag values, saved with each checkpoint so a
    resume can inherit them (empty for a run built without flags)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    learning: LearningConfig = field(default_factory=LearningConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 0
    flags: dict = field(default_factory=dict)
