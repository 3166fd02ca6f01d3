"""The house's modes, one string enum each: the env's (what one action is, the tool an action may call,
how a multi-agent env credits its roles, the grader), the reward models' and generation's, the algorithms'
and the trainer's options. Every layer compares members of these; the trainer's flags take these same enums
(``train.config``), and so does a config built in code.

A member equals its string (``ActionLevel.STEP == "step"``), so a user's keywords may be either; each
constructor turns them into members once (``member_of``, or the enum's own call) and compares members after.
Stdlib only, at the bottom of the house: the algorithms import this module and nothing else of ``envs``.
Importing it runs the package's ``__init__`` (gymnasium, numpy, sympy), never torch: the trainer's flags are
built from these and a bad flag fails before a model library loads.

>>> LossAgg("token-mean") is LossAgg.TOKEN_MEAN, LossAgg.TOKEN_MEAN.per_token
(True, True)
>>> member_of(tuple(PrmType), "shepherd", "prm_type")
<PrmType.SHEPHERD: 'shepherd'>
>>> member_of(tuple(PrmType), "orm", "prm_type")
Traceback (most recent call last):
ValueError: prm_type='orm' must be one of 'shepherd', 'classifier'
"""

from __future__ import annotations

import enum
from typing import TypeVar


class ActionLevel(enum.StrEnum):
    """What one env action is."""

    SOLUTION = "solution"  # a whole solution: one generate call per episode (the env's step mode, max_steps=1)
    STEP = "step"  # one reasoning step: generation stops at the step delimiter
    TOKEN = "token"  # one token (the env's token mode)


class Tool(enum.StrEnum):
    """A tool the policy may call between reasoning steps, or none."""

    PYTHON = "python"  # a step ending in a fenced python block runs in a sandbox
    NONE = "none"  # no tool, even where the env id has one


class RewardAssignment(enum.StrEnum):
    """How a multi-agent env credits each role."""

    TEAM = "team"  # the verified final answer, to every role that acted
    INDIVIDUAL = "individual"  # each role's own verifiable output
    COUNTERFACTUAL = "counterfactual"  # the team outcome minus the outcome without the role's messages


class AnswerRule(enum.StrEnum):
    """How a multi-agent workflow's final answer is chosen (``envs.workflows.Workflow.candidates``)."""

    LAST = "last"  # the last answering message's answer
    VOTE = "vote"  # the majority among the answers of the last turn in which answering roles spoke


class VerdictKind(enum.StrEnum):
    """How a judging role of a workflow gives its verdict (``envs.workflows``' module docstring)."""

    LINE = "line"  # a closing 'Verdict: correct' or 'Verdict: wrong' line
    SOLVING = "solving"  # its own boxed answer, which accepts the judged solution when the two agree


class Grader(enum.StrEnum):
    """What decides whether a final answer equals the reference (``envs.grader.grade_batch``)."""

    MATHRL = "mathrl"  # this project's grader (envs.grader): string, number and bounded symbolic tiers
    MATH_VERIFY = "math_verify"  # Hugging Face's math-verify, as TRL's accuracy_reward and verl grade (extra)


class PromptTemplate(enum.StrEnum):
    """How a problem becomes a prompt (``models.prompting.build_template``)."""

    DEFAULT = "default"  # 'Problem: ...\nSolution:\n'
    QWEN_MATH = "qwen_math"  # Qwen2.5-Math's ChatML prompt
    CHAT = "chat"  # the tokenizer's own chat template


class PrmType(enum.StrEnum):
    """The kind of a process reward model."""

    SHEPHERD = "shepherd"  # Math-Shepherd step tags
    CLASSIFIER = "classifier"  # Qwen2.5-Math-PRM style


class PrmAggregation(enum.StrEnum):
    """How a PRM's step scores become a reward (``reward_models.prm.step_rewards``)."""

    STEP = "step"  # each new step's score, paid at that step
    LAST = "last"  # at the episode's end: the last step's score
    MIN = "min"  # at the episode's end: the lowest step score
    PRODUCT = "product"  # at the episode's end: the product of the step scores
    MEAN = "mean"  # at the episode's end: their mean


