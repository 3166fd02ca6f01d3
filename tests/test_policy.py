"""LanguagePolicy: log-probs from true lengths, LoRA / full fine-tuning, critic, reference, save/load."""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, ViTConfig, ViTModel

from models.generation import HFGenerator
from models import policy as policy_module
from models import packing
from models.loading import ModelDirError, check_model_dir, ensure_pad_token, load_tokenizer
from models.packing import length_buckets, pack
from models.policy import LanguagePolicy, LoraSettings
from models.saving import hf_param_name

LORA = LoraSettings(rank=4, alpha=8.0)
MODES = {"full": None, "lora": LORA}


@pytest.fixture(scope="module")
def policy(untrained_policy_dir):
    return LanguagePolicy(untrained_policy_dir, device="cpu", with_critic=True).eval()


@pytest.fixture(scope="module")
def pairs(policy):
    """Prompts and actions of different lengths that contain the pad id as a real token."""
    pad = policy.tokenizer.pad_token_id
    prompts = [[5, 6, 7, pad], [pad, 9], [10, 11, 12, 13, 14, 15, 16]]
    actions = [[pad, 3], [4, 5, 6, 7, pad], [8]]
    return prompts, actions


def one_step(policy: LanguagePolicy, prompts, actions, lr: float = 1e-2) -> None:
    """One Adam step raising the log-likelihood of ``actions``."""
    optimizer = torch.optim.Adam(policy.actor_parameters(), lr=lr)
    loss = -policy.score_actions(prompts, actions, with_entropy=False).log_probs.sum()
    loss.backward()
    optimizer.step()


def direct_scores(policy: LanguagePolicy, prompt: list[int], action: list[int], temperature: float):
    """Log-probs and entropies of one unpadded sequence from the full [T, V] logits."""
    logits = policy.causal_lm(torch.tensor([prompt + action])).logits[0].float() / temperature
    log_probs = logits.log_softmax(-1)[len(prompt) - 1: len(prompt) - 1 + len(action)]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(1, torch.tensor(action)[:, None]).squeeze(1), entropy


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@torch.no_grad()
def test_batched_scores_equal_direct_unbatched_computation(policy, pairs, padding_side, temperature):
    prompts, actions = pairs
    scores = policy.score_actions(prompts, actions, temperature, padding_side=padding_side, with_values=True)
    assert scores.log_probs.shape == scores.mask.shape == scores.entropy.shape == scores.values.shape == (3, 5)
    assert scores.mask.sum(1).tolist() == [2, 5, 1]
    for row, (prompt, action) in enumerate(zip(prompts, actions)):
        log_probs, entropy = direct_scores(policy, prompt, action, temperature)
        length = len(action)
        torch.testing.assert_close(scores.log_probs[row, :length], log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(scores.entropy[row, :length], entropy, atol=1e-5, rtol=0)
        alone = policy.score_actions([prompt], [action], temperature, with_values=True)
        torch.testing.assert_close(scores.values[row, :length], alone.values[0], atol=1e-5, rtol=0)
        assert scores.log_probs[row, length:].eq(0).all() and scores.values[row, length:].eq(0).all()


def test_padded_tensor_input_equals_list_input(policy, pairs):
    prompts, actions = pairs
    as_tensors = [(torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True,
                                                   padding_value=7), torch.tensor([len(r) for r in rows]))
                  for rows in (prompts, actions)]
    with torch.no_grad():
        torch.testing.assert_close(policy.score_actions(*as_tensors).log_probs,
                                   policy.score_actions(prompts, actions).log_probs)


def test_pack_builds_masks_and_positions_from_lengths():
    batch = pack([[1, 2, 3], [4]], [[5], [6, 7]], pad_id=1, device=torch.device("cpu"), padding_side="left")
    assert batch.input_ids.tolist() == [[1, 2, 3, 5], [1, 4, 6, 7]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]]
    assert batch.read_positions.tolist() == [[2, 3], [1, 2]]
    assert batch.action_mask.tolist() == [[True, False], [True, True]]


def test_values_read_at_last_prompt_token(policy, pairs):
    prompts, actions = pairs
    with torch.no_grad():
        torch.testing.assert_close(policy.values(prompts), policy.token_values(prompts, actions)[:, 0])


