"""Process reward models: a score in [0, 1] for every step of a solution, all steps of a batch in
one forward pass.

Two kinds (``prm_type``):
- ``shepherd``: Math-Shepherd style, a causal LM read at a step-tag token after every step; the
  score is P('+') / (P('+') + P('-')) of the next-token distribution at the tag. The tag and label
  tokens are looked up in the PRM's own tokenizer and checked at load: each must be exactly one
  token, and the tokenizer's special-token prefix must be at most a BOS (stripping a BOS that a
  tokenizer does not add, as Qwen's do not, would read the wrong token and give a constant reward).
- ``classifier``: a 2-class head read at a step-separator token (e.g. Qwen2.5-Math-PRM's
  ``<extra_0>``); the score is the softmax probability of class 1.

Per-step reward (``aggregation``): ``step`` pays each new step its own score (dense); ``last``,
``min``, ``product`` and ``mean`` pay the aggregate of all step scores once, when the episode ends.

KV cache (shepherd, on by default): the env scores each trajectory once per step, its text one step
longer each time. The PRM keeps the key/values and step scores of each text it scored
(``reward_models.kv_cache.PastCache``, an LRU capped in bytes) and runs a later text through the model
only from where the cached encoding of its previous text ends, all such trajectories in one padded
forward. Whether a text extends a cached one is checked on token ids (a tokenizer may merge across the
step boundary); texts that do not, and first steps, are scored in full in the same forward. Scores equal
full recomputation up to float rounding, and each step runs only its own tokens, so longer solutions gain
more. The classifier type always recomputes in full (its heads, some in remote code, are not split from
their trunk here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification, PreTrainedTokenizerBase

from envs.modes import PrmAggregation, PrmType, member_of
from envs.prompts import DEFAULT_TEMPLATE, SHEPHERD_STEP_TAG, STEP_DELIMITER, format_prompt, shepherd_text, split_steps
from envs.rewards import RewardOutput, StepContext
from models.forward import kv_cache_keyword
from models.loading import ModelDirError, inference_dtype, load_causal_lm, load_tokenizer, resolve_device
from models.packing import right_padded
from reward_models.kv_cache import Past, PastCache, padded_past

DEFAULT_KV_CACHE_MB = 1024.0
"""The shepherd PRM's default KV cache cap: 256k tokens of the tiny PRM (4 KiB each), 8k of a 7B
Mistral in bf16 (128 KiB each: 2 * layers * kv_heads * head_dim * 2 bytes)."""
LABEL_EXAMPLE = ("Compute 12 + 35.", ("12 + 35 = 47", "The answer is \\boxed{47}."))
"""A correct solution at whose step tags ``label_odds`` reads a shepherd PRM (two-digit operands: the
only kind the tiny PRM has seen)."""
MIN_LABEL_ODDS = 10.0
"""A shepherd PRM must make its labels (together) 10 times likelier than any other next token at every
step tag, where it was trained to write one. Measured: the tiny PRM 60; the tiny policy 1.4e-5 and
target 3.8e-4 (they expect ' -' or the step delimiter there); the untrained tiny policy 1.2 (near
uniform: two tokens against one). Not a share of the whole distribution: the tiny PRM's readout only
raises '+' (10-13% here) over a near-uniform rest."""
CLASSIFIER_HEADS = ("ForTokenClassification", "ForProcessRewardModel")


def checked_kv_cache_mb(prm_type: PrmType, kv_cache_mb: float | None) -> float:
    """The KV cache cap in MiB (``None``: the default of ``prm_type``), after checking it; a clear error for a
    bad value."""
    if kv_cache_mb is None:
        return DEFAULT_KV_CACHE_MB if prm_type is PrmType.SHEPHERD else 0.0
    if kv_cache_mb < 0 or (kv_cache_mb > 0 and prm_type is not PrmType.SHEPHERD):
        raise ValueError(f"kv_cache_mb={kv_cache_mb} must be >= 0, and 0 for prm_type='{prm_type}': only "
                         "the shepherd PRM reuses key/values")
    return kv_cache_mb


def single_token_id(tokenizer: PreTrainedTokenizerBase, text: str, role: str, argument: str) -> int:
    """The id of ``text`` if it is exactly one token of ``tokenizer``; a clear error otherwise, telling
    to set ``argument`` (what passes the ``role`` token in) to the one the PRM was trained with.

    Also checks the special-token assumption: encoding with special tokens must give the same id
    after at most the tokenizer's own BOS, so ids found in encoded inputs are the ones meant.
    """
    plain = tokenizer.encode(text, add_special_tokens=False)
    if len(plain) != 1:
        raise ValueError(
            f"the PRM's {role} {text!r} is {len(plain)} tokens {plain} in its tokenizer, not one; set {argument} "
            f"to the {role} the PRM was trained with (a single token of its vocabulary)"
        )
    with_special = tokenizer.encode(text)
    prefix = with_special[: len(with_special) - 1]
    if with_special[-1:] != plain or prefix not in ([], [tokenizer.bos_token_id]):
        raise ValueError(
            f"encoding {text!r} with special tokens gives {with_special}, not [BOS?] + {plain}: this tokenizer "
            "adds tokens other than a BOS, so step-tag positions cannot be located reliably"
        )
    return plain[0]


def prm_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path, role: str, prm_type: PrmType,
                  step_tag: str, good_token: str, bad_token: str, separator: str) -> tuple[str, int, list[int]]:
    """``(marker, marker id, [good, bad] label ids)`` of the PRM in ``model_dir`` (classifier: no labels),
    each checked to be one token of its ``tokenizer`` (``single_token_id``); raises ``ModelDirError``."""
    try:
        if prm_type is PrmType.SHEPHERD:
            labels = [single_token_id(tokenizer, good_token, "'good' label token", "good_token"),
                      single_token_id(tokenizer, bad_token, "'bad' label token", "bad_token")]
            return step_tag, single_token_id(tokenizer, step_tag, "step tag", "step_tag (--prm_step_tag)"), labels
        return separator, single_token_id(tokenizer, separator, "step separator", "separator (--prm_step_tag)"), []
    except ValueError as error:
        raise ModelDirError(f"{role}={str(model_dir)!r}: {error}") from error


def check_classifier_head(model_dir: str | Path, role: str = "model_dir") -> None:
    """Refuses a classifier PRM whose config.json declares no 2-class token-classification head (a
    ``*ForTokenClassification`` with 2 labels, or a ``*ForProcessRewardModel``)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    num_labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    if num_labels != 2 or not any(name.endswith(CLASSIFIER_HEADS) for name in architectures):
        raise ModelDirError(
            f"{role}={str(model_dir)!r} is not a classifier PRM: its config.json declares {architectures} with "
            f"{num_labels} labels, not a 2-class token-classification head (*ForTokenClassification or "
            "*ForProcessRewardModel); pass a classifier PRM such as Qwen2.5-Math-PRM-7B, or prm_type='shepherd' "
            "(--prm_type shepherd) for a Math-Shepherd PRM")


