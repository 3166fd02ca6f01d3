"""Where PRIME's implicit PRM puts its rewards inside an answer: before the answer, after it, and on stopping.

    python -m bench.implicit_prm_probe --checkpoint RUN_DIR/checkpoints/iter_N [--rounds 1] [--seed 12345]
        [--process_credit_assignment sum_form|min_form] [--prime_granularity token|whole|step]
        [--reward_baseline token|response]

A PRIME run's checkpoint is restored as a resume would (its flags, policy, implicit PRM and env state); its
policy then answers ``--rounds`` fresh rollouts of the run's own training batch (its prompts, group size,
temperature and ``--max_new_tokens``), and its implicit PRM scores every token of every answer,
r_t = beta * log(pi_psi(y_t) / pi_ref(y_t)), raw (before ``--prime_norm``). Each answer is split at the end of the
first place its extracted answer appears: the tokens up to there (the solution), the tokens after it (what an
answer that goes on past its result holds), and the end-of-text token, where the answer stopped. The
counterfactual: the end-of-text token placed right after the answer, scored in the same context (what the PRM
pays for stopping there). A PRM that pays the tokens after the answer and charges stopping teaches the policy,
through the process stream's per-token returns, to run on to ``--max_new_tokens``.

Prints one line of JSON: answers, the share cut at the limit, the share right, and for the right answers and the
wrong ones with an extracted answer (``right/``, ``wrong/``) their number and means: tokens to the answer and after
it, the reward summed to the answer and after it, per token after it, the end token's where the answer stopped, and
the counterfactual stop's. What the process stream pays is a reward's difference from the group's: the right
answers' figures against the wrong ones'.

Then what each stream gives the policy gradient (``stream/``), over the groups the run would train on (its prompt
filter, ``kept``): the implicit PRM's rewards as the run's learner takes them (its credit and granularity, or
``--process_credit_assignment``'s and ``--prime_granularity``'s on the same answers, and its ``--prime_norm``; before
the step the run's PRM would take on them first), each stream's per-token returns as ``rloo_returns`` centres them
(with the run's ``--reward_baseline``, or the one given), their standard deviations over the real tokens, the
process stream's share of their summed variance, their correlation, and the share of tokens where the two returns
agree in sign (of those where the outcome's is not 0);
and how each stream's return at an answer's first token (what the whole answer is pushed by) correlates with its
length beyond its group's mean (``*_length_correlation``): the outcome's says whether longer answers were right
more often, the process stream's whether it pays length beyond that.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from absl import flags

from algorithms.losses import group_index, group_means
from algorithms.rloo import rloo_returns
from envs.grader.extraction import extract_answer
from envs.modes import ImplicitPrmGranularity, ProcessBaseline, ProcessCredit

FLAGS = flags.FLAGS


def answer_ends(texts: list[str], token_texts: list[list[str]]) -> list[int | None]:
    """Per answer, the number of its tokens that hold the first occurrence of its extracted answer (None where
    none is extracted or found). ``token_texts``: each answer's tokens decoded one by one."""
    ends = []
    for text, pieces in zip(texts, token_texts):
        answer = extract_answer(text)
        at = -1 if answer is None else text.find(answer)
        if at < 0:
            ends.append(None)
            continue
        reach = np.cumsum([len(piece) for piece in pieces])  # characters decoded after each token
        ends.append(min(int(np.searchsorted(reach, at + len(answer))) + 1, len(pieces)))
    return ends


def restored_runner(checkpoint: Path, run_dir: Path):
    """The Runner of ``checkpoint`` (an ``iter_N`` directory) with its own flags, as ``--resume`` builds it."""
    from train import checkpoint_files
    from train import flags as train_flags
    from train.builders import build_runner

    saved = checkpoint_files.load(checkpoint)
    flag_values = copy.deepcopy(FLAGS)  # train_math's flags, none given: each takes the checkpoint's value
    flag_values.unparse_flags()
    flag_values(["implicit_prm_probe"])
    train_flags.inherit(saved.flags, flag_values)
    config = train_flags.config_from_flags(flag_values)
    if config.prime.process_coef == 0 or config.learning.algorithm != "RLOO":
        raise ValueError(f"{checkpoint} is a run without an implicit PRM (--algorithm_name "
                         f"{config.learning.algorithm}, --process_coef {config.prime.process_coef}): "
                         "probe a PRIME run's")
    return build_runner(config, run_dir, None, saved)