@pytest.mark.parametrize("mode", MODES)
def test_one_optimizer_step_changes_outputs_and_not_the_reference(untrained_policy_dir, pairs, mode):
    policy = LanguagePolicy(untrained_policy_dir, device="cpu", lora=MODES[mode])
    prompts, actions = pairs
    with torch.no_grad():
        before = policy.score_actions(prompts, actions).log_probs
        torch.testing.assert_close(policy.ref_log_probs(prompts, actions), before)
    one_step(policy, prompts, actions)
    with torch.no_grad():
        after = policy.score_actions(prompts, actions).log_probs
        reference = policy.ref_log_probs(prompts, actions)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(reference, before)
    assert all(p.requires_grad for p in policy.actor_parameters())


@pytest.mark.parametrize("mode", MODES)
def test_save_load_round_trip_and_plain_transformers_load(untrained_policy_dir, pairs, tmp_path, mode):
    policy = LanguagePolicy(untrained_policy_dir, device="cpu", lora=MODES[mode], with_critic=True)
    prompts, actions = pairs
    one_step(policy, prompts, actions)
    with torch.no_grad():
        policy.value_head.bias.fill_(0.5)
        expected = policy.score_actions(prompts, actions, with_values=True)
        expected_reference = policy.ref_log_probs(prompts, actions)
        sequence = torch.tensor([prompts[2] + actions[2]])
        expected_logits = policy.causal_lm(sequence).logits
    saved = policy.save(tmp_path / "ckpt")
    restored = LanguagePolicy.load(saved, device="cpu")
    with torch.no_grad():
        got = restored.score_actions(prompts, actions, with_values=True)
        torch.testing.assert_close(got.log_probs, expected.log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.values, expected.values, atol=1e-5, rtol=0)
        torch.testing.assert_close(restored.ref_log_probs(prompts, actions), expected_reference, atol=1e-5, rtol=0)
        plain = AutoModelForCausalLM.from_pretrained(saved)
        torch.testing.assert_close(plain(sequence).logits, expected_logits, atol=1e-5, rtol=0)
    assert json.loads((saved / "mathrl_policy.json").read_text())["with_critic"]


def test_named_weights_for_inference_are_plain_hf_names_with_lora_merged(untrained_policy_dir, pairs):
    policy = LanguagePolicy(untrained_policy_dir, device="cpu", lora=LORA, with_critic=True)
    one_step(policy, *pairs)
    weights = dict(policy.named_weights_for_inference())
    plain = AutoModelForCausalLM.from_pretrained(untrained_policy_dir)
    assert set(weights) == set(plain.state_dict())
    merged = policy.model.merge_and_unload()  # peft's own merge, for comparison
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(weights[name], tensor)


