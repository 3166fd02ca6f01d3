"""Collector: steps the training vector env with a generator and writes one ``RolloutBuffer``.

Episodic algorithms (GRPO, RLOO) reset every env and step until every episode ended, generating only
for the envs still going; continuing ones (APPO, TPPO) run ``episode_length`` steps of episodes that
span iterations and bootstrap from V of the last observation while the episode goes on. An episode
that ended bootstraps nothing, truncated or not: the env graded it when it cut it (a solution out of
steps or length scores as unanswered), so its return is what it was paid. (Bootstrapping V of a
truncated episode's final observation paid the critic's guess for solutions that never answered, and
TPPO learned to stop answering: held-out accuracy fell to 0 on Arith.) A
multi-agent env is always collected in whole episodes: an agent's action bootstraps from the value of
its own next action in the episode (0 after its last), and its critic reads either the joint
transcript with its role's name (``critic="centralized"``: MAPPO's centralized value, one head) or its
own prompt with a value head of its own (``critic="per_role"``). The episodes are played by
``train.episodes.play``, the loop evaluation plays too; the collector records each step it yields. It
reads the env only through ``envs.contract``: ``env.agents`` (A slots, their roles, which are trained;
observations [N], or [N][A] with several agents) and each step's ``StepFacts`` (which slots act next,
rewards [N, A] scored in the env, every source's share, verdicts, tool calls). The rewards go to the buffer once,
``RolloutBuffer.add_step_results``: a reward that reaches an agent after its last action (a team outcome paid
when another agent ended the episode), and the end of the episode, land on that last action.

Statistics leave as sums and counts (``Tally``): means are taken by the runner, where the tallies of
several processes are added first.

Data parallelism: a process's envs are the global envs ``[env_offset, env_offset + num_envs)``. Each
action is sampled from a seed of (the iteration's seed, the step, the global env index), so a sample is
the same whichever process, and whichever batch, it is generated in.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from algorithms.buffer import RolloutBuffer, StepRecord
from algorithms.registry import AlgorithmSpec, collects_whole_episodes
from envs.contract import FACTS, Agents, StepFacts
from envs.modes import Critic, CriticGranularity, FinishReason
from envs.rewards import OverlongPenalty
from models.generation import Generator, mix_seed
from models.policy import LanguagePolicy
from train.episodes import EnvStep, RoleModels, Sampling, play


@dataclass
class Tally:
    """Sums and counts of per-sample statistics of one rollout, and its wall-clock seconds per phase."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, key: str, values: np.ndarray | Sequence[float]) -> None:
        values = np.asarray(values, dtype=np.float64)
        self.sums[key] += float(values.sum())
        self.counts[key] += values.size

    def merge(self, other: Tally, seconds_prefix: str = "") -> None:
        """Adds ``other``'s sums and counts, and its seconds under ``seconds_prefix`` + each phase's name."""
        for key, total in other.sums.items():
            self.sums[key] += total
            self.counts[key] += other.counts[key]
        for phase, seconds in other.seconds.items():
            self.seconds[seconds_prefix + phase] += seconds

    def mean(self, key: str) -> float:
        """NaN when nothing was added under ``key``."""
        return self.sums[key] / self.counts[key] if self.counts.get(key) else float("nan")


COUNTS = ("env_steps", "generated_tokens")
"""The collector's running counts, saved in its state: env steps taken, and tokens generated for every acting
(env, agent) pair (a frozen role's included: what the rollouts cost)."""


