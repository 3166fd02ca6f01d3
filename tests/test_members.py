"""Roles on base models of their own (``--role_base_model``) trained together with the policy in one run: two
different tiny bases on the solver -> verifier -> refiner chain, each with its own optimizer, learning rate, LoRA
or full fine-tuning and checkpoint part, logged per role, resumed exactly; a role frozen by ``--frozen_role``."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from event_files import read_scalars
from test_checkpoint import assert_same_training_state, flags_for, length_reward  # noqa: F401  (a fixture)
from test_trainer import run_train_math
from models.policy import LanguagePolicy, LoraSettings
from models.team import Team


def test_a_team_scores_each_row_with_its_voice_and_trains_that_model_alone(untrained_policy_dir,
                                                                          smaller_policy_dir):
    """Rows of the policy and of a member (another base, LoRA) in one call score as each model alone scores
    them, and a row's gradient reaches its own model only; each row's reference is its own model's base."""
    policy = LanguagePolicy(untrained_policy_dir, device="cpu")
    member = LanguagePolicy(smaller_policy_dir, device="cpu", lora=LoraSettings(rank=4))
    team = Team(policy, {"verifier": member})
    prompts, actions, voices = [[5, 6, 7], [8, 9], [10]], [[10, 11], [12], [13, 14, 15]], [None, "verifier", None]
    scores = team(prompts, actions, adapters=voices)
    with torch.no_grad():
        own = policy.score_actions([prompts[0], prompts[2]], [actions[0], actions[2]]).log_probs
        members = member.score_actions([prompts[1]], [actions[1]]).log_probs
    torch.testing.assert_close(scores.log_probs[[0, 2]].detach(), own)
    torch.testing.assert_close(scores.log_probs[1, :1].detach(), members[0])
    assert torch.equal(scores.mask.sum(1), torch.tensor([2, 1, 3]))
    scores.log_probs[1].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in policy.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in member.parameters() if p.requires_grad)
    reference = team.ref_log_probs(prompts, actions, adapters=voices)
    torch.testing.assert_close(reference[1, :1], members[0])  # LoRA B starts at 0: the member is its base
    torch.testing.assert_close(reference[[0, 2]], own)  # the policy's reference is its starting weights


def chain_with_a_member(policy_dir: Path, member_dir: Path, logdir: Path, iterations: int, *extra: str) -> list[str]:
    """GRPO on the chain (4 envs in groups of 2, 3 turns), each answer paid its length (``length_reward``): the
    policy (full fine-tuning, lr 1e-3) speaks for the solver, the refiner learns on ``member_dir`` with a LoRA
    adapter of rank 4 at lr 3e-3, and the verifier is frozen (it speaks with the policy, and nothing trains on its
    messages; a verdict is paid no length); a KL to each model's own reference."""
    return flags_for(policy_dir, logdir, "GRPO", iterations, "--env_id", "Arith-Chain-v0", "--frozen_role", "verifier",
                     "--role_base_model", f"refiner={member_dir}", "--role_lora_rank", "refiner=4",
                     "--role_lr", "refiner=3e-3", "--kl_coef", "0.05", "--num_env_steps", str(12 * iterations),
                     *extra)


def test_two_bases_train_together_and_resume_exactly(untrained_policy_dir, smaller_policy_dir, tmp_path,
                                                     length_reward):  # noqa: F811  (the fixture)
    run = Path(run_train_math(chain_with_a_member(untrained_policy_dir, smaller_policy_dir, tmp_path, 2,
                                                  "--save_interval", "1")))
    last = run / "checkpoints" / "iter_2"
    for start, saved in ((untrained_policy_dir, last / "policy"),
                         (smaller_policy_dir, last / "members" / "refiner" / "policy")):
        before, after = load_file(start / "model.safetensors"), load_file(saved / "model.safetensors")
        assert before.keys() <= after.keys()
        assert all(before[name].shape == after[name].shape for name in before)  # each its own base (48 or 128 wide)
        assert any(not torch.equal(before[name], after[name]) for name in before), f"{saved} never moved"
    assert load_file(last / "members/refiner/policy/model.safetensors")["model.norm.weight"].shape == (48,)
    scalars = read_scalars(run)
    for tag in ("grad/norm", "grad/refiner/norm", "loss/policy_loss", "loss/kl_ref", "loss/solver/entropy",
                "loss/refiner/entropy"):
        assert [step for step, _ in scalars[tag]] == [0, 1], (tag, scalars.get(tag))
        assert all(math.isfinite(value) for _, value in scalars[tag]), (tag, scalars[tag])
    assert all(value > 0 for tag in ("grad/norm", "grad/refiner/norm") for _, value in scalars[tag])
    # untrained words: every verdict rejects, so the refiner speaks in every episode; the frozen verifier speaks
    # in every episode too, and is never trained on
    assert [step for step, _ in scalars["train/verifier/reward"]] == [0, 1]
    assert not [tag for tag in scalars if tag.startswith("loss/verifier/")]
    # each model's own lr on one linear schedule, logged after each iteration's step (2 iterations: half, then 0)
    assert [value for _, value in scalars["lr/actor"]] == pytest.approx([5e-4, 0.0])
    assert [value for _, value in scalars["lr/refiner/actor"]] == pytest.approx([1.5e-3, 0.0])
    uninterrupted = tmp_path / "uninterrupted_iter_2"
    shutil.copytree(last, uninterrupted)
    run_train_math(chain_with_a_member(untrained_policy_dir, smaller_policy_dir, tmp_path, 2, "--save_interval", "1",
                                       "--resume", str(run / "checkpoints" / "iter_1")))
    assert_same_training_state(uninterrupted, last)  # every model's weights and moments, bit for bit