def test_hf_param_name_strips_wrappers():
    assert hf_param_name("module._orig_mod.base_model.model.model.layers.0.q_proj.base_layer.weight") == \
        "model.layers.0.q_proj.weight"
    assert hf_param_name("model.layers.1._orig_mod.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("level", ["action", "token"])
@pytest.mark.parametrize("mode", MODES)
def test_critic_fits_fixed_targets_through_the_backbone(untrained_policy_dir, mode, level):
    torch.manual_seed(0)
    policy = LanguagePolicy(untrained_policy_dir, device="cpu", lora=MODES[mode], with_critic=True)
    prompts = [[int(t) for t in torch.randint(3, 200, (int(n),))] for n in torch.randint(3, 9, (8,))]
    actions = [[int(t) for t in torch.randint(3, 200, (4,))] for _ in prompts]
    targets = torch.linspace(-1.0, 1.0, 8)
    groups = policy.param_groups(lr=1e-3, critic_lr=3e-3)
    optimizer = torch.optim.Adam(groups)

    def value_loss() -> torch.Tensor:
        if level == "action":
            return (policy.values(prompts) - targets).pow(2).mean()
        return (policy.token_values(prompts, actions) - targets[:, None]).pow(2).mean()

    losses = []
    for step in range(50):
        optimizer.zero_grad()
        loss = value_loss()
        loss.backward()
        if step == 0:
            head = {id(p) for p in policy.value_head.parameters()}
            trunk = [p for group in groups for p in group["params"] if id(p) not in head]
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trunk), "no gradient reached the trunk"
            if mode == "lora":
                assert all(p.grad is None for p in groups[0]["params"]), "value loss leaked into the actor adapter"
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.parametrize("mode", MODES)
def test_gradient_checkpointing_gives_the_same_gradients(untrained_policy_dir, pairs, mode):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # same LoRA init both times
        policy = LanguagePolicy(untrained_policy_dir, device="cpu", lora=MODES[mode],
                                gradient_checkpointing=checkpointing).train()
        policy.score_actions(*pairs).log_probs.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.actor_parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_shared_prompts_under_gradient_checkpointing_give_the_scores_and_gradients_without_it(untrained_policy_dir,
                                                                                              mode):
    """GRPO-like rows take the shared-prompt pass with activation checkpointing on too (its KV cache
    survives the layers' replay in the backward): the same log-probs, entropies, values and gradients."""
    prompts, actions = grouped_rows(load_tokenizer(untrained_policy_dir).pad_token_id)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # same LoRA and value head init both times
        policy = LanguagePolicy(untrained_policy_dir, device="cpu", lora=MODES[mode], with_critic=True,
                                gradient_checkpointing=checkpointing).train()
        assert isinstance(policy.pack(prompts, actions), packing.SharedPromptBatch)
        results.append(scores_and_grads(policy, prompts, actions))
    assert_same_scores_and_grads(*results)


def test_length_buckets_cut_sorted_rows_where_padding_costs_more_than_a_pass():
    assert length_buckets([40, 41, 39, 40]) == [[0, 1, 2, 3]]  # alike: one pass, rows in the given order
    buckets = length_buckets([1_500, 60, 1_400, 50, 70, 55])  # MATH-like spread: short rows apart from long
    assert buckets[0] == [3, 5, 1, 4] and len(buckets) > 1  # the short rows in one pass, shortest first
    assert [row for bucket in buckets for row in bucket] == [3, 5, 1, 4, 2, 0]  # every row once, by length


def grouped_rows(pad: int) -> tuple[list[list[int]], list[list[int]]]:
    """12 GRPO-like rows: 3 prompts of different lengths (one holding the pad id), 4 actions each."""
    generator = torch.Generator().manual_seed(1)
    distinct = [[5, pad, 7], torch.randint(3, 300, (40,), generator=generator).tolist(), [9, 10, 11, 12, 13]]
    prompts = [distinct[row % 3] for row in range(12)]
    actions = [torch.randint(3, 300, (1 + row % 5,), generator=generator).tolist() for row in range(12)]
    return prompts, actions


def scores_and_grads(policy: LanguagePolicy, prompts, actions):
    """Scores at T=0.7 with values, and the gradients of their sum (then zeroed)."""
    scores = policy.score_actions(prompts, actions, 0.7, with_values=True)
    (scores.log_probs.sum() + scores.entropy.sum() + scores.values.sum()).backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return scores, grads