class Collector:
    """Owns the training env's episodes between iterations: the current observations and their ``StepFacts``
    (each env's running episode return among them), the env steps taken and the tokens generated (all saved with
    checkpoints)."""

    def __init__(self, env, spec: AlgorithmSpec, episode_length: int, sampling: Sampling, seed: int,
                 env_offset: int = 0, role_models: RoleModels = RoleModels(), critic: Critic = Critic.CENTRALIZED,
                 overlong: OverlongPenalty | None = None):
        if critic not in (Critic.CENTRALIZED, Critic.PER_ROLE):  # what a multi-agent critic reads
            raise ValueError(f"critic={critic!r} must be 'centralized' or 'per_role' (LearningConfig.critic_view)")
        self.env, self.spec, self.episode_length, self.sampling = env, spec, episode_length, sampling
        self.env_offset = env_offset
        agents: Agents = env.agents
        self.num_agents = agents.count
        self.roles = agents.roles or None  # the agent slots' role names (multi-agent envs)
        self.whole_episodes = collects_whole_episodes(spec, agents.multi)
        # what the critic reads in a multi-agent env (one agent: its prompt, one head)
        self.critic = critic if agents.multi and spec.critic is not None else None
        # [A] the agents whose actions are trained on: a workflow's frozen roles act but are not trained
        self.trainable_agents = np.array(agents.trainable)
        self.role_models = role_models
        self.overlong = overlong  # DAPO's length penalty, added to each trained action's reward (None: none)
        self.obs, info = env.reset(seed=seed)
        self.facts: StepFacts = info[FACTS]
        self.env_steps = 0
        self.generated_tokens = 0

    @torch.no_grad()
    def collect(self, policy: LanguagePolicy, generator: Generator, seed: int) -> tuple[RolloutBuffer, Tally]:
        """One rollout of ``episode_length`` steps (episodic: until every episode ended), played by
        ``train.episodes.play`` with each action drawn from a seed of (``seed``, the step, the global sample
        index); each step is recorded (``record``) as it comes."""
        num_envs, spec = self.env.num_envs, self.spec
        buffer = RolloutBuffer(self.episode_length, num_envs, self.num_agents, self.sampling.max_new_tokens,
                               policy.device, token_values=spec.critic is CriticGranularity.TOKEN)
        if self.whole_episodes:
            self.obs, info = self.env.reset()
            self.facts = info[FACTS]
        tally = Tally()

        def seed_of(step: int, env: int, agent: int) -> int:
            return mix_seed(seed, step, (self.env_offset + env) * self.num_agents + agent)

        for stepped in play(self.env, self.obs, self.facts, generator, self.sampling, self.role_models, seed_of,
                            steps=self.episode_length, whole_episodes=self.whole_episodes):
            self.obs, self.facts = stepped.obs, stepped.facts
            self.record(stepped, policy, buffer, tally)
        if self.whole_episodes and spec.critic is not None:
            buffer.next_values = buffer.next_action_values()
        elif spec.critic is not None:
            buffer.next_values = self.next_values(policy, buffer)
        tally.add("train/step_reward", buffer.rewards[buffer.live].double().cpu().numpy())
        tally.add("train/action_tokens", buffer.action_lengths[buffer.live].double().cpu().numpy())
        tally.add("rollout/truncated_share", buffer.cut[buffer.live].double().cpu().numpy())
        return buffer, tally

    def record(self, stepped: EnvStep, policy: LanguagePolicy, buffer: RolloutBuffer, tally: Tally) -> None:
        """One env step into ``buffer``: the trained agents' actions with the critic's values, their rewards and
        the overlong penalty; its statistics and seconds into ``tally``."""
        record = self.step_record(stepped, policy)
        buffer.add(record)
        buffer.add_step_results(stepped.t, stepped.facts.rewards, stepped.terminated, stepped.truncated,
                                stepped.facts.correct)
        self.pay_overlong(buffer, record, tally)
        self.tally_step(tally, stepped)
        self.env_steps += len(np.unique(stepped.envs))
        self.generated_tokens += sum(len(ids) for ids in stepped.out.token_ids)

    def step_record(self, stepped: EnvStep, policy: LanguagePolicy) -> StepRecord:
        """What the buffer keeps of the samples [B] ``stepped`` took: those of the trained agents (all, with one
        agent), with the critic's values of them on the facts they acted on."""
        out = stepped.out
        trained = np.flatnonzero(self.trainable_agents[stepped.agents]).tolist()
        envs, agents = stepped.envs[trained], stepped.agents[trained]
        prompt_ids = [out.prompt_token_ids[k] for k in trained]
        action_ids = [out.token_ids[k] for k in trained]
        critic_prompt_ids = self.critic_prompt_ids(policy, stepped.before, envs, agents)
        values, token_values = self.critic_values(policy, critic_prompt_ids or prompt_ids, action_ids,
                                                  agents.tolist() if self.critic == Critic.PER_ROLE else None)
        return StepRecord(step=stepped.t, envs=envs, agents=agents, prompt_ids=prompt_ids, action_ids=action_ids,
                          rollout_log_probs=[out.rollout_log_probs[k] for k in trained],
                          group_ids=torch.as_tensor(stepped.before.group_ids[envs]),
                          texts=[out.texts[k] for k in trained], values=values, token_values=token_values,
                          critic_prompt_ids=critic_prompt_ids,
                          cut=[out.finish_reasons[k] == FinishReason.LENGTH for k in trained])

    def tally_step(self, tally: Tally, stepped: EnvStep) -> None:
        """The statistics of one env step: its seconds, the tokens generated for the pairs that acted, their
        reward sources, tool calls, the episodes that ended and each role's verified outputs."""
        envs, agents = stepped.envs, stepped.agents
        tally.seconds["generate"] += stepped.generate_seconds
        tally.seconds["reward"] += stepped.env_seconds
        tally.add("tokens", [len(ids) for ids in stepped.out.token_ids])
        self.tally_reward_sources(tally, envs, agents)
        if self.facts.tool_called is not None:  # an env with a tool: the share of actions that called it
            tally.add("train/tool_calls", self.facts.tool_called[envs, agents])
        self.tally_ended_episodes(tally, stepped.ended)
        self.tally_role_metrics(tally)

    def pay_overlong(self, buffer: RolloutBuffer, record: StepRecord, tally: Tally) -> None:
        """Adds the overlong penalty of ``record``'s actions to their rewards (logged as the reward source
        ``overlong``)."""
        if self.overlong is None or not record.action_ids:
            return
        penalty = self.overlong([len(ids) for ids in record.action_ids])
        buffer.add_rewards(record.step, torch.as_tensor(record.envs), torch.as_tensor(record.agents),
                           torch.as_tensor(penalty))
        tally.add("train/reward/overlong", penalty)

    def tally_ended_episodes(self, tally: Tally, ended: np.ndarray) -> None:
        """Returns (summed over agents, and per role in a multi-agent env) and verdicts of the episodes
        that ended [N]."""
        tally.add("train/reward", self.facts.return_so_far[ended].sum(1))
        tally.add("train/accuracy", np.nan_to_num(self.facts.correct[ended]))
        for a, role in enumerate(self.roles or ()):
            tally.add(f"train/{role}/reward", self.facts.return_so_far[ended, a])

    def tally_reward_sources(self, tally: Tally, envs: np.ndarray, agents: np.ndarray) -> None:
        """Each reward source's reward of the actions ``envs[b], agents[b]`` just taken (``reward/<source>``
        infos: [N], or [N, A] in a multi-agent env; NaN where an action was not scored), under
        ``train/reward/<source>`` and, per role, ``train/<role>/reward/<source>``."""
        for name, values in self.facts.sources.items():
            values = values[envs, agents]  # [B]
            scored = ~np.isnan(values)
            if scored.any():
                tally.add(f"train/reward/{name}", values[scored])
            for a, role in enumerate(self.roles or ()):
                mine = scored & (agents == a)
                if mine.any():
                    tally.add(f"train/{role}/reward/{name}", values[mine])

    def tally_role_metrics(self, tally: Tally) -> None:
        """Each role's verified outputs of this step (multi-agent envs): its answers' accuracy, a judge's
        acceptance rate and how often its verdict was right."""
        for metric, values in self.facts.outputs.items():  # [N, A], NaN where the slot had none
            for a, role in enumerate(self.roles or ()):
                said = ~np.isnan(values[:, a])
                if said.any():
                    tally.add(f"train/{role}/{metric}", values[said, a])

    def critic_prompt_ids(self, policy: LanguagePolicy, facts: StepFacts, envs: np.ndarray,
                          agents: np.ndarray) -> list[list[int]] | None:
        """Token ids [B] of the joint transcripts a centralized critic reads for the pairs ``envs[b], agents[b]``
        acting on ``facts`` (its ``states``); None when the critic reads the actor's prompt."""
        if self.critic != Critic.CENTRALIZED or len(envs) == 0:
            return None
        return policy.tokenizer([facts.states[i, a] for i, a in zip(envs, agents)])["input_ids"]

    def critic_values(self, policy: LanguagePolicy, prompts: list[list[int]], actions: list[list[int]],
                      heads: list[int] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(values [B] = V(s_t), token values [B, L] for a token critic) at collection time, of what the critic
        reads (``prompts``), from value head ``heads[b]`` (None: head 0)."""
        if self.spec.critic is None or not prompts:
            return None, None
        if self.spec.critic is CriticGranularity.TOKEN:
            token_values = policy.token_values(prompts, actions, heads=heads)
            return token_values[:, 0], token_values
        return policy.values(prompts, heads), None

    def next_values(self, policy: LanguagePolicy, buffer: RolloutBuffer) -> torch.Tensor:
        """[T, N, A]: V(s_{t+1}) while the episode goes on, 0 where it ended (terminated or truncated);
        after the last step, V of the current observation."""
        last = policy.values(policy.tokenizer(list(self.obs))["input_ids"]).float().to(buffer.device)
        following = torch.cat([buffer.values[1:, :, 0], last[None]], dim=0)
        return torch.where(buffer.episode_ends()[..., 0], 0.0, following)[..., None]

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable: the env's state (problem sampler, episodes in progress with their returns so
        far), the env steps taken and the tokens generated."""
        return {"env": self.env.get_state(), "env_steps": self.env_steps, "generated_tokens": self.generated_tokens}

    def merge_states(self, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The collector state of one process holding every rank's envs (``states`` in rank order)."""
        return {"env": self.env.merge_states([state["env"] for state in states]),
                **{name: sum(state[name] for state in states) for name in COUNTS}}

    def split_state(self, state: dict[str, Any], rank: int) -> dict[str, Any]:
        """This collector's share of a merged state (its envs: ``env_offset`` on); rank 0 keeps the ``COUNTS``,
        so the ranks' counts still add up to them (a count the checkpoint predates starts at 0)."""
        num_envs, group_size = self.env.num_envs, self.env.group_size
        return {"env": self.env.split_state(state["env"], self.env_offset // group_size, num_envs // group_size),
                **{name: state.get(name, 0) if rank == 0 else 0 for name in COUNTS}}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues exactly where ``get_state`` was called."""
        self.obs, info = self.env.set_state(state["env"])
        self.facts = info[FACTS]
        self.env_steps = state["env_steps"]
        # a checkpoint written before the token count existed: counted from its resume on
        self.generated_tokens = state.get("generated_tokens", 0)
