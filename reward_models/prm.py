"""Process reward models: a score in [0, 1] for every step of a solution, all steps of a batch in
one forward pass.

Two kinds (``prm_type``):
- ``shepherd``: Math-Shepherd style, a causal LM read at a step-tag token after every step; the
  score is P('+') / (P('+') + P('-')) of the next-token distribution at the tag. The tag and label
  tokens are looked up in the PRM's own tokenizer and checked at load: each must be exactly one
  token, and the tokenizer's special-token prefix must be what we strip (OpenR took ``[1:]`` of an
  encoding assuming a BOS; with Qwen tokenizers, which add none, that read the wrong token and gave
  a constant reward).
- ``classifier``: a 2-class head read at a step-separator token (e.g. Qwen2.5-Math-PRM's
  ``<extra_0>``); the score is the softmax probability of class 1.

Per-step reward (``aggregation``): ``step`` pays each new step its own score (dense); ``last``,
``min``, ``product`` and ``mean`` pay the aggregate of all step scores once, when the episode ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification, PreTrainedTokenizerBase

from envs.prompts import DEFAULT_TEMPLATE, SHEPHERD_STEP_TAG, STEP_DELIMITER, format_prompt, shepherd_text
from reward_models.base import RewardOutput, StepContext
from train.policy import inference_dtype, load_causal_lm, load_tokenizer, resolve_device, right_padded

PRM_TYPES = ("shepherd", "classifier")
AGGREGATIONS = ("step", "last", "min", "product", "mean")


def single_token_id(tokenizer: PreTrainedTokenizerBase, text: str, role: str) -> int:
    """The id of ``text`` if it is exactly one token of ``tokenizer``; a clear error otherwise.

    Also checks the special-token assumption: encoding with special tokens must give the same id
    after at most the tokenizer's own BOS, so ids found in encoded inputs are the ones meant.
    """
    plain = tokenizer.encode(text, add_special_tokens=False)
    if len(plain) != 1:
        raise ValueError(
            f"the PRM's {role} {text!r} is {len(plain)} tokens {plain} in this tokenizer, not one; pass the "
            f"{role} the PRM was trained with (a single token of its vocabulary)"
        )
    with_special = tokenizer.encode(text)
    prefix = with_special[: len(with_special) - 1]
    if with_special[-1:] != plain or prefix not in ([], [tokenizer.bos_token_id]):
        raise ValueError(
            f"encoding {text!r} with special tokens gives {with_special}, not [BOS?] + {plain}: this tokenizer "
            "adds tokens other than a BOS, so step-tag positions cannot be located reliably"
        )
    return plain[0]


def aggregate_step_scores(step_scores: Sequence[np.ndarray], how: str) -> np.ndarray:
    """One number per trajectory from its step scores: last, min, product or mean."""
    functions = {"last": lambda s: s[-1], "min": np.min, "product": np.prod, "mean": np.mean}
    if how not in functions:
        raise ValueError(f"aggregation {how!r} must be one of {sorted(functions)}")
    return np.array([functions[how](s) if len(s) else np.nan for s in step_scores], dtype=np.float64)


class ProcessRewardModel:
    """A PRM behind the ``RewardModel`` protocol (see the module docstring).

    Args:
        model_dir: a Hugging Face model directory (causal LM for shepherd, token classifier or
            remote-code PRM for classifier).
        adapter_path: optional LoRA adapter directory applied on top (``--prm_checkpoint_path``).
        template: the prompt template the PRM was trained with.
        step_tag / good_token / bad_token: Math-Shepherd tokens (shepherd); separator: classifier.
        batch_size: sequences per forward pass, default 8 on CPU (1.1M tiny PRM, N=64, one thread:
            8 scored 575 steps/s, 16 477, 64 344) and 32 on GPU; max_length: longest input in tokens (older steps
            are cut from the left; their scores are then missing, the newest are kept).
    """

    def __init__(
        self,
        model_dir: str | Path,
        prm_type: str = "shepherd",
        device: str = "auto",
        dtype: str = "auto",
        aggregation: str = "step",
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
    ):
        if prm_type not in PRM_TYPES:
            raise ValueError(f"prm_type={prm_type!r} must be one of {PRM_TYPES}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={aggregation!r} must be one of {AGGREGATIONS}")
        self.name, self.prm_type, self.aggregation = name, prm_type, aggregation
        self.device = resolve_device(device)
        self.template, self.max_length = template, max_length
        self.batch_size = batch_size if batch_size is not None else (8 if self.device.type == "cpu" else 32)
        self.tokenizer = load_tokenizer(model_dir)
        self.tokenizer.truncation_side = "left"
        torch_dtype = inference_dtype(dtype, self.device)
        if prm_type == "shepherd":
            self.marker = step_tag
            self.marker_id = single_token_id(self.tokenizer, step_tag, "step tag")
            self.label_ids = [single_token_id(self.tokenizer, good_token, "'good' label token"),
                              single_token_id(self.tokenizer, bad_token, "'bad' label token")]
            self.model = load_causal_lm(model_dir, torch_dtype, self.device)
        else:
            self.marker = separator
            self.marker_id = single_token_id(self.tokenizer, separator, "step separator")
            self.model = self._load_classifier(model_dir, torch_dtype, trust_remote_code)
        if adapter_path is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, str(adapter_path)).merge_and_unload()
        self.model.train(False).requires_grad_(False)

    def _load_classifier(self, model_dir, torch_dtype: torch.dtype, trust_remote_code: bool) -> torch.nn.Module:
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        if "AutoModel" in (getattr(config, "auto_map", None) or {}):  # e.g. Qwen2.5-Math-PRM's remote code
            if not trust_remote_code:
                raise ValueError(f"{model_dir} defines its PRM class in remote code; pass trust_remote_code=True "
                                 "(--prm_trust_remote_code) if you trust it")
            loader = AutoModel
        else:
            loader = AutoModelForTokenClassification
        return loader.from_pretrained(str(model_dir), dtype=torch_dtype, trust_remote_code=trust_remote_code).to(self.device)

    def text(self, problem: str, steps: Sequence[str]) -> str:
        """The PRM's input: the prompt, then each step followed by the marker (and the delimiter)."""
        prompt = format_prompt(problem, self.template)
        if self.prm_type == "shepherd":
            return shepherd_text(prompt, steps, self.marker)
        return prompt + "".join(f"{step}{self.marker}{STEP_DELIMITER}" for step in steps)

    @torch.no_grad()
    def step_scores(self, problems: Sequence[str], steps: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Scores [S_b] in [0, 1] of every step of each of B solutions, ``batch_size`` per forward.

        Sequences are scored in order of length so that each forward pads little: on the 1.1M tiny
        PRM at N=64 one padded batch cost 0.21 s, length-sorted chunks of 16 0.12 s."""
        texts = [self.text(problem, s) for problem, s in zip(problems, steps)]
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        scores: list[np.ndarray] = [np.empty(0)] * len(encoded)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, chunk_scores in zip(chunk, self._score_ids([encoded[i] for i in chunk])):
                scores[i] = chunk_scores
        return [s[-len(step_list):] if len(step_list) else s[:0] for s, step_list in zip(scores, steps)]

    def _score_ids(self, encoded: list[list[int]]) -> list[np.ndarray]:
        # Right padding (with id 0) and no attention mask: causal attention never lets a real token
        # see the pads after it, and only real (marker) positions are read, so the pads change nothing.
        input_ids, lengths = right_padded(encoded, self.device)
        is_real = torch.arange(input_ids.shape[1], device=self.device)[None] < lengths[:, None]
        is_marker = (input_ids == self.marker_id) & is_real
        rows, positions = is_marker.nonzero(as_tuple=True)
        if self.prm_type == "shepherd":
            # Only the marker positions and the two label rows of the LM head: no [B, T, V] logits.
            decoder = getattr(self.model, self.model.base_model_prefix)
            hidden = decoder(input_ids=input_ids).last_hidden_state
            head = self.model.get_output_embeddings()
            logits = hidden[rows, positions] @ head.weight[self.label_ids].T
            if getattr(head, "bias", None) is not None:
                logits = logits + head.bias[self.label_ids]
            probs = logits.float().softmax(-1)[:, 0]
        else:
            output = self.model(input_ids=input_ids)
            logits = output.logits if hasattr(output, "logits") else output[0]
            probs = logits[rows, positions].float().softmax(-1)[:, 1]
        probs = probs.cpu().numpy().astype(np.float64)
        rows = rows.cpu().numpy()
        return [probs[rows == b] for b in range(len(encoded))]

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Per-step reward [B]: the new step's score (``step``), or at episode end the aggregate of
        all step scores (other aggregations; 0 before the end)."""
        scores = self.step_scores([c.problem.problem for c in contexts], [c.steps for c in contexts])
        if self.aggregation == "step":
            rewards = np.array([s[-1] if len(s) else 0.0 for s in scores], dtype=np.float64)
        else:
            done = np.array([c.done for c in contexts])
            rewards = np.where(done, np.nan_to_num(aggregate_step_scores(scores, self.aggregation)), 0.0)
        return RewardOutput(rewards=rewards, components={self.name: rewards})