def assert_same_scores_and_grads(first, second) -> None:
    (scores, grads), (other_scores, other_grads) = first, second
    for name in ("log_probs", "mask", "entropy", "values"):
        torch.testing.assert_close(getattr(scores, name), getattr(other_scores, name), atol=1e-5, rtol=1e-5)
    assert grads.keys() == other_grads.keys() and len(other_grads) > 0
    for name, grad in other_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_length_buckets_give_the_scores_and_gradients_of_one_padded_pass(untrained_policy_dir, monkeypatch, mode):
    """Rows of very different lengths scored in several passes: the same log-probs, entropies, values and
    gradients (up to float rounding) as one pass padding every row to the longest."""
    policy = LanguagePolicy(untrained_policy_dir, device="cpu", lora=MODES[mode], with_critic=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (length,), generator=generator).tolist() for length in (400, 12, 9, 380, 15, 10)]
    actions = [torch.randint(3, 300, (length,), generator=generator).tolist() for length in (5, 9, 1, 7, 3, 8)]
    assert len(length_buckets([len(p) + len(a) for p, a in zip(prompts, actions)])) > 1

    bucketed = scores_and_grads(policy, prompts, actions)
    monkeypatch.setattr(policy_module, "length_buckets", lambda lengths: [list(range(len(lengths)))])
    assert_same_scores_and_grads(bucketed, scores_and_grads(policy, prompts, actions))


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_shared_prompts_give_the_scores_and_gradients_of_packed_rows(untrained_policy_dir, monkeypatch, mode):
    """GRPO-like rows (3 prompts of different lengths, one holding the pad id, 4 actions each): each prompt
    run once with its KV states repeated for its rows gives the log-probs, entropies, values and
    gradients of packing every (prompt, action) row whole."""
    torch.manual_seed(0)
    policy = LanguagePolicy(untrained_policy_dir, device="cpu", lora=MODES[mode], with_critic=True).train()
    prompts, actions = grouped_rows(policy.tokenizer.pad_token_id)
    assert isinstance(policy.pack(prompts, actions), packing.SharedPromptBatch)
    passes = policy._pass_rows(prompts, actions, list(range(12)))  # a prompt's rows never split over passes
    assert sorted(row for rows in passes for row in rows) == list(range(12))
    for group in ({0, 3, 6, 9}, {1, 4, 7, 10}, {2, 5, 8, 11}):
        assert sum(bool(group & set(rows)) for rows in passes) == 1

    shared = scores_and_grads(policy, prompts, actions)
    monkeypatch.setattr(policy_module, "pack_shared", lambda *args: None)
    assert_same_scores_and_grads(shared, scores_and_grads(policy, prompts, actions))


def test_bad_inputs_fail_clearly(untrained_policy_dir, tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        LanguagePolicy(tmp_path / "missing", device="cpu")
    ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
             ).save_pretrained(tmp_path)
    shutil.copy(untrained_policy_dir / "tokenizer.json", tmp_path)
    with pytest.raises(ValueError, match="causal language model"):
        LanguagePolicy(tmp_path, device="cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LanguagePolicy(untrained_policy_dir, device="cpu", dtype="float16")
    with pytest.raises(ValueError, match="not one of"):
        LanguagePolicy(untrained_policy_dir, device="cpu", dtype="fp8")
    with pytest.raises(FileNotFoundError, match="not a LanguagePolicy.save"):
        LanguagePolicy.load(untrained_policy_dir, device="cpu")


def test_missing_pad_token_becomes_eos_with_a_warning(untrained_policy_dir, caplog):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(untrained_policy_dir)
    tokenizer.pad_token = None
    with caplog.at_level(logging.WARNING, logger="models.loading"):
        ensure_pad_token(tokenizer, "test")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    assert "no pad token" in caplog.text


def copy_without(source, target, *names):
    """``target``: a copy of the model directory ``source`` without the files ``names``."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*names))
    return target


def test_model_dir_check_names_the_role_the_directory_what_is_missing_and_the_fix(untrained_policy_dir, tmp_path):
    check_model_dir(untrained_policy_dir, "--model_name_or_path")  # a complete directory passes
    no_tokenizer = copy_without(untrained_policy_dir, tmp_path / "no_tokenizer", "tokenizer*")
    with pytest.raises(ModelDirError) as error:
        check_model_dir(no_tokenizer, "--model_name_or_path")
    message = str(error.value)
    assert message.startswith(f"--model_name_or_path={str(no_tokenizer)!r} has no tokenizer (") and "\n" not in message
    assert "no config.json" not in message and "no weights" not in message and "save_pretrained" in message
    for removed, missing in [("config.json", "no config.json"), ("model.safetensors", "no weights (model.safetensors")]:
        with pytest.raises(ModelDirError, match=re.escape(missing)):
            check_model_dir(copy_without(untrained_policy_dir, tmp_path / removed, removed), "--model_name_or_path")
    # tokenizer_config.json alone is no tokenizer; with a vocabulary file (slow tokenizers' layout) it is
    config_only = copy_without(untrained_policy_dir, tmp_path / "config_only", "tokenizer.json")
    with pytest.raises(ModelDirError, match="no tokenizer"):
        check_model_dir(config_only, "--model_name_or_path")
    (config_only / "vocab.json").write_text("{}")
    check_model_dir(config_only, "--model_name_or_path")


def test_checkpoint_directory_is_refused_with_its_policy_subfolder_as_the_fix(untrained_policy_dir, tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_3"
    shutil.copytree(untrained_policy_dir, checkpoint / "policy")
    (checkpoint / "manifest.json").write_text("{}")
    fix = f"this is a checkpoint directory; pass its policy/ subfolder ({str(checkpoint / 'policy')!r})"
    with pytest.raises(ModelDirError, match=re.escape(f"--model_name_or_path={str(checkpoint)!r} has no config.json")):
        check_model_dir(checkpoint, "--model_name_or_path")
    # the Python API gives the same line, naming its own argument, before transformers is asked
    for load in (lambda: LanguagePolicy(checkpoint, device="cpu"), lambda: load_tokenizer(checkpoint)):
        with pytest.raises(ModelDirError, match=re.escape(f"model_dir={str(checkpoint)!r}")) as error:
            load()
        assert str(error.value).endswith(fix)
    with pytest.raises(ModelDirError, match="this is a run directory; pass its best/ subfolder"):
        check_model_dir(tmp_path / "run", "--model_name_or_path")
    check_model_dir(checkpoint / "policy", "--model_name_or_path")


def test_kv_cache_goes_by_the_keyword_transformers_expects(policy):
    # transformers 5.24 renamed past_key_values to cache and warns on every forward given the old name
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        output = HFGenerator(policy).generate(["Compute 12 + 35."], n=2, max_new_tokens=6, seed=0)
    assert len(output.texts) == 2


def sharded_start(policy_dir: str, out_dir: str) -> None:
    """One torchrun rank of ``test_fsdp_ranks_start_from_rank_0s_weights``: builds the policy with weights from
    rank 0, shards it, and saves what it holds then (whole weights, buffers, scores) to ``out_dir``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())  # a value head initialised apart on each rank: rank 0's must win
    policy = LanguagePolicy(policy_dir, device="cpu", with_critic=True, weights_from_rank0=True)
    on_meta = all(param.is_meta for param in policy.parameters())
    policy.fully_shard(init_device_mesh("cpu", (2,)))
    prompts, actions = grouped_rows(policy.tokenizer.pad_token_id)
    with torch.no_grad():
        log_probs = policy(prompts[:3], actions[:3]).log_probs  # the call runs FSDP2's gathering hooks
    torch.save({"on_meta": on_meta, "whole": policy.whole_state_dict(), "log_probs": log_probs,
                "buffers": dict(policy.named_buffers())}, f"{out_dir}/rank_{dist.get_rank()}.pt")
    dist.destroy_process_group()