class ImplicitPrmGranularity(enum.StrEnum):
    """Where PRIME's implicit PRM pays its log-ratio rewards."""

    TOKEN = "token"  # a reward per token (PRIME's default)
    WHOLE = "whole"  # the response's sum, paid at its last token (PRIME's and verl's other granularity)
    STEP = "step"  # each step's sum, paid at its last token; steps end at blank lines (PURE's) and at the end


class Backend(enum.StrEnum):
    """Where rollouts are generated."""

    HF = "hf"  # Hugging Face transformers, in this process
    VLLM = "vllm"  # a vLLM engine, in this process
    VLLM_SERVER = "vllm_server"  # vLLM servers at --vllm_url


class FinishReason(enum.StrEnum):
    """Why a generated sample ended (``models.generation``'s conventions)."""

    STOP = "stop"  # a stop string, kept in the sample
    EOS = "eos"  # the EOS token (or an EOS-like stop token id), kept in its token ids but not in its text
    LENGTH = "length"  # max_new_tokens reached


class DType(enum.StrEnum):
    """The policy's compute dtype (float16: inference and exports only, ``train.config.FLOAT16_TRAINING``)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class CriticGranularity(enum.StrEnum):
    """What an algorithm's critic values (``AlgorithmSpec.critic``; None: the algorithm has no critic)."""

    ACTION = "action"  # V(s) per env step, read at the last prompt token
    TOKEN = "token"  # V per action token


class ScaleRewards(enum.StrEnum):
    """What centred group returns are divided by (GRPO)."""

    GROUP = "group"  # the group's std
    BATCH = "batch"  # the batch's std
    NONE = "none"  # nothing (Dr.GRPO)


class LossAgg(enum.StrEnum):
    """How per-token losses become one number (verl's ``loss_agg_mode`` names)."""

    TOKEN_MEAN = "token-mean"  # the mean over every action token of the minibatch (DAPO)
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # each action's token mean, then the mean over actions (GRPO)
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"  # each action's token sum, then the mean over actions
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"  # as above over a fixed length (Dr. GRPO)

    @classmethod
    def _missing_(cls, value: object) -> LossAgg | None:
        """The spellings of earlier releases (``LOSS_AGG_ALIASES``)."""
        return LOSS_AGG_ALIASES.get(value)

    @property
    def per_token(self) -> bool:
        """Whether every token of a minibatch weighs the same (else every action does)."""
        return self is LossAgg.TOKEN_MEAN


LOSS_AGG_ALIASES = {"token_mean": LossAgg.TOKEN_MEAN, "seq_mean": LossAgg.SEQ_MEAN_TOKEN_MEAN}
"""Earlier releases' spellings of two loss aggregations, taken wherever a LossAgg is (code, --loss_agg_mode)."""


class KLEstimator(enum.StrEnum):
    """Schulman's estimators of KL(pi || ref) from one sample of pi (verl's ``kl_loss_type`` names)."""

    K1 = "k1"  # log pi - log ref: unbiased, high variance, can be negative
    K2 = "k2"  # (log pi - log ref)^2 / 2: biased, low variance, >= 0
    K3 = "k3"  # ref/pi - 1 - log(ref/pi): unbiased, low variance, >= 0
    LOW_VAR_KL = "low_var_kl"  # k3 with log(ref/pi) clamped to [-20, 20] and the result to [-10, 10] (verl)


class ImportanceSamplingLevel(enum.StrEnum):
    """What the clipped importance ratio is taken over (TRL's ``importance_sampling_level``)."""

    TOKEN = "token"  # pi(y_t) / pi_old(y_t) per token (PPO, GRPO)
    SEQUENCE = "sequence"  # the length-normalised sequence ratio, one per action (GSPO)


class PrimeNorm(enum.StrEnum):
    """How PRIME scales the implicit PRM's token rewards within a batch (verl's ``prime_norm`` names)."""

    BATCH_NORM = "batch_norm"  # divided by the batch's largest |return-to-go|: every process return in [-1, 1]
    NONE = "none"  # beta * log-ratio as it is