@torch.no_grad()
def probe(checkpoint: Path, rounds: int, seed: int, credit: ProcessCredit | None = None,
          granularity: ImplicitPrmGranularity | None = None,
          baseline: ProcessBaseline | None = None) -> dict[str, float | str]:
    """The module docstring's figures for ``rounds`` rollouts of the run at ``checkpoint``; the ``stream/`` ones
    with the process credit ``credit``, the reward ``granularity`` and the process ``baseline`` (default: the
    run's)."""
    with tempfile.TemporaryDirectory() as run_dir:
        runner = restored_runner(checkpoint, Path(run_dir))
        try:
            prm, policy = runner.learner.implicit_prm, runner.policy
            tokenizer, eos = policy.tokenizer, policy.tokenizer.eos_token_id
            parts = [runner.collector.collect(policy, runner.generator, seed + k)[0] for k in range(rounds)]
            if credit is not None:  # the PRM's own attributes: its token_rewards read them
                prm.credit = credit
            if granularity is not None:
                prm.granularity = granularity
            baseline = baseline or runner.learner.algorithm.config.reward_baseline
            streams = {"credit": str(prm.credit), "granularity": str(prm.granularity), "baseline": str(baseline),
                       **stream_figures(*kept_streams(runner, parts), baseline)}
        finally:
            runner.close()
    rows = [(buffer, buffer.rows()) for buffer in parts]
    prompts = [prompt for _, batch in rows for prompt in batch.prompt_ids]
    ids = [batch.action_ids[k, :length].tolist() for _, batch in rows
           for k, length in enumerate(batch.action_lengths.tolist())]
    texts = [buffer.texts[i] for buffer, batch in rows for i in batch.index.tolist()]
    correct = torch.cat([buffer.episode_correct_at(batch.index) for buffer, batch in rows])
    cut = torch.cat([buffer.cut.flatten()[batch.index] for buffer, batch in rows]).tolist()
    rewards = [prm.beta * ratio for ratio in log_ratios(prm, prompts, ids)]
    ends = answer_ends(texts, [tokenizer.batch_decode(torch.tensor(answer)[:, None]) for answer in ids])
    found = [k for k, end in enumerate(ends) if end is not None]
    stops = log_ratios(prm, [prompts[k] for k in found], [ids[k][:ends[k]] + [eos] for k in found])
    stop_rewards = {k: prm.beta * float(ratio[ends[k]]) for k, ratio in zip(found, stops)}
    right = correct.bool().tolist()
    return {"answers": len(ids), "cut_share": mean(cut), "correct_share": mean(right),
            **{f"{name}/{key}": value for name, keep in (("right", True), ("wrong", False))
               for key, value in split_figures([k for k in found if right[k] == keep], ends, rewards, cut,
                                               stop_rewards).items()},
            **{f"stream/{key}": value for key, value in streams.items()}}


