"""A Math-Shepherd PRM that reads a causal LM's own next-token likelihood, built in closed form.

A step is wrong as soon as one of its tokens is not what a good solver would write there, so a
solver's next-token logits already hold a process reward: the "margin" at a token, max over the
checked tokens of the logit minus the logit of the token actually written. Gradient descent finds
that readout only slowly, because the comparison it needs, "is the token at t the one predicted at
t-1", must be computed at t from the previous position's final state. So ``build_likelihood_prm``
writes those layers down:

    residual [0, d)            the trunk, unchanged (its weights zero-padded into a wider model)
    code     [n one-hot]       which checked token sits here          (from the embedding)
    one      [1]               1 at every token                       (from the embedding)
    anchor   [1]               1 at the anchor token ("Solution")     (from the embedding)
    logits   [n]               the trunk's logits at t-1 over the checked tokens   (layer "check", head 0)
    region   [1]               > 0 after the anchor: solution text    (layer "check", head 1)
    flag     [1]               > 0 where max_k logit_k - logit_x > margin   (layer "check", MLP)
    verdict  [1]               about the largest flag so far          (layer "remember", head 0)

and the "+" row of the LM head reads ``w_one * one + w_verdict * verdict`` ("-" reads nothing;
w_verdict < 0), so P("+") at a step tag falls once any token since the anchor broke the margin: Math-Shepherd's label
("a step is good if it and every step before it are"). ``fit_readout`` fits the two weights on
labelled steps. The result is an ordinary ``LlamaForCausalLM`` directory (``attention_bias``
on, untied LM head): ``from_pretrained``, the KV cache and bf16/fp16 work as for any Llama.

Every feature after an RMSNorm is divided by that position's RMS, so each test below compares
features that share the divisor (the "one" feature carries the thresholds), and the embedding's
scratch features are scaled by ``CODE_SCALE`` so that the trunk's norms change by < 1e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CODE_SCALE = 1e-3
"""Size of the embedding's scratch features: the trunk's RMSNorms see them as a relative change
of about CODE_SCALE**2 / (mean square of the trunk's embedding), far below float32's resolution."""

ATTENTION_MARGIN = 25.0
"""Attention logits (nats) by which the previous-token head prefers position t-1 over every other
position up to ``max_position_embeddings``: the rest share at most 2048 * e^-25 = 3e-8 of its weight."""

ANCHOR_SCORE = 500.0
"""Attention logit of the anchor token times the RMS of the anchor's residual: with that RMS in the
single digits, as on the tiny target, the anchor wins by tens of nats over every other position."""

GATE_SHARPNESS = 100.0
"""Gate units per logit of margin, before the check MLP's RMSNorm (whose RMS is in the single
digits): a token a tenth of a logit past the margin opens its gate by a few units, where SiLU is
close to ReLU."""

FLAG_GAIN = 40.0
REMEMBER_SHARPNESS = 300.0
"""Attention logit per unit of normalised flag in the "remember" head: the largest flag outweighs
every unflagged position by tens of nats, so the verdict is close to the largest flag so far."""

MIN_THRESHOLD = 1e-2
"""Smallest threshold ``fit_readout`` may pick on verdict / one (flag units). A smaller one would
sit among faint flags that are rounding, not evidence, and its readout weight
-one_weight / threshold could leave float16's range and score every step 0 in half precision."""

ROPE_DECAY = 0.7
"""Weight ratio of successive RoPE frequencies in the previous-token head: the high frequencies
tell t-1 from its neighbours, the low ones keep far positions apart (min gap 0.16 of the peak over
4096 positions at theta 1e4, head size 32)."""


@dataclass(frozen=True)
class Layout:
    """Where each scratch feature lives in the PRM's residual stream (indices into the hidden size)."""

    trunk_size: int
    num_checked: int

    @property
    def code(self) -> slice:
        return slice(self.trunk_size, self.trunk_size + self.num_checked)

    @property
    def one(self) -> int:
        return self.trunk_size + self.num_checked

    @property
    def anchor(self) -> int:
        return self.one + 1

    @property
    def logits(self) -> slice:
        return slice(self.anchor + 1, self.anchor + 1 + self.num_checked)

    @property
    def region(self) -> int:
        return self.logits.stop

    @property
    def flag(self) -> int:
        return self.region + 1

    @property
    def verdict(self) -> int:
        return self.flag + 1