def check_prm_dir(path: str | Path, prm_type: PrmType = PrmType.SHEPHERD, step_tag: str = SHEPHERD_STEP_TAG,
                  good_token: str = "+", bad_token: str = "-", separator: str = "<extra_0>",
                  role: str = "model_dir") -> None:
    """Checks, reading no weights, that ``path`` can be a PRM of ``prm_type``: a model directory
    (``check_model_dir``) whose tokenizer has the step tag and labels (shepherd) or the separator
    (classifier) as single tokens, and, for a classifier, a 2-class head in its config. Whether a
    shepherd PRM's LM head scores its labels needs the weights: ``ProcessRewardModel`` checks that when
    it loads (``label_odds``). ``role`` names the argument or flag in the error. Raises ``ModelDirError``."""
    prm_type = member_of(tuple(PrmType), prm_type, "prm_type")
    prm_token_ids(load_tokenizer(path, role), path, role, prm_type, step_tag, good_token, bad_token, separator)
    if prm_type is PrmType.CLASSIFIER:
        check_classifier_head(path, role)


def aggregate_step_scores(step_scores: Sequence[np.ndarray], how: PrmAggregation) -> np.ndarray:
    """One number per trajectory from its step scores: last, min, product or mean."""
    functions = {PrmAggregation.LAST: lambda s: s[-1], PrmAggregation.MIN: np.min, PrmAggregation.PRODUCT: np.prod,
                 PrmAggregation.MEAN: np.mean}
    how = member_of(tuple(functions), how, "aggregation")
    return np.array([functions[how](s) if len(s) else np.nan for s in step_scores], dtype=np.float64)