def kept_streams(runner, parts: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(outcome [B], process rewards [B, L], token mask [B, L], group ids [B]) of the episodes of ``parts`` (the
    runner's rollout buffers, one action an episode) that pass the run's prompt filter, groups told apart across
    parts."""
    outcome, process, masks, groups = [], [], [], []
    for part, buffer in enumerate(parts):
        rows = buffer.rows(runner.learner.algorithm.kept(buffer))
        episodes = rows.index % (buffer.shape[1] * buffer.shape[2])
        rewards, _ = runner.learner.implicit_prm.token_rewards(rows.prompt_ids, (rows.action_ids, rows.action_lengths))
        process.append(rewards.float().cpu())
        masks.append(torch.arange(rewards.shape[1]) < rows.action_lengths.cpu()[:, None])
        outcome.append(buffer.episode_returns().flatten()[episodes].cpu())
        groups.append(buffer.episode_group_ids().flatten()[episodes].cpu() + part * buffer.num_slots)
    width = max(rewards.shape[1] for rewards in process)
    return (torch.cat(outcome), torch.cat([padded(rewards, width) for rewards in process]),
            torch.cat([padded(mask, width) for mask in masks]), torch.cat(groups))


def padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, L] right-padded with zeros (False) to [B, width]."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def stream_figures(outcome: torch.Tensor, process: torch.Tensor, token_mask: torch.Tensor, group_ids: torch.Tensor,
                   baseline: ProcessBaseline = ProcessBaseline.TOKEN) -> dict[str, float]:
    """The module docstring's ``stream/`` figures. outcome: [B]; process: [B, L] token rewards; token_mask: [B, L];
    group_ids: [B]; baseline: the process stream's (``leave_one_out_centred``)."""
    if not len(outcome):
        return {"responses": 0}
    mask = token_mask.bool()
    by_token_o = rloo_returns(outcome.double(), group_ids, mask)
    by_token_p = rloo_returns(torch.zeros_like(outcome, dtype=torch.float64), group_ids, mask,
                              process=process.double(), process_baseline=baseline)
    returns_o, returns_p = by_token_o[mask], by_token_p[mask]
    var_o, var_p = returns_o.var(correction=0), returns_p.var(correction=0)
    signed = returns_o != 0
    lengths = mask.sum(-1).double()
    groups, sizes = group_index(group_ids)
    longer = lengths - group_means(lengths, groups, sizes)[groups]  # [B] tokens beyond its group's mean length
    return {"responses": len(outcome), "outcome_std": float(var_o.sqrt()), "process_std": float(var_p.sqrt()),
            "process_variance_share": float(var_p / (var_o + var_p)),
            "correlation": float(correlation(returns_o, returns_p)),
            "sign_agreement": float((returns_o.sign() == returns_p.sign())[signed].double().mean()),
            "outcome_length_correlation": float(correlation(by_token_o[:, 0], longer)),
            "process_length_correlation": float(correlation(by_token_p[:, 0], longer))}


def correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson's correlation of [N] ``x`` and [N] ``y``."""
    return torch.corrcoef(torch.stack([x, y]))[0, 1]


def split_figures(answers: list[int], ends: list[int | None], rewards: list[torch.Tensor], cut: list[bool],
                  stop_rewards: dict[int, float]) -> dict[str, float]:
    """The module docstring's means over ``answers`` (indices of answers with an extracted answer ending at token
    ``ends[k]``; ``rewards[k]``: their token rewards; ``cut[k]``: run to the limit; ``stop_rewards[k]``: the
    end-of-text token's right after the answer)."""
    after = [len(rewards[k]) - ends[k] for k in answers]
    reward_after = [float(rewards[k][ends[k]:].sum()) for k in answers]
    return {
        "answers": len(answers), "tokens_to_answer": mean([ends[k] for k in answers]), "tokens_after": mean(after),
        "reward_to_answer": mean([float(rewards[k][:ends[k]].sum()) for k in answers]),
        "reward_after": mean(reward_after),
        "reward_per_token_after": sum(reward_after) / sum(after) if sum(after) else math.nan,
        "end_token_reward": mean([float(rewards[k][-1]) for k in answers if not cut[k]]),
        "stop_after_answer_reward": mean([stop_rewards[k] for k in answers]),
    }


def mean(values: list[float]) -> float:
    """Their mean; NaN for none."""
    return float(np.mean(values)) if values else math.nan


def log_ratios(prm, prompts: list[list[int]], actions: list[list[int]], batch: int = 16) -> list[torch.Tensor]:
    """Per action, log pi_psi - log pi_ref [its length] under ``prm`` (an ``ImplicitPRM``), ``batch`` at a time."""
    out = []
    for start in range(0, len(actions), batch):
        chunk = actions[start:start + batch]
        ratio, _ = prm.log_ratios(prompts[start:start + batch], chunk)
        out += [row[:len(action)].float().cpu() for row, action in zip(ratio, chunk)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="A PRIME run's iter_N checkpoint directory.")
    parser.add_argument("--rounds", type=int, default=1, help="Rollouts of the run's training batch to probe.")
    parser.add_argument("--seed", type=int, default=12345, help="The rollouts' sampling seed.")
    parser.add_argument("--process_credit_assignment", type=ProcessCredit, choices=tuple(ProcessCredit), default=None,
                        help="The process credit the stream figures take (default: the run's).")
    parser.add_argument("--prime_granularity", type=ImplicitPrmGranularity, choices=tuple(ImplicitPrmGranularity),
                        default=None, help="Where the stream figures' process rewards are paid (default: the run's).")
    parser.add_argument("--reward_baseline", type=ProcessBaseline, choices=tuple(ProcessBaseline), default=None,
                        help="The process stream's baseline in the stream figures (default: the run's).")
    args = parser.parse_args()
    figures = probe(args.checkpoint, args.rounds, args.seed, args.process_credit_assignment, args.prime_granularity,
                    args.reward_baseline)
    print(json.dumps({"checkpoint": str(args.checkpoint), **figures}))


if __name__ == "__main__":
    main()