class ProcessCredit(enum.StrEnum):
    """How a response's implicit-PRM rewards add up in its process return (the names of PURE, Cheng et al. 2025)."""

    SUM_FORM = "sum_form"  # each reward as it is: the return sums them, so it grows with the length (PRIME's)
    MIN_FORM = "min_form"  # weighted by softmax(-r / T) over the response: a weighted mean, near its lowest reward


class ProcessBaseline(enum.StrEnum):
    """What the process stream's leave-one-out baseline takes from a response's process return (PURE's
    ``--reward_baseline``, Cheng et al. 2025)."""

    TOKEN = "token"  # the others' mean reward per token times its own length (PRIME's code; PURE's default)
    RESPONSE = "response"  # the others' mean process return, whatever its length


class RolloutIsLevel(enum.StrEnum):
    """Where the trainer/sampler probability ratio of rollout correction is taken."""

    TOKEN = "token"  # each token's ratio
    SEQUENCE = "sequence"  # the product over the action's tokens
    GEOMETRIC = "geometric"  # the geometric mean over the action's tokens


class RolloutIsMode(enum.StrEnum):
    """What rollout correction does with the ratio."""

    TRUNCATE = "truncate"  # weight the policy-gradient term by min(ratio, threshold) (TIS)
    MASK = "mask"  # drop the action from the loss where the ratio leaves [threshold_lower, threshold]


class Critic(enum.StrEnum):
    """Whether a critic is trained and, on a multi-agent env, what it reads."""

    AUTO = "auto"  # APPO/TPPO yes, GRPO/RLOO no
    ON = "on"
    OFF = "off"
    CENTRALIZED = "centralized"  # the joint transcript and the acting role's name, one value head (MAPPO)
    PER_ROLE = "per_role"  # each role's own prompt, a value head per role


class LrSchedule(enum.StrEnum):
    """The learning rate after warm-up."""

    LINEAR = "linear"  # decays to 0 at the last iteration
    CONSTANT = "constant"


class PrimeUpdate(enum.StrEnum):
    """When PRIME's implicit PRM learns from a batch (verl's ``reward_model.model.update`` names)."""

    BEFORE = "before"  # its step on the batch, then its rewards for the batch (a second forward pass)
    AFTER = "after"  # its rewards for the batch, then, after the policy's update, its step on the batch


class AgentGroups(enum.StrEnum):
    """What a multi-agent group baseline compares (GRPO; RLOO and REINFORCE++-baseline take role and joint)."""

    ROLE = "role"  # one role's episodes of one problem, each scored by its return
    JOINT = "joint"  # every role's episodes of the problem together (MAGRPO's team baseline)
    AT_GRPO = "at_grpo"  # one role's actions at one turn of one problem, each scored by its turn's reward (AT-GRPO)


class RolloutMode(enum.StrEnum):
    """How the envs of a multi-agent group play their episodes (training; held-out episodes are independent)."""

    INDEPENDENT = "independent"  # each its own episode of the group's problem
    TREE = "tree"  # after each turn all continue from the one whose messages earned the most (PettingLLMs)


class DataParallel(enum.StrEnum):
    """How the policy is split over the ranks under torchrun."""

    AUTO = "auto"  # fsdp for full fine-tuning, ddp for LoRA
    DDP = "ddp"  # every rank holds the whole model, gradients all-reduced
    FSDP = "fsdp"  # FSDP2 shards weights, gradients and optimizer state


Mode = TypeVar("Mode", bound=enum.StrEnum)


def member_of(allowed: tuple[Mode, ...], value: object, name: str, hint: str = "") -> Mode:
    """``value`` (a member of ``allowed`` or its string) as that member; else a ValueError naming the
    keyword ``name``, the allowed strings and ``hint`` (what to do instead)."""
    for member in allowed:
        if value == member:
            return member
    choices = ", ".join(repr(member.value) for member in allowed)
    shown = value.value if isinstance(value, enum.Enum) else value
    raise ValueError(f"{name}={shown!r} must be one of {choices}{hint}")