def test_fsdp_ranks_start_from_rank_0s_weights(untrained_policy_dir, tmp_path):
    """2 gloo ranks: rank 1 builds on the meta device (reads no weights) and receives its shards and buffers
    from rank 0; both then hold the weights, value head and scores of a policy loaded in one process."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])  # this checkout's packages, not an installed copy
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, str(untrained_policy_dir), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank_{rank}.pt") for rank in range(2)]
    assert [rank["on_meta"] for rank in ranks] == [False, True]
    plain = LanguagePolicy(untrained_policy_dir, device="cpu")
    expected = {f"model.{name}": tensor for name, tensor in plain.causal_lm.state_dict().items()}
    with torch.no_grad():
        first_rows = [rows[:3] for rows in grouped_rows(plain.tokenizer.pad_token_id)]
        expected_log_probs = plain.score_actions(*first_rows).log_probs
    for rank in ranks:
        assert rank["whole"].keys() == expected.keys() | {"value_head.weight", "value_head.bias"}
        for name, tensor in expected.items():
            assert torch.equal(rank["whole"][name], tensor), name
        for name, buffer in plain.named_buffers():
            assert torch.equal(rank["buffers"][name], buffer), name
        torch.testing.assert_close(rank["log_probs"], expected_log_probs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rank["whole"]["value_head.weight"], ranks[0]["whole"]["value_head.weight"],
                                   atol=0, rtol=0)


if __name__ == "__main__":  # a rank of test_fsdp_ranks_start_from_rank_0s_weights, under torchrun
    import sys

    sharded_start(*sys.argv[1:])

