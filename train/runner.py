"""The one training loop every algorithm shares:

    collect (vector env + generator + critic values) -> reference / implicit-PRM scores
    -> algorithm.compute_advantages -> update epochs over minibatches -> generator.sync
    -> log -> eval -> checkpoint

Collection is episodic for GRPO/RLOO (reset every env, step until every episode ended, generating
only for live envs) and continuing for APPO/TPPO (``episode_length`` steps, episodes spanning
iterations, bootstrapped from V of the last observation unless terminated). With
``async_rollouts`` a background thread generates the next batch with a copy of the policy while
the current batch trains; the copy is refreshed so no batch lags more than ``max_policy_lag``
policy versions, and ratios use the behaviour log-probs recorded at generation time.

Surviving faults:
- Checkpoints (``train.checkpoint``) every ``save_interval`` iterations and at the end hold the weights,
  optimizer and scheduler, RNG states, the env's state and the counters; ``restore`` continues from
  one exactly (synchronous collection: the same parameters and logged values as a run never stopped).
- SIGINT/SIGTERM: the current iteration finishes, a checkpoint is written, ``run`` returns with
  ``stop_signal`` set. A second signal interrupts at once (KeyboardInterrupt).
- A non-finite loss or gradient norm skips that optimizer step (logged, counted in
  ``train/nonfinite_steps``); ``max_nonfinite_steps`` in a row raise ``NonFiniteError`` without saving,
  so the last checkpoint stays the last good one.
- An exception before the update (a reward model raising in evaluation or collection) writes a
  checkpoint of the state at the start of that iteration, then propagates.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from algorithms.base import Algorithm
from envs.prompts import STEP_DELIMITER
from train import checkpoint
from algorithms.buffer import RolloutBuffer
from train.models.generation import Generator
from train.models.policy import LanguagePolicy

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


@dataclass(frozen=True)
class RunnerConfig:
    num_iterations: int
    episode_length: int
    max_new_tokens: int
    action_level: str = "solution"  # "solution": one generate call per episode; "step": stop at the delimiter
    temperature: float = 1.0
    top_p: float = 1.0
    num_mini_batch: int = 1
    ppo_epoch: int = 1
    gradient_cp_steps: int = 1
    max_grad_norm: float = 1.0  # 0: no clipping
    target_kl: float = 0.0  # 0: off
    eval_interval: int = 50  # 0: never
    eval_limit: int = 1000
    log_interval: int = 1
    save_interval: int = 0  # 0: only at the end
    keep_checkpoints: int = 0  # 0: keep all
    save_best: bool = True  # after an eval that beats every earlier one, write the policy to <run>/best
    max_nonfinite_steps: int = 3
    seed: int = 0
    async_rollouts: bool = False
    max_policy_lag: int = 1
    num_text_samples: int = 4


class Runner:
    """Drives training; see the module docstring. ``eval_env`` is a vector env over held-out
    problems (group size 1); ``rollout_policy``/``rollout_generator`` are the copy used by
    asynchronous collection (required when ``config.async_rollouts``)."""

    def __init__(self, config: RunnerConfig, env, eval_env, policy: LanguagePolicy, generator: Generator,
                 algorithm: Algorithm, optimizer: torch.optim.Optimizer, scheduler, writer, run_dir: Path,
                 implicit_prm=None, rollout_policy: LanguagePolicy | None = None,
                 rollout_generator: Generator | None = None, run_flags: dict[str, Any] | None = None):
        if config.async_rollouts and (rollout_policy is None or rollout_generator is None):
            raise ValueError("async_rollouts needs rollout_policy and rollout_generator (a copy of the policy)")
        if algorithm.needs_process_rewards and implicit_prm is None:
            raise ValueError(f"{algorithm.name} needs an implicit PRM for its process rewards")
        self.config, self.env, self.eval_env = config, env, eval_env
        self.policy, self.generator, self.algorithm = policy, generator, algorithm
        self.optimizer, self.scheduler, self.writer, self.run_dir = optimizer, scheduler, writer, Path(run_dir)
        self.implicit_prm = implicit_prm
        self.rollout_policy, self.rollout_generator = rollout_policy, rollout_generator
        self.stop = [STEP_DELIMITER] if config.action_level == "step" else None
        self.eos_text = policy.tokenizer.eos_token or ""
        self.shuffle = torch.Generator().manual_seed(config.seed)
        self.obs, self.info = env.reset(seed=config.seed)
        self.episode_return = np.zeros(env.num_envs)
        self.version = 0  # optimizer updates so far (policy version)
        self.rollout_version = 0  # version the rollout copy holds
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if config.async_rollouts else None
        self.pending: concurrent.futures.Future | None = None
        self.env_steps = 0
        self.history: list[dict[str, float]] = []  # eval results, for the caller
        self.last_buffer: RolloutBuffer | None = None  # for the text panel of sampled solutions
        self.run_flags = run_flags or {}  # saved with every checkpoint
        self.iteration = 0  # completed iterations; the next one to run
        self.nonfinite_steps = 0  # skipped optimizer steps in the whole run
        self.nonfinite_in_a_row = 0
        self.last_checkpoint: Path | None = None
        self.stop_signal: str | None = None  # name of the signal that asked the run to stop

    # ---------------------------------------------------------------------------------------------
    # The loop
    # ---------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Trains from ``self.iteration`` (0, or where ``restore`` left it) to ``num_iterations``;
        returns the evaluation history. Stops early, after saving, on SIGINT/SIGTERM."""
        config = self.config
        progress = tqdm(range(self.iteration, config.num_iterations), initial=self.iteration,
                        total=config.num_iterations, desc=self.algorithm.name, dynamic_ncols=True)
        postfix: dict[str, str] = {}
        try:
            with self.signals_stop_after_iteration():
                for iteration in progress:
                    self.train_iteration(iteration, postfix)
                    progress.set_postfix(postfix, refresh=False)
                    if self.stop_signal is not None:
                        self.save()
                        return self.history
                    if config.save_interval and self.iteration % config.save_interval == 0:
                        self.save()
                if config.eval_interval:
                    self.evaluate(config.num_iterations)
                self.save()
        finally:
            progress.close()
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
            self.writer.flush()
        return self.history

    def train_iteration(self, iteration: int, postfix: dict[str, str]) -> None:
        """(Eval,) collect, update, sync, log. An exception before the update, when weights and
        optimizer are still those of the iteration's start, first saves that start state."""
        config = self.config
        start = self.snapshot() if self.pool is None else None  # async: the env is busy in the other thread
        try:
            if config.eval_interval and iteration % config.eval_interval == 0:
                postfix["acc"] = f"{self.evaluate(iteration)['eval/accuracy']:.3f}"
            buffer, stats = self.next_rollout(iteration)
        except Exception:
            path = self.save(start)
            log.error("iteration %d failed before its update; saved the state at its start to %s", iteration, path)
            raise
        stats.update(self.update(buffer))
        stats["time/sync"] = self.generator.sync(self.policy)
        self.version += 1
        if iteration % config.log_interval == 0:
            self.log(iteration, buffer, stats)
        postfix.update(reward=f"{stats['train/reward']:.3f}", train_acc=f"{stats['train/accuracy']:.3f}")
        self.iteration = iteration + 1

    @contextlib.contextmanager
    def signals_stop_after_iteration(self) -> Iterator[None]:
        """SIGINT/SIGTERM set ``stop_signal`` (the loop saves and returns after the current iteration);
        a second one raises KeyboardInterrupt. Only the main thread can install handlers: elsewhere
        signals keep their default behaviour."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, frame) -> None:
            if self.stop_signal is not None:
                raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without saving")
            self.stop_signal = signal.Signals(signum).name
            log.warning("%s received: finishing iteration %d, then saving a checkpoint and exiting (send it again "
                        "to stop at once without saving)", self.stop_signal, self.iteration)

        previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def next_rollout(self, iteration: int) -> tuple[RolloutBuffer, dict[str, float]]:
        """This iteration's batch: collected now, or (async) the one generated in the background,
        after starting the next one with a policy copy at most ``max_policy_lag`` versions old."""
        seed = self.config.seed * 1_000_003 + iteration * 1_009
        if self.pool is None:
            return self.collect(self.policy, self.generator, seed)
        result = self.pending.result() if self.pending is not None else self.collect(
            self.rollout_policy, self.rollout_generator, seed)
        buffer, stats = result
        stats["train/policy_lag"] = float(self.version - stats.pop("rollout_version"))
        # The next batch is trained on after this iteration's update, at version + 1.
        if self.version + 1 - self.rollout_version > self.config.max_policy_lag:
            self.rollout_policy.load_state_dict(self.policy.state_dict())
            self.rollout_generator.sync(self.rollout_policy)
            self.rollout_version = self.version
        self.pending = self.pool.submit(self.collect, self.rollout_policy, self.rollout_generator, seed + 1)
        return buffer, stats

    # ---------------------------------------------------------------------------------------------
    # Collection
    # ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def collect(self, policy: LanguagePolicy, generator: Generator, seed: int) -> tuple[RolloutBuffer, dict]:
        """One rollout of ``episode_length`` steps (episodic: until every episode ended)."""
        config, algorithm, env = self.config, self.algorithm, self.env
        num_envs = env.num_envs
        buffer = RolloutBuffer(config.episode_length, num_envs, 1, config.max_new_tokens, policy.device,
                               token_values=algorithm.critic == "token")
        if algorithm.episodic:
            self.obs, self.info = env.reset()
            self.episode_return[:] = 0
        done = np.zeros(num_envs, dtype=bool)
        bootstrap = torch.zeros(buffer.shape[:2])  # V(final observation) of truncated episodes
        timers, counts = defaultdict(float), defaultdict(float)
        components: dict[str, list[float]] = defaultdict(list)
        returns, correct = [], []
        for step in range(config.episode_length):
            acting = np.flatnonzero(~done)
            if len(acting) == 0:
                break
            started = time.perf_counter()
            out = generator.generate([self.obs[i] for i in acting], n=1, max_new_tokens=config.max_new_tokens,
                                     temperature=config.temperature, top_p=config.top_p, stop=self.stop,
                                     seed=seed + step)
            timers["generate"] += time.perf_counter() - started
            counts["tokens"] += sum(len(ids) for ids in out.token_ids)
            texts = self.action_texts(out.texts, out.finish_reasons)
            values, token_values = self.critic_values(policy, out.prompt_token_ids, out.token_ids)
            actions = [""] * num_envs
            for k, i in enumerate(acting):
                actions[i] = texts[k]
            group_ids = info_array(self.info, "group_id", num_envs, fill=-1)[acting].astype(np.int64)
            started = time.perf_counter()
            self.obs, rewards, terminated, truncated, self.info = env.step(actions)
            timers["reward"] += time.perf_counter() - started
            ended = terminated | truncated
            step_correct = step_info(self.info, "correct", ended)
            for key in {*self.info, *self.info.get("final_info", {})}:
                if key.startswith("reward/"):
                    components[key].extend(step_info(self.info, key, ended)[acting].tolist())
            buffer.add(step, acting, out.prompt_token_ids, out.token_ids, out.logprobs,
                       torch.as_tensor(rewards[acting]), torch.as_tensor(terminated[acting]),
                       torch.as_tensor(truncated[acting]), torch.as_tensor(group_ids),
                       torch.as_tensor(np.where(ended, step_correct, np.nan)[acting]), texts,
                       values=values, token_values=token_values)
            self.episode_return[acting] += rewards[acting]
            returns += self.episode_return[ended].tolist()
            correct += np.nan_to_num(step_correct[ended]).tolist()
            self.episode_return[ended] = 0
            if algorithm.critic is not None and truncated.any() and not algorithm.episodic:
                bootstrap[step] = self.values_of_final_observations(policy, truncated)
            if algorithm.episodic:
                done |= ended
            self.env_steps += len(acting)
        if algorithm.episodic:
            self.episode_return[:] = 0
        elif algorithm.critic is not None:
            buffer.next_values = self.next_values(policy, buffer, bootstrap)
        step_reward = float(buffer.rewards[buffer.live].mean())
        stats = {
            "time/generate": timers["generate"], "time/reward": timers["reward"],
            "perf/tokens_per_second": counts["tokens"] / max(timers["generate"], 1e-9),
            "train/step_reward": step_reward,
            # mean return of the episodes that ended in this rollout (every episode, when episodic)
            "train/reward": float(np.mean(returns)) if returns else step_reward,
            "train/accuracy": float(np.mean(correct)) if correct else math.nan,
            "train/episodes": float(len(returns)),
            "train/action_tokens": float(buffer.action_lengths[buffer.live].float().mean()),
            **{f"train/{key}": float(np.mean(values)) for key, values in components.items()},
        }
        if self.pool is not None:
            stats["rollout_version"] = self.rollout_version
        return buffer, stats

    def action_texts(self, texts: list[str], finish_reasons: list[str]) -> list[str]:
        """Env actions: in step mode a sample that ended on EOS carries the EOS text (the env's
        end marker) so that the episode ends even without an answer."""
        if self.stop is None:
            return list(texts)
        return [text + self.eos_text if reason == "eos" else text for text, reason in zip(texts, finish_reasons)]

    def critic_values(self, policy: LanguagePolicy, prompts: list[list[int]], actions: list[list[int]],
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(values [B] = V(s_t), token values [B, L] for a token critic) at collection time."""
        if self.algorithm.critic == "token":
            token_values = policy.token_values(prompts, actions)
            return token_values[:, 0], token_values
        if self.algorithm.critic == "action":
            return policy.values(prompts), None
        return None, None

    def values_of_final_observations(self, policy: LanguagePolicy, truncated: np.ndarray) -> torch.Tensor:
        """[N] V(final observation) where an episode was truncated (0 elsewhere)."""
        values = torch.zeros(len(truncated))
        final_obs = self.info["final_obs"]
        index = np.flatnonzero(truncated)
        prompts = policy.tokenizer([final_obs[i] for i in index])["input_ids"]
        values[index] = policy.values(prompts).float().cpu()
        return values

    def next_values(self, policy: LanguagePolicy, buffer: RolloutBuffer, bootstrap: torch.Tensor) -> torch.Tensor:
        """[T, N, A]: V(s_{t+1}) while the episode goes on, V(final obs) where truncated, 0 where
        terminated; after the last step, V of the current observation."""
        last = policy.values(policy.tokenizer(list(self.obs))["input_ids"]).float().to(buffer.device)
        following = torch.cat([buffer.values[1:, :, 0], last[None]], dim=0)
        following = torch.where(buffer.truncated[..., 0], bootstrap.to(buffer.device), following)
        return torch.where(buffer.terminated[..., 0], 0.0, following)[..., None]

    # ---------------------------------------------------------------------------------------------
    # Update
    # ---------------------------------------------------------------------------------------------

    def score_rollout(self, buffer: RolloutBuffer) -> None:
        """Reference log-probs (KL) and implicit-PRM token rewards of every live action."""
        if not (self.algorithm.needs_reference or self.algorithm.needs_process_rewards):
            return
        rows = buffer.live_rows()
        actions = (rows.action_ids, rows.action_lengths)
        with torch.no_grad():
            if self.algorithm.needs_reference:
                ref = self.policy.ref_log_probs(rows.prompts, actions, self.config.temperature)
                buffer.ref_logprobs = buffer.scatter_tokens(rows.index, ref)
            if self.algorithm.needs_process_rewards:
                process = self.implicit_prm.token_rewards(rows.prompts, actions)
                buffer.token_rewards = buffer.scatter_tokens(rows.index, process)

    def update(self, buffer: RolloutBuffer) -> dict[str, Any]:
        """Advantages, then ``ppo_epoch`` epochs of minibatch steps; returns statistics."""
        config, algorithm, policy = self.config, self.algorithm, self.policy
        started = time.perf_counter()
        self.score_rollout(buffer)
        advantage_stats = algorithm.compute_advantages(buffer)
        sums, weights = defaultdict(float), defaultdict(float)
        grad_norms, steps, stopped_early = [], 0, False
        for _ in range(config.ppo_epoch):
            for minibatch in buffer.minibatches(config.num_mini_batch, config.gradient_cp_steps, self.shuffle,
                                                skip=algorithm.skippable_rows):
                minibatch_kl, stepped = self.minibatch_step(minibatch, sums, weights, grad_norms)
                steps += stepped
                if config.target_kl and minibatch_kl > config.target_kl:
                    stopped_early = True
                    break
            if stopped_early:
                break
        if steps:  # the schedule advances with iterations that updated the policy
            self.scheduler.step()
        stats: dict[str, Any] = {f"loss/{key}": sums[key] / weights[key] for key in sums}
        if self.implicit_prm is not None:
            stats["loss/implicit_prm"] = self.update_implicit_prm(buffer)
        stats.update({
            "grad/norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "train/optimizer_steps": float(steps), "train/early_stopped": float(stopped_early),
            "train/nonfinite_steps": float(self.nonfinite_steps),
            "train/trained_samples": float(buffer.live.sum()), "time/update": time.perf_counter() - started,
            "histograms": advantage_stats,
        })
        for group in self.optimizer.param_groups:
            stats[f"lr/{group.get('name', 'group')}"] = group["lr"]
        return stats

    def minibatch_step(self, minibatch, sums: dict, weights: dict, grad_norms: list) -> tuple[float, bool]:
        """Accumulates the micro-batches' gradients, clips, steps; returns (the minibatch's approx KL,
        whether the optimizer stepped: not when the loss or the gradient norm is non-finite)."""
        policy, algorithm = self.policy, self.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        kl_sum, kl_weight, finite_loss = 0.0, 0, True
        for batch in minibatch:
            scores = policy.evaluate(batch.prompts, (batch.action_ids, batch.action_lengths), self.config.temperature,
                                     with_entropy=True, with_values=algorithm.critic is not None)
            loss, micro_stats = algorithm.loss(scores, batch)
            finite_loss &= bool(torch.isfinite(loss))
            loss.backward()
            for key, value in micro_stats.items():
                sums[key] += float(value) * batch.num_samples
                weights[key] += batch.num_samples
            kl_sum += float(micro_stats["approx_kl"]) * batch.num_samples
            kl_weight += batch.num_samples
        parameters = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        max_norm = self.config.max_grad_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
        kl = kl_sum / max(kl_weight, 1)
        if not (finite_loss and math.isfinite(grad_norm)):
            self.skip_nonfinite_step("loss" if not finite_loss else f"gradient norm ({grad_norm})")
            return kl, False
        self.nonfinite_in_a_row = 0
        grad_norms.append(grad_norm)
        self.optimizer.step()
        return kl, True

    def skip_nonfinite_step(self, what: str) -> None:
        """Drops the step's gradients; ``max_nonfinite_steps`` in a row stop the run (without saving:
        the last checkpoint stays the last good state)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        log.warning("iteration %d: non-finite %s; optimizer step skipped (%d in a row, %d in the run)",
                    self.iteration, what, self.nonfinite_in_a_row, self.nonfinite_steps)
        if self.nonfinite_in_a_row >= self.config.max_nonfinite_steps:
            raise NonFiniteError(
                f"iteration {self.iteration}: {self.nonfinite_in_a_row} optimizer steps in a row had a non-finite "
                f"{what} (--max_nonfinite_steps={self.config.max_nonfinite_steps}); stopped without saving. Last good "
                f"checkpoint: {self.last_checkpoint or 'none written yet'}. Check the rewards and the learning rate "
                "(--lr, --max_grad_norm) before resuming from it")

    def update_implicit_prm(self, buffer: RolloutBuffer) -> float:
        """PRIME: one step of the implicit PRM on this rollout's live actions, labelled by whether
        their episode's answer verified."""
        rows = buffer.live_rows()
        if rows.num_samples == 0:
            return math.nan
        num_envs = buffer.shape[1] * buffer.shape[2]
        labels = buffer.episode_correct().flatten()[rows.index % num_envs]
        return self.implicit_prm.update(rows.prompts, (rows.action_ids, rows.action_lengths), labels)

    # ---------------------------------------------------------------------------------------------
    # Evaluation, logging, checkpoints
    # ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, iteration: int) -> dict[str, float]:
        """Greedy accuracy, mean PRM score (if any) and mean solution length on held-out problems,
        ``eval_env.num_envs`` problems per batch."""
        if self.pending is not None:  # the env reward models must not run in two threads at once
            self.pending.result()
        started = time.perf_counter()
        env, generator = self.eval_env, self.generator
        problem_ids = [p.id for p in env.problems][: self.config.eval_limit]
        correct, lengths, prm_scores = [], [], []
        for start in range(0, len(problem_ids), env.num_envs):
            chunk = problem_ids[start:start + env.num_envs]
            padded = chunk + [chunk[0]] * (env.num_envs - len(chunk))  # the env has a fixed size; extras ignored
            obs, info = env.reset(options={"problem_ids": padded})
            done = np.zeros(env.num_envs, dtype=bool)
            done[len(chunk):] = True
            tokens = np.zeros(env.num_envs)
            verdicts = np.zeros(env.num_envs)
            while not done.all():
                acting = np.flatnonzero(~done)
                out = generator.generate([obs[i] for i in acting], n=1, max_new_tokens=self.config.max_new_tokens,
                                         temperature=0.0, stop=self.stop)
                actions = [""] * env.num_envs
                for k, text in zip(acting, self.action_texts(out.texts, out.finish_reasons)):
                    actions[k] = text
                obs, _, terminated, truncated, info = env.step(actions)
                tokens[acting] += [len(ids) for ids in out.token_ids]
                ended = (terminated | truncated) & ~done
                verdicts[ended] = np.nan_to_num(info_array(info, "correct", env.num_envs)[ended])
                if "reward/prm" in info:
                    prm_scores += info_array(info, "reward/prm", env.num_envs)[acting].tolist()
                done |= terminated | truncated
            correct += verdicts[: len(chunk)].tolist()
            lengths += tokens[: len(chunk)].tolist()
        result = {"eval/accuracy": float(np.mean(correct)), "eval/mean_length": float(np.mean(lengths)),
                  "time/eval": time.perf_counter() - started}
        if prm_scores:
            result["eval/prm_score"] = float(np.nanmean(prm_scores))
        best_before = max((h["eval/accuracy"] for h in self.history), default=-math.inf)
        for key, value in result.items():
            self.writer.add_scalar(key, value, iteration)
        self.history.append({"iteration": iteration, "env_steps": self.env_steps, **result})
        if self.config.save_best and result["eval/accuracy"] > best_before:
            self.save_best(iteration, result["eval/accuracy"])
        log.info("eval iteration %d (%d env steps): greedy accuracy %.3f on %d problems, mean length %.1f tokens%s",
                 iteration, self.env_steps, result["eval/accuracy"], len(correct), result["eval/mean_length"],
                 f", PRM score {result['eval/prm_score']:.3f}" if prm_scores else "")
        if self.last_buffer is not None:
            self.writer.add_text("samples", self.samples_markdown(self.last_buffer), iteration)
        return result

    def log(self, iteration: int, buffer: RolloutBuffer, stats: dict[str, Any]) -> None:
        self.last_buffer = buffer
        histograms = stats.pop("histograms", {})
        for key, values in histograms.items():
            values = values.detach().float().cpu()
            if values.numel() > 1:
                self.writer.add_histogram(f"hist/{key}", values.numpy(), iteration)
            if values.numel():
                self.writer.add_scalar(f"train/{key}_mean", float(values.mean()), iteration)
        for key, value in stats.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, iteration)
        self.writer.add_scalar("train/env_steps", self.env_steps, iteration)

    def samples_markdown(self, buffer: RolloutBuffer) -> str:
        """A few sampled solutions of the last rollout: each step with its reward."""
        tokenizer = self.policy.tokenizer
        lines = []
        for env_index in range(min(self.config.num_text_samples, buffer.shape[1])):
            steps = [t for t in range(buffer.shape[0]) if buffer.live[t, env_index, 0]]
            if not steps:
                continue
            flat = [int(buffer.slot_index(t, torch.tensor(env_index), torch.tensor(0))) for t in steps]
            prompt = tokenizer.decode(buffer.prompt_ids[flat[0]], skip_special_tokens=True)
            lines.append(f"**env {env_index}** (group {int(buffer.group_ids[steps[0], env_index, 0])})\n\n"
                         f"    {prompt.strip()}\n")
            for t, slot in zip(steps, flat):
                reward = float(buffer.rewards[t, env_index, 0])
                verdict = buffer.correct[t, env_index, 0]
                end = "" if torch.isnan(verdict) else f" (episode end, correct={bool(verdict)})"
                text = (buffer.texts[slot] or "").strip().replace("\n", " ")
                lines.append(f"- step {t}: `{text}` → reward {reward:.3f}{end}")
            lines.append("")
        return "\n".join(lines)

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(JSON state, RNG states) of everything but weights and optimizers: counters, eval history,
        the env (problem sampler, episodes in progress), episode returns; python/numpy/torch RNGs and
        the minibatch shuffle."""
        state = {"iteration": self.iteration, "env_steps": self.env_steps, "version": self.version,
                 "rollout_version": self.rollout_version, "nonfinite_steps": self.nonfinite_steps,
                 "nonfinite_in_a_row": self.nonfinite_in_a_row, "history": list(self.history),
                 "env": self.env.get_state(), "episode_return": self.episode_return.tolist()}
        return state, {**checkpoint.rng_state(), "shuffle": self.shuffle.get_state()}

    def save(self, snapshot: tuple[dict[str, Any], dict[str, Any]] | None = None) -> Path:
        """Writes checkpoint ``iter_<iteration>`` of ``snapshot`` (default: now) with the current weights
        and optimizers (``train.checkpoint.save``: atomic), then prunes to ``keep_checkpoints``."""
        if self.pending is not None:  # the rollout thread steps the env: let it finish first
            concurrent.futures.wait([self.pending])
        state, rng = snapshot or self.snapshot()
        checkpoints_dir = self.run_dir / "checkpoints"
        if self.last_checkpoint == checkpoints_dir / f"{checkpoint.PREFIX}{state['iteration']}":
            return self.last_checkpoint  # nothing trained since (e.g. the final save right after a periodic one)
        write_out(self.writer)  # every point logged before this checkpoint is on disk when it exists
        optimizers = {"policy": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.implicit_prm is not None:
            optimizers["implicit_prm"] = self.implicit_prm.optimizer.state_dict()
        path = checkpoint.save(checkpoints_dir, state["iteration"], policy=self.policy, optimizers=optimizers,
                               rng=rng, state=state, flags=self.run_flags,
                               implicit_prm=self.implicit_prm.model if self.implicit_prm is not None else None)
        self.last_checkpoint = path
        log.info("saved checkpoint %s", path)
        if self.config.keep_checkpoints:
            checkpoint.prune(checkpoints_dir, self.config.keep_checkpoints)
        return path

    def save_best(self, iteration: int, accuracy: float) -> Path:
        """The policy alone (``LanguagePolicy.save``: ``from_pretrained`` and ``--model_name_or_path`` load
        it) to ``<run>/best``, atomically replacing the previous best: RL's held-out accuracy swings, and
        the last iteration is rarely the best one."""
        path = checkpoint.atomic_write(self.run_dir / "best", iteration, self.policy.save)
        log.info("new best held-out accuracy %.3f at iteration %d: policy saved to %s", accuracy, iteration, path)
        return path

    def restore(self, saved: checkpoint.Checkpoint) -> None:
        """Continues from ``saved``: optimizers, scheduler, implicit PRM, RNGs, env and counters. The
        policy's weights are the caller's to load (``checkpoint.load_policy``), since the caller builds
        the policy."""
        optimizers = saved.optimizers(self.policy.device)
        if ("implicit_prm" in optimizers) != (self.implicit_prm is not None):
            raise checkpoint.CheckpointError(
                f"{saved.path} was trained {'with' if 'implicit_prm' in optimizers else 'without'} an implicit PRM, "
                f"this run {'trains one' if self.implicit_prm is not None else 'trains none'}: resume with the "
                "algorithm it was trained with")
        self.optimizer.load_state_dict(optimizers["policy"])
        self.scheduler.load_state_dict(optimizers["scheduler"])
        if self.implicit_prm is not None:
            saved.load_implicit_prm(self.implicit_prm.model)
            self.implicit_prm.optimizer.load_state_dict(optimizers["implicit_prm"])
        state, rng = saved.state, saved.rng()
        self.obs, self.info = self.env.set_state(state["env"])
        self.episode_return = np.asarray(state["episode_return"], dtype=np.float64)
        self.iteration, self.env_steps, self.version = state["iteration"], state["env_steps"], state["version"]
        self.rollout_version = state["rollout_version"]
        self.nonfinite_steps, self.nonfinite_in_a_row = state["nonfinite_steps"], state["nonfinite_in_a_row"]
        self.history = list(state["history"])
        checkpoint.set_rng_state(rng)
        self.shuffle.set_state(rng["shuffle"])
        self.last_checkpoint = saved.path
        log.info("resumed from %s: iteration %d, %d env steps", saved.path, self.iteration, self.env_steps)


def write_out(writer) -> None:
    """Every event logged to ``writer`` (a tensorboardX SummaryWriter) so far is in its file when this returns.

    tensorboardX's ``flush()`` flushes the file but not the events still queued for its writer thread,
    so a kill just after a checkpoint could lose the points logged just before it. Stopping the thread
    drains the queue in order; ``reopen`` starts a new one on the same queue and file (tensorboardX 2.x
    internals; tests/test_checkpoint.py reads the file back to check)."""
    events = writer.file_writer.event_writer
    events._worker.stop()
    events._closed = True
    events.reopen()
    events.flush()


def step_info(info: dict, key: str, ended: np.ndarray) -> np.ndarray:
    """[N] ``key`` of the episode each env just acted in: from ``info["final_info"]`` where the
    episode ended and the env already reset (SAME_STEP autoreset), else from ``info``."""
    values = info_array(info, key, len(ended))
    if "final_info" in info:
        values[ended] = info_array(info["final_info"], key, len(ended))[ended]
    return values


def info_array(info: dict, key: str, num_envs: int, fill: float = math.nan) -> np.ndarray:
    """[N] float array of ``info[key]`` where gymnasium's ``_key`` mask is set, ``fill`` elsewhere."""
    out = np.full(num_envs, fill, dtype=np.float64)
    if key in info:
        mask = np.asarray(info.get(f"_{key}", np.ones(num_envs, dtype=bool)), dtype=bool)
        out[mask] = np.asarray(info[key], dtype=np.float64)[mask]
    return out