def previous_token_biases(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key biases [head_dim] of a head that attends to position t-1 under RoPE.

    With q and k constant, the logit for a key ``delta`` positions back is
    ``sum_i w_i cos(inv_freq_i (delta - 1))``: it peaks at delta 1. The weights decay by
    ``ROPE_DECAY`` per frequency and are scaled so the peak beats every other delta < max_positions
    by ``ATTENTION_MARGIN``. Raises if the frequencies cannot separate t-1 (e.g. a huge rope theta).
    """
    weights = ROPE_DECAY ** torch.arange(len(inv_freq), dtype=torch.float64)
    deltas = torch.arange(max_positions, dtype=torch.float64)
    deltas = deltas[deltas != 1]
    gaps = (1 - torch.cos(torch.outer(deltas - 1, inv_freq.double()))) @ weights
    if gaps.min() < 1e-3 * weights.sum():
        raise ValueError(f"RoPE frequencies {inv_freq.tolist()} cannot single out the previous position within "
                         f"{max_positions} positions (min logit gap {gaps.min():.2e})")
    head_dim = 2 * len(inv_freq)
    radii = (weights * ATTENTION_MARGIN / gaps.min() * math.sqrt(head_dim)).sqrt().float()
    key = torch.cat([radii, torch.zeros_like(radii)])
    # the query is the key rotated back by one position, so q . R(delta) k peaks at delta = 1
    query = torch.cat([radii * torch.cos(inv_freq), -radii * torch.sin(inv_freq)])
    return query, key


def _check_trunk(trunk: LlamaForCausalLM) -> None:
    config = trunk.config
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    problems = []
    if config.model_type != "llama":
        problems.append(f"model_type {config.model_type!r} (need 'llama')")
    if not config.tie_word_embeddings:
        problems.append("untied embeddings (the logits must be the embedding times the final state)")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope scaling {rope}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("biases in the trunk")
    if config.num_key_value_heads != config.num_attention_heads:
        problems.append(f"grouped key/value heads ({config.num_key_value_heads} for {config.num_attention_heads})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        problems.append(f"head_dim {head_dim} x {config.num_attention_heads} heads != hidden size {config.hidden_size}")
    if problems:
        raise ValueError("build_likelihood_prm needs a plain tied-embedding Llama trunk; this one has "
                         f"{', '.join(problems)}")


def build_likelihood_prm(trunk: LlamaForCausalLM, checked_ids: list[int], anchor_id: int, good_id: int,
                         bad_id: int, margin: float) -> LlamaForCausalLM:
    """The PRM described in the module docstring, on ``trunk`` (a tied-embedding Llama).

    checked_ids: the n tokens at which a wrong solution can first depart from a right one (digits,
      signs, the space before a step tag...); a token outside them is never flagged.
    anchor_id: the token after which text is checked (prompt tokens are unpredictable).
    good_id, bad_id: Math-Shepherd's "+" and "-".
    margin: logits by which another checked token may beat the written one before it is flagged.

    The readout weights start at (1, -1); ``fit_readout`` fits them. The model is on the CPU in fp32.
    """
    _check_trunk(trunk)
    config = trunk.config
    trunk_size, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    layout = Layout(trunk_size, len(checked_ids))
    if len(checked_ids) > head_dim or len(set(checked_ids)) != len(checked_ids):
        raise ValueError(f"need at most {head_dim} distinct checked tokens (one head copies their logits), got "
                         f"{len(checked_ids)} ({len(set(checked_ids))} distinct)")
    pairs = [(i, k) for i in range(len(checked_ids)) for k in range(len(checked_ids)) if i != k]
    prm_config = _prm_config(config, layout, len(pairs))
    weights = {name: torch.zeros_like(value) for name, value in LlamaForCausalLM(prm_config).state_dict().items()}
    trunk_weights = {name: value.detach().float() for name, value in trunk.state_dict().items()}
    _pad_trunk(weights, trunk_weights, trunk_size, prm_config.hidden_size)
    _write_embedding_codes(weights["model.embed_tokens.weight"], layout, checked_ids, anchor_id)
    check, remember = (f"model.layers.{config.num_hidden_layers + k}." for k in (0, 1))
    _write_check_heads(weights, check, layout, trunk_weights, checked_ids, config, prm_config.hidden_size)
    _write_flag_mlp(weights, check, layout, pairs, trunk_weights["model.embed_tokens.weight"], checked_ids,
                    trunk_weights["model.norm.weight"], margin)
    _write_remember_head(weights, remember, layout, head_dim)
    # the readout: the final norm passes one and verdict, and only the "+" row of the LM head reads
    # them (a PRM is read at its labels; every other token gets logit 0)
    weights["model.norm.weight"][layout.one] = 1 / CODE_SCALE
    weights["model.norm.weight"][layout.verdict] = 1.0
    model = LlamaForCausalLM(prm_config)
    model.load_state_dict(weights)
    set_readout(model, good_id, bad_id, 1.0, -1.0)
    model.generation_config = trunk.generation_config
    return model


def _prm_config(config: LlamaConfig, layout: Layout, num_pairs: int) -> LlamaConfig:
    """The trunk's config widened by whole heads to hold the scratch features, with one flag-MLP unit
    per ordered pair of checked tokens, two more layers, attention biases and an untied LM head."""
    head_dim = config.hidden_size // config.num_attention_heads
    hidden = layout.trunk_size + math.ceil((layout.verdict + 1 - layout.trunk_size) / head_dim) * head_dim
    intermediate = max(config.intermediate_size, math.ceil(num_pairs / head_dim) * head_dim)
    return LlamaConfig(**{
        **config.to_dict(), "hidden_size": hidden, "num_attention_heads": hidden // head_dim,
        "num_key_value_heads": hidden // head_dim, "head_dim": head_dim, "intermediate_size": intermediate,
        "num_hidden_layers": config.num_hidden_layers + 2, "attention_bias": True, "tie_word_embeddings": False,
        "architectures": ["LlamaForCausalLM"],
        "likelihood_prm": {"trunk_size": layout.trunk_size, "num_checked": layout.num_checked}})


def _slowest_rope_pair(head_dim: int) -> int:
    """Index of the slowest RoPE pair: a bias there gives a nearly position-free attention logit."""
    return head_dim // 2 - 1


def _write_check_heads(weights: dict, prefix: str, layout: Layout, trunk_weights: dict, checked_ids: list[int],
                       config: LlamaConfig, hidden: int) -> None:
    """The "check" layer's two heads. Head 0 attends to t-1 and copies the trunk's logits there over
    the checked tokens into ``logits``; the norm's trunk part is the trunk's final norm, so the
    values are exactly those logits. Head 1 attends to the anchor (if one came before) and copies its
    anchor code into ``region``."""
    trunk_size, head_dim = layout.trunk_size, config.hidden_size // config.num_attention_heads
    norm, q_bias, k_bias, k_proj, v_proj, o_proj = (weights[prefix + name] for name in (
        "input_layernorm.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight"))
    inv_freq = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    norm[:trunk_size] = trunk_weights["model.norm.weight"] * math.sqrt(trunk_size / hidden)
    q_bias[:head_dim], k_bias[:head_dim] = previous_token_biases(inv_freq, config.max_position_embeddings)
    v_proj[: len(checked_ids), :trunk_size] = trunk_weights["model.embed_tokens.weight"][checked_ids]
    o_proj[layout.logits, : len(checked_ids)] = torch.eye(len(checked_ids))
    lowest = _slowest_rope_pair(head_dim)
    norm[layout.anchor] = 1 / CODE_SCALE
    q_bias[head_dim + lowest] = 1.0
    k_proj[head_dim + lowest, layout.anchor] = ANCHOR_SCORE * math.sqrt(head_dim)
    v_proj[head_dim, layout.anchor] = 1.0
    o_proj[layout.region, head_dim] = 1.0


def _write_remember_head(weights: dict, prefix: str, layout: Layout, head_dim: int) -> None:
    """The "remember" layer's head 0: attention logits proportional to the flag, value the flag, so
    ``verdict`` is about the largest flag so far."""
    lowest = _slowest_rope_pair(head_dim)
    weights[prefix + "input_layernorm.weight"][layout.flag] = 1.0
    weights[prefix + "self_attn.q_proj.bias"][lowest] = 1.0
    weights[prefix + "self_attn.k_proj.weight"][lowest, layout.flag] = REMEMBER_SHARPNESS * math.sqrt(head_dim)
    weights[prefix + "self_attn.v_proj.weight"][0, layout.flag] = 1.0
    weights[prefix + "self_attn.o_proj.weight"][layout.verdict, 0] = 1.0


def _pad_trunk(weights: dict, trunk_weights: dict, trunk_size: int, hidden: int) -> None:
    """The trunk's weights in the top-left corner of the wider ones. The scratch features are
    ~0 while the trunk runs, so each RMSNorm's mean square is the trunk's times trunk_size / hidden:
    the gains are scaled by sqrt(trunk_size / hidden) to give the trunk's exact normalised states."""
    for name, value in trunk_weights.items():
        if name == "lm_head.weight":  # tied: the embedding
            continue
        if name == "model.norm.weight":  # the readout's norm; its trunk part is not read
            continue
        target = weights[name]
        if name.endswith("layernorm.weight"):
            target[:trunk_size] = value * math.sqrt(trunk_size / hidden)
        else:
            target[tuple(slice(0, size) for size in value.shape)] = value


def _write_embedding_codes(embedding: torch.Tensor, layout: Layout, checked_ids: list[int], anchor_id: int) -> None:
    embedding[checked_ids, torch.arange(layout.code.start, layout.code.stop)] = CODE_SCALE
    embedding[:, layout.one] = CODE_SCALE
    embedding[anchor_id, layout.anchor] = CODE_SCALE


def _write_flag_mlp(weights: dict, prefix: str, layout: Layout, pairs: list[tuple[int, int]], embedding: torch.Tensor,
                    checked_ids: list[int], final_norm: torch.Tensor, margin: float) -> None:
    """One SwiGLU unit per ordered pair (i, k) of checked tokens:

        flag += FLAG_GAIN * silu(a * (logit_k - logit_i - margin) + off * ([token = i] - 1)) * region

    Only the written token's n-1 units can open, and one opens when a checked token beats it by
    more than ``margin``; ``region`` (0 in the prompt) multiplies them all. All four inputs sit
    after the same RMSNorm (code and one scaled back up by 1 / CODE_SCALE), so the test is the
    same at any residual scale. ``off`` exceeds ``a`` times any gap between two checked tokens'
    logits (``_max_logit_gap``), so a closed gate stays shut; it stays within float16's range."""
    norm = weights[prefix + "post_attention_layernorm.weight"]
    norm[layout.code] = 1 / CODE_SCALE
    norm[layout.one] = 1 / CODE_SCALE
    norm[layout.logits] = 1.0
    norm[layout.region] = 1.0
    gate, up, down = (weights[prefix + f"mlp.{name}_proj.weight"] for name in ("gate", "up", "down"))
    logits, code = layout.logits.start, layout.code.start
    a = GATE_SHARPNESS
    off = a * (_max_logit_gap(embedding[checked_ids], final_norm) + margin + 10.0)
    for unit, (i, k) in enumerate(pairs):
        gate[unit, logits + k] += a
        gate[unit, logits + i] -= a
        gate[unit, code + i] += off
        gate[unit, layout.one] -= a * margin + off
        up[unit, layout.region] = 1.0
        down[layout.flag, unit] = FLAG_GAIN


def _max_logit_gap(embedding: torch.Tensor, final_norm: torch.Tensor) -> float:
    """An upper bound of |logit_k - logit_i| over the rows of ``embedding`` [n, d]: the logit gap is
    ((e_k - e_i) * gain) . x for an RMS-normalised x (|x| = sqrt(d)), so Cauchy-Schwarz bounds it."""
    scaled = embedding * final_norm
    return float(torch.cdist(scaled, scaled).max() * math.sqrt(embedding.shape[1]))


def running_max_margin(logits: torch.Tensor, input_ids: torch.Tensor, checked_ids: list[int], anchor_id: int
                       ) -> torch.Tensor:
    """[B, L] what the PRM thresholds, computed directly from a trunk's ``logits`` [B, L, V] on
    ``input_ids`` [B, L]: the largest margin ``max_k logit_k - logit_x`` (k over the checked
    tokens, logits made at t-1) of any checked token x written after the anchor, up to and
    including each position; 0 before the first. The reference the built PRM is tested against."""
    checked = torch.tensor(checked_ids, device=input_ids.device)
    predicted, written = logits[:, :-1].float(), input_ids[:, 1:]
    margins = predicted[..., checked].max(-1).values - predicted.gather(-1, written[..., None])[..., 0]
    after_anchor = ((input_ids == anchor_id).cumsum(1) > 0)[:, 1:]
    margins = torch.where(torch.isin(written, checked) & after_anchor, margins, torch.zeros_like(margins))
    return torch.cat([torch.zeros_like(margins[:, :1]), margins], 1).cummax(1).values


def set_readout(model: LlamaForCausalLM, good_id: int, bad_id: int, one_weight: float, verdict_weight: float) -> None:
    """The "+" row of the LM head reads ``one_weight * one + verdict_weight * verdict``; "-" reads
    nothing, so the log-odds of "+" over "-" are that sum (over the final norm's RMS)."""
    layout = layout_of(model)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[[good_id, bad_id]] = 0.0
        head[good_id, layout.one] = one_weight
        head[good_id, layout.verdict] = verdict_weight


@torch.no_grad()
def readout_features(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, L, 2] the (one, verdict) features the readout weighs, after the final norm, for
    right-padded ``input_ids`` [B, L]."""
    layout = layout_of(model)
    decoder = getattr(model, model.base_model_prefix)
    hidden = decoder(input_ids=input_ids.to(model.device)).last_hidden_state
    return hidden[..., [layout.one, layout.verdict]].float().cpu()


def fit_readout(features: torch.Tensor, labels: torch.Tensor, iterations: int = 50) -> tuple[float, float]:
    """Readout weights from labelled step tags: ``features`` [M, 2] (one, verdict), ``labels`` [M] (1 good).

    The readout is ``w * (one - verdict / threshold)``. The threshold (on verdict / one, which
    share the final norm's divisor) is the midpoint between two observed ratios with the best
    accuracy on these labels, at least ``MIN_THRESHOLD``. ``w`` is a
    one-weight logistic regression on the steps under the threshold, so that P("+") of an
    unflagged step matches how often such steps are good; a flagged step's P("+") falls from 1/2
    at the threshold to 0 within a few thresholds. (Fitting ``w`` on all steps, or both weights
    by logistic regression, would let the few good steps with large verdicts pull P("+") of every
    unflagged step towards 0.5, or the threshold far above a weakly flagged step's verdict.)
    Returns (one_weight, verdict_weight)."""
    one, verdict = features.double().unbind(-1)
    ratio = verdict / one
    quantiles = torch.quantile(ratio, torch.linspace(0, 1, 201, dtype=torch.float64)).unique()
    candidates = (quantiles[:-1] + quantiles[1:]) / 2  # between observed ratios, so none sits on it
    candidates = candidates[candidates >= MIN_THRESHOLD]
    if len(candidates) == 0:
        raise ValueError(f"fit_readout: no step has verdict / one above {MIN_THRESHOLD} (largest {ratio.max():.3g}): "
                         "the margin flags nothing; pick a smaller one")
    accuracy = ((ratio[None] <= candidates[:, None]) == labels.bool()[None]).double().mean(1)  # [C]
    threshold = float(candidates[accuracy.argmax()])
    below = ratio <= threshold
    x, y = one[below], labels[below].double()
    w = torch.zeros((), dtype=torch.float64)
    for _ in range(iterations):  # Newton's method with a small ridge, finite if every such step is good
        p = torch.sigmoid(w * x)
        w = w - ((x * (p - y)).mean() + 1e-6 * w) / ((x * x * p * (1 - p)).mean() + 1e-6)
    return float(w), -float(w) / threshold


def layout_of(model: LlamaForCausalLM) -> Layout:
    """The Layout of a PRM made by ``build_likelihood_prm`` (kept in its config, so it survives save/load)."""
    fields = getattr(model.config, "likelihood_prm", None)
    if fields is None:
        raise ValueError(f"{model.config.name_or_path or 'this model'} was not made by build_likelihood_prm (no "
                         "'likelihood_prm' entry in its config)")
    return Layout(**fields)