def marked_pieces(step: str, marker: str) -> list[str]:
    """The pieces of an (untrusted) action that each get a marker: its steps split at the delimiter,
    or the action itself when it holds none, so every action is scored. Marker text inside the
    action is removed first: only the markers placed here are read."""
    step = step.replace(marker, "")
    return split_steps(step) or [step]


def split_by_row(values: torch.Tensor, rows: torch.Tensor, num_rows: int) -> list[np.ndarray]:
    """Values [M] of rows [M] (sorted) as ``num_rows`` float64 arrays, one per row."""
    counts = torch.bincount(rows, minlength=num_rows).tolist()
    return list(np.split(values.cpu().numpy().astype(np.float64), np.cumsum(counts)[:-1]))


class ProcessRewardModel:
    """A PRM behind the ``RewardModel`` protocol (see the module docstring).

    Args:
        model_dir: a Hugging Face model directory (causal LM for shepherd, token classifier or
            remote-code PRM for classifier).
        adapter_path: optional LoRA adapter directory applied on top (``--prm_checkpoint_path``).
        template: the prompt template the PRM was trained with.
        step_tag / good_token / bad_token: Math-Shepherd tokens (shepherd); separator: classifier.
        batch_size: sequences per forward pass; default 8 on CPU (where larger padded batches score
            fewer steps per second) and 32 on GPU.
        max_length: longest input in tokens (older steps are cut from the left; their scores are
            then missing, the newest are kept).
        kv_cache_mb: MiB of past key/values kept between calls (see the module docstring); None:
            ``DEFAULT_KV_CACHE_MB`` for shepherd, 0 (recompute every text in full) for classifier.
            Size it for every live trajectory: the env touches all of them each step in the same
            order, so an LRU too small for all of them evicts each entry before its next use.
        check_labels: refuse a shepherd model whose ``label_odds`` are below ``MIN_LABEL_ODDS`` (a
            language model, not a PRM); False scores any causal LM, e.g. to test the scoring itself.
    """

    def __init__(
        self,
        model_dir: str | Path,
        prm_type: PrmType = PrmType.SHEPHERD,
        device: str = "auto",
        dtype: str = "auto",
        aggregation: PrmAggregation = PrmAggregation.STEP,
        adapter_path: str | Path | None = None,
        template: str = DEFAULT_TEMPLATE,
        step_tag: str = SHEPHERD_STEP_TAG,
        good_token: str = "+",
        bad_token: str = "-",
        separator: str = "<extra_0>",
        batch_size: int | None = None,
        max_length: int = 4096,
        trust_remote_code: bool = False,
        name: str = "prm",
        kv_cache_mb: float | None = None,
        check_labels: bool = True,
    ):
        prm_type = member_of(tuple(PrmType), prm_type, "prm_type")
        aggregation = member_of(tuple(PrmAggregation), aggregation, "aggregation")
        kv_cache_mb = checked_kv_cache_mb(prm_type, kv_cache_mb)
        self.name, self.prm_type, self.aggregation = name, prm_type, aggregation
        self.device = resolve_device(device)
        self.template, self.max_length = template, max_length
        self.batch_size = batch_size if batch_size is not None else (8 if self.device.type == "cpu" else 32)
        self.tokenizer = load_tokenizer(model_dir)
        self.tokenizer.truncation_side = "left"
        torch_dtype = inference_dtype(dtype, self.device)
        # Tokens and head first: a wrong one fails before the model is loaded.
        self.marker, self.marker_id, self.label_ids = prm_token_ids(
            self.tokenizer, model_dir, "model_dir", prm_type, step_tag, good_token, bad_token, separator)
        if prm_type is PrmType.CLASSIFIER:
            check_classifier_head(model_dir)
        self.model = self._load_model(model_dir, torch_dtype, adapter_path, trust_remote_code)
        if prm_type is PrmType.SHEPHERD and check_labels:
            self._check_label_odds(model_dir, good_token, bad_token)
        self.past_cache = PastCache(int(kv_cache_mb * 2**20)) if kv_cache_mb > 0 else None

    @torch.no_grad()
    def label_odds(self) -> float:
        """How much likelier a shepherd PRM's two labels (together) are than the likeliest other token,
        as the next token at a step tag: the least over the step tags of ``LABEL_EXAMPLE``."""
        input_ids = self.tokenizer(self.text(*LABEL_EXAMPLE), return_tensors="pt")["input_ids"].to(self.device)
        decoder = getattr(self.model, self.model.base_model_prefix)
        hidden = decoder(input_ids=input_ids).last_hidden_state[input_ids == self.marker_id]  # [M, H]
        if len(hidden) == 0:
            raise ModelDirError(f"the PRM's tokenizer merges the step tag {self.marker!r} with the text around it; "
                                "set step_tag (--prm_step_tag) to the tag the PRM was trained with")
        probs = self.model.get_output_embeddings()(hidden).float().softmax(-1)  # [M, V]
        labels = torch.tensor(self.label_ids, device=self.device)
        return float((probs[:, labels].sum(-1) / probs.index_fill(1, labels, 0.0).amax(-1)).min())

    def _check_label_odds(self, model_dir: str | Path, good_token: str, bad_token: str) -> None:
        """Refuses a causal LM that is not a Math-Shepherd PRM (e.g. a policy): its score would be the
        ratio of two tokens it has no reason to write."""
        odds = self.label_odds()
        if odds < MIN_LABEL_ODDS:
            raise ModelDirError(
                f"{str(model_dir)!r} is not a Math-Shepherd PRM: after its step tag {self.marker!r} the labels "
                f"{good_token!r}/{bad_token!r} are {odds:.2g} times as likely as its likeliest other next token, "
                f"where a PRM, trained to write a label there, makes them >= {MIN_LABEL_ODDS:g} times likelier; "
                "pass a PRM directory (not a policy's), the step tag and labels it was trained with, or "
                "prm_type='classifier' for a classifier PRM")

    def _load_model(self, model_dir: str | Path, torch_dtype: torch.dtype, adapter_path: str | Path | None,
                    trust_remote_code: bool) -> torch.nn.Module:
        """The frozen scoring model, with the LoRA adapter (if any) merged in."""
        if self.prm_type is PrmType.SHEPHERD:
            model = load_causal_lm(model_dir, torch_dtype, self.device)
        else:
            model = self._load_classifier(model_dir, torch_dtype, trust_remote_code)
        if adapter_path is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter_path)).merge_and_unload()
        return model.train(False).requires_grad_(False)

    def _load_classifier(self, model_dir: str | Path, torch_dtype: torch.dtype,
                         trust_remote_code: bool) -> torch.nn.Module:
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        if "AutoModel" in (getattr(config, "auto_map", None) or {}):  # e.g. Qwen2.5-Math-PRM's remote code
            if not trust_remote_code:
                raise ValueError(f"{model_dir} defines its PRM class in remote code; pass trust_remote_code=True "
                                 "(--prm_trust_remote_code) if you trust it")
            loader = AutoModel
        else:
            loader = AutoModelForTokenClassification
        model = loader.from_pretrained(str(model_dir), dtype=torch_dtype, trust_remote_code=trust_remote_code)
        return model.to(self.device)

    def text(self, problem: str, steps: Sequence[str]) -> str:
        """The PRM's input: the prompt, then each step followed by the marker (and the delimiter).
        An action that holds several steps (a whole solution, as under ``--action_level solution``)
        is split at the delimiter, so the PRM reads every step as it was trained to."""
        prompt = format_prompt(problem.replace(self.marker, ""), self.template)
        pieces = [piece for step in steps for piece in marked_pieces(step, self.marker)]
        if self.prm_type is PrmType.SHEPHERD:
            return shepherd_text(prompt, pieces, self.marker)
        return prompt + "".join(f"{piece}{self.marker}{STEP_DELIMITER}" for piece in pieces)

    @torch.no_grad()
    def step_scores(self, problems: Sequence[str], steps: Sequence[Sequence[str]],
                    finished: Sequence[bool] | None = None) -> list[np.ndarray]:
        """Scores [S_b] in [0, 1] of every step of each of B solutions, ``batch_size`` per forward.
        An action holding several steps gets one score per step (its last is the action's score);
        left truncation drops the earliest.

        With the KV cache on, ``finished[b]`` True says solution b will not be extended, so its
        key/values are not kept (default: all are kept)."""
        texts = [self.text(problem, s) for problem, s in zip(problems, steps)]
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        if self.past_cache is None:
            scores = self._full_scores(encoded)
        else:
            # The text the previous call scored for the same trajectory: where this one may start.
            previous = [self.text(problem, s[:-1]) for problem, s in zip(problems, steps)]
            keep = [True] * len(encoded) if finished is None else [not f for f in finished]
            scores = self._cached_scores(texts, encoded, previous, keep)
        return scores

    def _full_scores(self, encoded: list[list[int]]) -> list[np.ndarray]:
        """Marker scores of each encoded text, recomputed in full; sequences are scored in order of
        length so that each forward pads little."""
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        scores: list[np.ndarray] = [np.empty(0)] * len(encoded)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, chunk_scores in zip(chunk, self._score_ids([encoded[i] for i in chunk])):
                scores[i] = chunk_scores
        return scores

    def _score_ids(self, encoded: list[list[int]]) -> list[np.ndarray]:
        # Right padding (with id 0) and no attention mask: causal attention never lets a real token
        # see the pads after it, and only real (marker) positions are read, so the pads change nothing.
        input_ids, lengths = right_padded(encoded, self.device)
        is_real = torch.arange(input_ids.shape[1], device=self.device)[None] < lengths[:, None]
        is_marker = (input_ids == self.marker_id) & is_real
        rows, positions = is_marker.nonzero(as_tuple=True)
        if self.prm_type is PrmType.SHEPHERD:
            # Only the marker positions and the two label rows of the LM head: no [B, T, V] logits.
            decoder = getattr(self.model, self.model.base_model_prefix)
            hidden = decoder(input_ids=input_ids).last_hidden_state
            probs = self._good_probability(hidden[rows, positions])
        else:
            output = self.model(input_ids=input_ids)
            logits = output.logits if hasattr(output, "logits") else output[0]
            probs = logits[rows, positions].float().softmax(-1)[:, 1]
        return split_by_row(probs, rows, len(encoded))

    def _good_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        """P(good) / (P(good) + P(bad)) [M] from final hidden states [M, H] at M step tags."""
        head = self.model.get_output_embeddings()
        logits = hidden @ head.weight[self.label_ids].T
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias[self.label_ids]
        return logits.float().softmax(-1)[:, 0]

    def _cached_scores(self, texts: list[str], encoded: list[list[int]], previous: list[str],
                       keep: list[bool]) -> list[np.ndarray]:
        """Marker scores of each text (``encoded``), running only what no cached ``Past`` covers.

        ``previous[b]``: text b without its last step. Afterwards the cache holds the ``Past`` of
        each kept text, and no longer those they extended: the env extends each trajectory once, so
        an extended entry would only push live ones out."""
        pasts = [self._cached_past(*row) for row in zip(texts, encoded, previous)]
        scores = [past.scores if past is not None else np.empty(0) for past in pasts]
        new_lengths = [len(ids) - (past.length if past is not None else 0) for ids, past in zip(encoded, pasts)]
        order = sorted((b for b, n in enumerate(new_lengths) if n > 0), key=new_lengths.__getitem__)
        extended: dict[int, Past] = {}
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            extended.update(zip(chunk, self._extend([pasts[b] for b in chunk], [encoded[b] for b in chunk])))
        for b, past in extended.items():
            scores[b] = past.scores
            if pasts[b] is not None:
                self.past_cache.pop(previous[b])
        for b, text in enumerate(texts):
            if keep[b]:
                self.past_cache.put(text, extended.get(b, pasts[b]))
            else:
                self.past_cache.pop(text)
        return scores

    def _cached_past(self, text: str, ids: list[int], previous: str) -> Past | None:
        """The cached ``Past`` of ``text`` itself or, failing that, of ``previous`` where its ids are
        a prefix of ``ids`` (checked, not assumed: a tokenizer may merge tokens across the step
        boundary, and left truncation shifts every id)."""
        past = self.past_cache.get(text)
        if past is None:
            past = self.past_cache.get(previous)
            if past is not None and not (past.length < len(ids) and tuple(ids[: past.length]) == past.ids):
                past = None
        return past

    def _extend(self, pasts: list[Past | None], encoded: list[list[int]]) -> list[Past]:
        """The ``Past`` of each of B texts ``encoded[b]``, running in one forward only the tokens
        after its cached ``pasts[b]`` (all of them where that is None).

        Slots [B, P + N]: row b's p_b past tokens are left-padded into [P - p_b, P), its n_b new ones
        right-padded into [P, P + n_b). A 2-D attention mask hides the pads; position_ids p_b + offset
        put RoPE where a full forward would; and slot distances between real tokens equal position
        distances, so a sliding window (counted in slots) stays exact too."""
        past_lengths = [0 if past is None else past.length for past in pasts]
        new_ids, new_lengths = right_padded([ids[p:] for ids, p in zip(encoded, past_lengths)], self.device)
        width, num_new = max(past_lengths), new_ids.shape[1]
        starts = torch.tensor(past_lengths, device=self.device)[:, None]  # [B, 1]
        is_real_new = torch.arange(num_new, device=self.device)[None] < new_lengths[:, None]
        is_real_past = torch.arange(width, device=self.device)[None] >= width - starts
        decoder = getattr(self.model, self.model.base_model_prefix)
        cache = padded_past(pasts, width)  # the forward appends the new tokens' key/values to it in place
        output = decoder(input_ids=new_ids, attention_mask=torch.cat([is_real_past, is_real_new], 1).long(),
                         position_ids=starts + torch.arange(num_new, device=self.device)[None],
                         **{kv_cache_keyword(decoder): cache}, use_cache=True)
        rows, positions = ((new_ids == self.marker_id) & is_real_new).nonzero(as_tuple=True)
        new_scores = split_by_row(self._good_probability(output.last_hidden_state[rows, positions]), rows, len(pasts))
        layers = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return [Past(tuple(ids), torch.stack([t[b, :, width - p : width + len(ids) - p] for t in layers]),
                     np.concatenate([past.scores, scores]) if past is not None else scores)
                for b, (ids, past, p, scores) in enumerate(zip(encoded, pasts, past_lengths, new_scores))]

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Per-step reward [B]: the new step's score (``step``), or at episode end the aggregate of
        all step scores (other aggregations; 0 before the end)."""
        scores = self.step_scores([c.problem.problem for c in contexts], [c.steps for c in contexts],
                                  finished=[c.done for c in contexts])
        return step_rewards(scores, contexts, self.aggregation, self.name)


def step_rewards(scores: Sequence[np.ndarray], contexts: Sequence[StepContext], aggregation: PrmAggregation,
                 name: str) -> RewardOutput:
    """The reward [B] a PRM pays from the step scores of B contexts: the new step's score (``step``), or
    at episode end the aggregate of all step scores (other aggregations; 0 before the end)."""
    if aggregation == PrmAggregation.STEP:
        rewards = np.array([s[-1] if len(s) else 0.0 for s in scores], dtype=np.float64)
    else:
        done = np.array([c.done for c in contexts])
        rewards = np.where(done, np.nan_to_num(aggregate_step_scores(scores, aggregation)), 0.0)
    return RewardOutput(rewards=rewards, sources={name: rewards})
