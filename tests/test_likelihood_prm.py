"""The closed-form likelihood PRM (models/tiny/likelihood_prm.py) on a small random trunk: it keeps the
trunk's computation, copies the previous position's logits, flags exactly the tokens whose margin
``running_max_margin`` says, survives save/load, the KV cache, bf16 and fp16, and fits its readout."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from envs.datasets import Arith
from envs.prompts import format_prompt, shepherd_text
from reward_models.prm import ProcessRewardModel
from models.tiny import likelihood_prm
from models.tiny.data import PRM_ANCHOR, corrupt_solution, departure_tokens, label_token_ids, prm_batch
from models.tiny.model import new_model

PROBLEMS = Arith().problems(48, seed=11)


@pytest.fixture(scope="module")
def trunk(tiny_tokenizer):
    """A random tiny Llama whose logits are spread like a trained one's (embeddings x 30), so
    margins of several logits occur."""
    model = new_model(tiny_tokenizer, seed=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=128)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30)
    return model.eval()


@pytest.fixture(scope="module")
def corrupted(tiny_tokenizer):
    """ids [B, L], tag_mask [B, L], tag labels [S] and the steps of corrupted Arith solutions."""
    rng = np.random.default_rng(0)
    solutions, labels = zip(*(corrupt_solution(p, rng, clean_fraction=0.3) for p in PROBLEMS))
    ids, tag_mask, tag_labels, _ = prm_batch(tiny_tokenizer, PROBLEMS, list(solutions), list(labels))
    return ids, tag_mask, tag_labels, list(solutions)


@pytest.fixture(scope="module")
def checked(tiny_tokenizer):
    return departure_tokens(tiny_tokenizer, Arith().problems(400, seed=1), np.random.default_rng(1))


@pytest.fixture(scope="module")
def built(trunk, tiny_tokenizer, corrupted, checked):
    """(PRM, running max margins [B, L], margin) at a margin that flags about half of the solutions."""
    ids = corrupted[0]
    anchor = tiny_tokenizer.convert_tokens_to_ids(PRM_ANCHOR)
    with torch.no_grad():
        margins = likelihood_prm.running_max_margin(trunk(input_ids=ids).logits, ids, checked, anchor)
    margin = float(margins[:, -1].median())
    good, bad = label_token_ids(tiny_tokenizer).tolist()
    return likelihood_prm.build_likelihood_prm(trunk, checked, anchor, good, bad, margin), margins, margin


def test_checked_tokens_are_where_corruptions_depart(tiny_tokenizer, checked):
    tokens = set(tiny_tokenizer.convert_ids_to_tokens(checked))
    assert {str(d) for d in range(10)} <= tokens and {f"Ġ{d}" for d in range(1, 10)} <= tokens
    assert not tokens & {"ки", "The", "Ġanswer"}


def test_trunk_runs_unchanged_and_previous_logits_are_copied(trunk, corrupted, checked, built):
    prm, *_ = built
    layout = likelihood_prm.layout_of(prm)
    ids = corrupted[0]
    with torch.no_grad():
        trunk_out = trunk(input_ids=ids, output_hidden_states=True)
        prm_out = prm(input_ids=ids, output_hidden_states=True)
    for layer in range(1, trunk.config.num_hidden_layers):
        torch.testing.assert_close(prm_out.hidden_states[layer][..., : layout.trunk_size],
                                   trunk_out.hidden_states[layer], rtol=1e-4, atol=1e-4)
    copied = prm_out.hidden_states[trunk.config.num_hidden_layers + 1][:, 1:, layout.logits]
    torch.testing.assert_close(copied, trunk_out.logits[:, :-1, checked], rtol=1e-3, atol=1e-3)


def test_previous_token_head_attends_to_the_previous_position_only(trunk, tiny_tokenizer, built):
    prm, *_ = built
    prm.set_attn_implementation("eager")
    text = shepherd_text(format_prompt(PROBLEMS[0].problem), [p.solution for p in PROBLEMS[:10]])
    ids = torch.tensor([tiny_tokenizer(text)["input_ids"]])
    assert ids.shape[1] > 300
    with torch.no_grad():
        attention = prm(input_ids=ids, output_attentions=True).attentions[trunk.config.num_hidden_layers][0, 0]
    prm.set_attn_implementation("sdpa")
    assert attention.diagonal(-1).min() > 1 - 1e-6


def test_flags_follow_the_running_max_margin(tiny_tokenizer, corrupted, built):
    prm, margins, margin = built
    ids, tag_mask, *_ = corrupted
    one, verdict = likelihood_prm.readout_features(prm, ids)[tag_mask].unbind(-1)
    reference = margins[tag_mask]
    clear = (reference - margin).abs() > 0.05  # within 0.05 logits of the margin the flag is faint
    assert clear.float().mean() > 0.8
    assert (reference[clear] > margin).float().mean().item() == pytest.approx(0.5, abs=0.2)
    flagged = verdict / one > 1e-3
    assert torch.equal(flagged[clear], reference[clear] > margin)


def test_save_load_kv_cache_and_half_precision_give_the_same_scores(tmp_path, tiny_tokenizer, corrupted, built):
    prm, margins, margin = built
    ids, tag_mask, _, steps = corrupted
    good, bad = label_token_ids(tiny_tokenizer).tolist()
    likelihood_prm.set_readout(prm, good, bad, 40.0, -40.0 / likelihood_prm.MIN_THRESHOLD)
    prm.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    assert likelihood_prm.layout_of(AutoModelForCausalLM.from_pretrained(tmp_path)) == likelihood_prm.layout_of(prm)
    problems = [p.problem for p in PROBLEMS]
    full = np.concatenate(ProcessRewardModel(tmp_path, device="cpu", kv_cache_mb=0).step_scores(problems, steps))
    cached_prm = ProcessRewardModel(tmp_path, device="cpu", kv_cache_mb=16)
    for k in range(1, 5):  # the env scores one more step per call; the cache runs only the new one
        cached = cached_prm.step_scores(problems, [s[:k] for s in steps])
        full_per_problem = np.split(full, np.cumsum([len(s) for s in steps])[:-1])
        np.testing.assert_allclose(np.concatenate(cached), np.concatenate([f[:k] for f in full_per_problem]), atol=1e-4)
    reference = margins[tag_mask].numpy()
    clear = np.abs(reference - margin) > 0.3  # bf16 logits are off by up to ~0.1 here
    assert np.array_equal(full[clear] > 0.5, reference[clear] <= margin) and clear.mean() > 0.7
    for dtype in ("bfloat16", "float16"):
        half_prm = ProcessRewardModel(tmp_path, device="cpu", dtype=dtype, kv_cache_mb=0)
        half = np.concatenate(half_prm.step_scores(problems, steps))
        assert np.array_equal(half[clear] > 0.5, full[clear] > 0.5), dtype


def test_fit_readout_threshold_and_calibration():
    rng = np.random.default_rng(0)
    one = torch.tensor(rng.uniform(0.05, 0.1, 1000))
    flagged = torch.tensor(rng.random(1000) < 0.4)
    faint = ~flagged & torch.tensor(rng.random(1000) < 0.05)  # bad steps a hair over the margin
    verdict = torch.where(flagged, one * torch.tensor(rng.uniform(0.5, 10, 1000)), one * torch.where(faint, 1e-5, 1e-7))
    good = torch.where(flagged, torch.tensor(rng.random(1000) < 0.05), torch.tensor(rng.random(1000) < 0.9)) & ~faint
    one_weight, verdict_weight = likelihood_prm.fit_readout(torch.stack([one, verdict], -1), good.long())
    threshold = -one_weight / verdict_weight
    # between the unflagged and the flagged verdicts, but not between the faint ones and 0: a
    # threshold of 1e-6 would be more accurate here, and overflow float16 in the LM head
    assert likelihood_prm.MIN_THRESHOLD <= threshold < 0.5
    assert abs(verdict_weight) < torch.finfo(torch.float16).max / 10
    p_good = torch.sigmoid(one_weight * one + verdict_weight * verdict)
    assert p_good[~flagged].mean().item() == pytest.approx(good[~flagged].double().mean().item(), abs=0.02)
    assert p_good[flagged].max() < 0.5


def test_untied_or_biased_trunks_and_too_many_checked_tokens_are_refused(trunk, tiny_tokenizer):
    config = LlamaConfig(**{**trunk.config.to_dict(), "tie_word_embeddings": False, "attention_bias": True})
    with pytest.raises(ValueError, match=r"untied embeddings .*, biases in the trunk"):
        likelihood_prm.build_likelihood_prm(LlamaForCausalLM(config), [1, 2], 3, 4, 5, 2.0)
    with pytest.raises(ValueError, match="at most 32 distinct checked tokens"):
        likelihood_prm.build_likelihood_prm(trunk, list(range(40)), 3, 4, 5, 2.0)
    with pytest.raises(ValueError, match="not made by build_likelihood_prm"):
        likelihood_prm.layout_of(trunk)
