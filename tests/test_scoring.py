"""Chunked token scoring equals the plain [B, L, V] computation: log-probs, entropies and gradients, through the
closed-form backward of a bias-free Linear head and through the checkpointed autograd of any other head."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from models import scoring
from models.scoring import chunk_rows, token_scores

QWEN_VOCAB = 151_936


def plain_scores(lm_head: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies from the whole [B, L, V] float32 log-softmax."""
    log_probs = (lm_head(hidden).float() / temperature).log_softmax(-1)
    chosen = log_probs.gather(-1, ids[..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return torch.where(mask, chosen, 0.0), torch.where(mask, entropy, 0.0)


def scores_and_grads(score, lm_head: torch.nn.Module, hidden: torch.Tensor, weights: torch.Tensor):
    """(log-probs, entropies, d/d hidden, d/d lm_head weight) of a weighted sum of both scores (an entropy weight
    of 0 is the loss without an entropy bonus)."""
    hidden = hidden.detach().requires_grad_(True)
    lm_head.zero_grad(set_to_none=True)
    log_probs, entropy = score(hidden)
    ((log_probs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return log_probs.detach(), entropy.detach(), hidden.grad, lm_head.weight.grad.clone()


def assert_parity(lm_head: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                  rows_per_chunk: int | None, temperature: float = 0.7, entropy_weight: float = 1.0) -> None:
    weights = torch.randn((2, *ids.shape), generator=torch.Generator().manual_seed(2))
    weights[1] *= entropy_weight

    def chunked(h):
        scores = token_scores(lm_head, h, ids, mask, temperature, True, rows_per_chunk=rows_per_chunk)
        return scores.log_probs, scores.entropy

    expected = scores_and_grads(lambda h: plain_scores(lm_head, h, ids, mask, temperature), lm_head, hidden, weights)
    got = scores_and_grads(chunked, lm_head, hidden, weights)
    for name, want, have in zip(("log_probs", "entropy", "grad hidden", "grad lm_head"), expected, got):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5, msg=name)
    assert bool((got[0][~mask] == 0).all() and (got[2][~mask] == 0).all())


def ragged_batch(vocab: int, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` token ids and a mask of right-padded rows of different lengths (one of them empty)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, shape, generator=generator)
    lengths = torch.linspace(0, shape[1], shape[0]).long()
    return ids, torch.arange(shape[1])[None] < lengths[:, None]


@pytest.mark.parametrize("kept_log_probs", [scoring.KEPT_LOG_PROBS_ELEMENTS, 0])
@pytest.mark.parametrize("entropy_weight", [1.0, 0.0])
@pytest.mark.parametrize("rows_per_chunk", [None, 3])
def test_tiny_policy_scores_and_gradients_equal_the_plain_computation(untrained_policy_dir, rows_per_chunk,
                                                                      entropy_weight, kept_log_probs, monkeypatch):
    """The closed-form backward from the log-probs its forward kept, and (none kept) from recomputed logits."""
    monkeypatch.setattr(scoring, "KEPT_LOG_PROBS_ELEMENTS", kept_log_probs)
    model = AutoModelForCausalLM.from_pretrained(untrained_policy_dir, dtype=torch.float32)
    ids, mask = ragged_batch(model.config.vocab_size, (4, 9), seed=0)
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state.detach()
    assert chunk_rows(model.config.vocab_size) > int(mask.sum())  # default: one chunk
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)  # the closed-form backward
    assert_parity(model.get_output_embeddings(), hidden, ids, mask, rows_per_chunk, entropy_weight=entropy_weight)


@pytest.mark.parametrize("entropy_weight", [1.0, 0.0])
def test_a_head_with_a_bias_scores_through_autograd_and_equals_the_plain_computation(entropy_weight):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)  # not a bias-free Linear: the checkpointed path
    ids, mask = ragged_batch(50, (3, 7), seed=4)
    assert_parity(head, torch.randn(3, 7, 16), ids, mask, rows_per_chunk=4, entropy_weight=entropy_weight)


def test_under_bfloat16_autocast_scores_and_gradients_match_autograd_in_the_same_dtype():
    """The closed-form backward runs its matmuls in the forward's autocast dtype, as autograd does: log-probs,
    entropies and the hidden states' gradient agree to float32 (in float32 matmuls the latter would be off by
    about 4e-3 here), the head's gradient to bfloat16's rounding (autograd rounds the one matmul's result to
    bfloat16, the closed form sums its chunks' products in float32)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=False)
    ids, mask = ragged_batch(300, (4, 10), seed=5)
    hidden, weights = torch.randn(4, 10, 32), torch.randn(2, 4, 10)
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)

    def via_autograd(h):
        with autocast():
            logits = head(h)
        return plain_scores(lambda _: logits, h, ids, mask, 0.5)

    def closed_form(h):
        scores = token_scores(head, h, ids, mask, 0.5, True, autocast, rows_per_chunk=7)
        return scores.log_probs, scores.entropy

    expected = scores_and_grads(via_autograd, head, hidden, weights)
    got = scores_and_grads(closed_form, head, hidden, weights)
    for name, want, have in zip(("log_probs", "entropy", "grad hidden"), expected, got):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(got[3], expected[3], atol=5e-2, rtol=2e-2, msg="grad lm_head")


def test_large_vocabulary_qwen2_scores_and_gradients_equal_the_plain_computation():
    """A random-init Qwen2 at the real vocabulary: the default chunking splits these rows in several chunks."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids, mask = ragged_batch(QWEN_VOCAB, (3, 160), seed=1)
    assert int(mask.sum()) > 2 * chunk_rows(QWEN_VOCAB)
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state.detach()
    assert_parity(model.get_output_embeddings(), hidden, ids, mask, rows_per_chunk=None)


def test_without_gradients_nothing_is_recomputed_and_scores_match(untrained_policy_dir):
    model = AutoModelForCausalLM.from_pretrained(untrained_policy_dir, dtype=torch.float32)
    ids, mask = ragged_batch(model.config.vocab_size, (3, 6), seed=3)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        scores = token_scores(model.get_output_embeddings(), hidden, ids, mask, 1.0, False, rows_per_chunk=2)
        expected, _ = plain_scores(model.get_output_embeddings(), hidden, ids, mask, 1.0)
    assert scores.entropy is None and scores.log_probs.grad_fn is None
    torch.testing.assert_close(scores.log_probs, expected, atol=1e-5, rtol=1e-5)


def test_temperature_must_be_positive():
    head = torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match="temperature=0"):
        token_scores(head, torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long),
                     torch.ones(1, 1, dtype=torch.bool), 0, False)
