"""The trained language model: a causal LM (optionally LoRA), a value head, log-probs, save/load.

Shapes: ``B`` rows (prompt, action) pairs, ``T`` packed tokens per row, ``L`` action tokens (the
longest action in the batch), ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from models.scoring import ActionScores, token_scores

if TYPE_CHECKING:
    from peft import LoraConfig

# peft is imported where LoRA is used, not here: importing it takes seconds (it loads much of
# transformers), which every full fine-tuning run, every worker and every start-up error would pay.

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTOR_ADAPTER = "default"  # peft's name for the first adapter; the one vLLM and save() merge
CRITIC_ADAPTER = "critic"
POLICY_META = "mathrl_policy.json"
ADAPTER_DIR = "adapters"  # peft layout: actor adapter here, critic adapter in adapters/critic/
VALUE_HEAD_FILE = "critic/value_head.safetensors"  # a subfolder: vLLM globs top-level *.safetensors
WRAPPER_PREFIXES = ("base_model.model.", "module.", "_orig_mod.")

TokenBatch = Sequence[Sequence[int]] | tuple[torch.Tensor, torch.Tensor]
"""Token ids of B sequences: lists of ids, or a right-padded ``[B, N]`` tensor with its ``[B]`` true lengths."""


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else as given (cuda must exist)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but CUDA is not available here; use --device cpu or auto")
    return resolved


def inference_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA (a 7B PRM never lands in fp32 on a GPU by accident), float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class Precision:
    """``compute``: dtype of the matmuls (autocast); ``weights``: dtype the trained weights are stored in."""

    compute: torch.dtype
    weights: torch.dtype

    @property
    def autocast_enabled(self) -> bool:
        return self.compute != torch.float32


def resolve_precision(dtype: str, device: torch.device, low_precision_weights: bool = False) -> Precision:
    """fp32 master weights + autocast for bfloat16/float16 (the default); ``low_precision_weights``
    stores bfloat16 weights directly (no fp32 master copy; half the memory). float16 weights without
    an fp32 master copy lose small updates to rounding, so they are refused; float16 autocast needs a
    loss scaler in the trainer (torch.amp.GradScaler)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    compute = DTYPES[dtype]
    if compute == torch.float16 and device.type == "cpu":
        raise ValueError("dtype='float16' needs a CUDA device; use float32 or bfloat16 on CPU")
    if low_precision_weights and compute != torch.bfloat16:
        raise ValueError(f"low_precision_weights needs dtype='bfloat16' (got {dtype!r}): float16/float32 "
                         "weights keep an fp32 master copy")
    return Precision(compute=compute, weights=compute if low_precision_weights else torch.float32)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters; ``target_modules`` are module-name suffixes or peft's ``"all-linear"``."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"

    def peft_config(self) -> LoraConfig:
        from peft import LoraConfig

        if self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank} must be >= 1 (use lora=None for full fine-tuning)")
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=targets, task_type="CAUSAL_LM")


@dataclass
class PackedBatch:
    """(prompt, action) pairs packed into one padded ``[B, T]`` batch for a single forward pass."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens (from true lengths)
    position_ids: torch.Tensor  # [B, T] 0.. from each row's first real token (left padding shifts it)
    read_positions: torch.Tensor  # [B, L] column whose hidden state predicts action token k (prompt_len-1+k)
    action_ids: torch.Tensor  # [B, L]
    action_mask: torch.Tensor  # [B, L] True on real action tokens


@dataclass
class SharedPromptBatch:
    """(prompt, action) pairs whose prompts repeat (GRPO's groups): each distinct prompt is run once and
    its KV states are read by every row that continues it. ``U`` distinct prompts of up to ``P`` tokens."""

    prompt_ids: torch.Tensor  # [U, P] left-padded, so every prompt's last token sits in column P - 1
    prompt_mask: torch.Tensor  # [U, P] 1 on real tokens
    prompt_of_row: torch.Tensor  # [B] which distinct prompt row b continues
    action_ids: torch.Tensor  # [B, L] right-padded
    action_mask: torch.Tensor  # [B, L] True on real action tokens


def take(batch: TokenBatch, rows: list[int]) -> TokenBatch:
    """Rows ``rows`` of a TokenBatch (lists of ids, or padded ids with their lengths)."""
    if isinstance(batch, tuple):
        index = torch.as_tensor(rows, device=batch[0].device)
        return batch[0][index], batch[1][index]
    return [batch[row] for row in rows]


def token_lengths(ids: TokenBatch) -> list[int]:
    """The ``[B]`` true lengths of a TokenBatch."""
    return ids[1].tolist() if isinstance(ids, tuple) else [len(row) for row in ids]


def right_padded(ids: TokenBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, max(N, 1)] right-padded ids, [B] lengths)``; width >= 1 so gathers on empty actions stay valid."""
    if isinstance(ids, tuple):
        padded, lengths = ids[0].to(device=device, dtype=torch.long), ids[1].to(device=device, dtype=torch.long)
        if padded.dim() != 2 or lengths.shape != padded.shape[:1] or bool((lengths > padded.shape[1]).any()):
            raise ValueError(f"expected a [B, N] id tensor with [B] lengths <= N, got {tuple(padded.shape)} "
                             f"and {tuple(lengths.shape)}")
    else:
        rows = [torch.as_tensor(list(row), dtype=torch.long) for row in ids]
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.long, device=device)
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)
    if padded.shape[1] == 0:
        padded = padded.new_zeros(padded.shape[0], 1)
    return padded, lengths


def distinct_rows(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """``(distinct prompts in first-seen order, [B] index of each row's prompt among them)``."""
    first_seen: dict[tuple[int, ...], int] = {}
    index = [first_seen.setdefault(tuple(row), len(first_seen)) for row in rows]
    return [list(key) for key in first_seen], index


def left_padded(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, P] ids, [B, P] attention mask)`` with each row right-aligned; the mask comes from lengths."""
    lengths = torch.tensor([len(row) for row in rows], device=device)
    width = int(lengths.max())
    is_real = torch.arange(width, device=device)[None] >= (width - lengths)[:, None]
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    input_ids[is_real] = torch.tensor([token for row in rows for token in row], dtype=torch.long, device=device)
    return input_ids, is_real.long()


def token_rows(ids: TokenBatch) -> list[list[int]]:
    """A TokenBatch as B lists of ids."""
    if isinstance(ids, tuple):
        return [row[:length].tolist() for row, length in zip(ids[0], ids[1].tolist())]
    return [list(row) for row in ids]


def pack_shared(prompts: TokenBatch, actions: TokenBatch, pad_id: int, device: torch.device,
                ) -> SharedPromptBatch | None:
    """The rows as a ``SharedPromptBatch`` when some prompts repeat, else None (nothing to share)."""
    distinct, prompt_of_row = distinct_rows(token_rows(prompts))
    if len(distinct) == len(prompt_of_row):
        return None
    if min(len(prompt) for prompt in distinct) < 1:
        raise ValueError("every prompt needs >= 1 token: an action's first log-prob is read at the last prompt token")
    prompt_ids, prompt_mask = left_padded(distinct, pad_id, device)
    action_ids, action_len = right_padded(actions, device)
    if len(action_len) != len(prompt_of_row):
        raise ValueError(f"{len(prompt_of_row)} prompts but {len(action_len)} actions: pass one action per prompt")
    return SharedPromptBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                             prompt_of_row=torch.tensor(prompt_of_row, device=device), action_ids=action_ids,
                             action_mask=torch.arange(action_ids.shape[1], device=device)[None] < action_len[:, None])


def pack(prompts: TokenBatch, actions: TokenBatch, pad_id: int, device: torch.device,
         padding_side: str = "right") -> PackedBatch:
    """Packs each prompt followed by its action into one row, padded on ``padding_side``.

    Masks and positions come from the true lengths only, so a pad id that is also a real token is harmless.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side={padding_side!r} must be 'left' or 'right'")
    prompt_ids, prompt_len = right_padded(prompts, device)
    action_ids, action_len = right_padded(actions, device)
    if prompt_len.shape != action_len.shape:
        raise ValueError(f"{len(prompt_len)} prompts but {len(action_len)} actions: pass one action per prompt")
    if bool((prompt_len < 1).any()):
        raise ValueError("every prompt needs >= 1 token: an action's first log-prob is read at the last prompt token")
    total_len = prompt_len + action_len  # [B]
    width = int(total_len.max())
    offset = width - total_len if padding_side == "left" else torch.zeros_like(total_len)  # [B] pad columns in front
    within = torch.arange(width, device=device)[None] - offset[:, None]  # [B, T] index inside the row's own sequence
    in_prompt = (within >= 0) & (within < prompt_len[:, None])
    in_action = (within >= prompt_len[:, None]) & (within < total_len[:, None])
    prompt_tokens = prompt_ids.gather(1, within.clamp(0, prompt_ids.shape[1] - 1))
    action_tokens = action_ids.gather(1, (within - prompt_len[:, None]).clamp(0, action_ids.shape[1] - 1))
    input_ids = torch.where(in_prompt, prompt_tokens, torch.where(in_action, action_tokens, pad_id))
    attention_mask = in_prompt | in_action
    steps = torch.arange(action_ids.shape[1], device=device)[None]  # [1, L]
    read_positions = (offset + prompt_len - 1)[:, None] + steps
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=torch.where(attention_mask, within, 0),
        read_positions=read_positions.clamp(max=width - 1),
        action_ids=action_ids,
        action_mask=steps < action_len[:, None],
    )


# The cost model of one forward + backward pass over packed rows, in units of one row's token (~0.1 ms on a
# CPU core with the tiny policy, 1 thread): a token also costs 1 / PASS_ATTENDED_TOKENS per position it
# attends to, and a pass costs PASS_COST more whatever its rows (layer kernels, autograd bookkeeping).
PASS_COST = 200
PASS_ATTENDED_TOKENS = 800


def cheapest_runs(count: int, run_costs: Callable[[int], np.ndarray]) -> list[tuple[int, int]]:
    """``(begin, end)`` of the consecutive runs that cut ``count`` sorted items at the least total cost, by
    dynamic programming over where the last run begins: ``run_costs(end)`` gives ``[end]`` costs of a last run
    ``[begin, end)`` for every begin (inf where such a run is not allowed)."""
    best = np.zeros(count + 1)  # best[end]: least cost of the first `end` items
    start = np.zeros(count + 1, dtype=np.int64)  # start[end]: where that best last run begins
    for end in range(1, count + 1):
        costs = best[:end] + run_costs(end)
        start[end] = costs.argmin()
        best[end] = costs[start[end]]
    cuts = [count]
    while cuts[-1] > 0:
        cuts.append(int(start[cuts[-1]]))
    cuts.reverse()
    return list(zip(cuts, cuts[1:]))


def length_buckets(lengths: Sequence[int]) -> list[list[int]]:
    """Row indices grouped into the forward passes that cost least: rows sorted by packed length (stably)
    and cut into consecutive runs, each padded to its longest row, at the least modelled cost (above).
    Rows of MATH-like spread (15-1,500 tokens) split into a few passes instead of padding every row to
    the longest; rows of one length stay one pass in the given order."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    widths = np.array([lengths[i] for i in order], dtype=np.float64)

    def run_costs(end: int) -> np.ndarray:
        rows, width = end - np.arange(end), widths[end - 1]
        return PASS_COST + rows * width * (1 + width / PASS_ATTENDED_TOKENS)

    runs = cheapest_runs(len(order), run_costs)
    if len(runs) <= 1:
        return [list(range(len(order)))]
    return [order[begin:end] for begin, end in runs]


def hf_param_name(name: str) -> str:
    """Plain HF parameter name: wrapper prefixes (peft, DDP, torch.compile) and peft's ``.base_layer`` removed."""
    name = name.replace("._orig_mod.", ".").replace(".base_layer.", ".")
    while name.startswith(WRAPPER_PREFIXES):
        name = name[len(next(p for p in WRAPPER_PREFIXES if name.startswith(p))):]
    return name


class ModelDirError(ValueError):
    """A model directory that cannot be used as given; the message is one line naming the argument (or
    flag), the directory, what is wrong and what to pass instead."""


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # what from_pretrained looks for, sharded (index) or not
TOKENIZER_VOCAB_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken")
MODEL_DIR_FIX = ("pass a directory written by save_pretrained with its tokenizer (e.g. a run's best/ or "
                 "checkpoints/iter_N/policy/, or models.tiny's)")


def check_model_dir(path: str | Path, role: str = "model_dir") -> None:
    """Checks, without loading anything, that ``path`` holds what ``from_pretrained`` needs: config.json,
    weights and a tokenizer (tokenizer.json, or tokenizer_config.json with a vocabulary file). ``role``
    names the argument or flag in the error (e.g. ``"--model_name_or_path"``). Raises ``ModelDirError``."""
    directory = Path(path)
    where = f"{role}={str(path)!r}"
    if not directory.is_dir():
        raise ModelDirError(f"{where} {'is not a directory' if directory.exists() else 'does not exist'}: "
                            f"{MODEL_DIR_FIX}")
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        missing.append(f"weights ({' or '.join(WEIGHT_FILES)})")
    has_vocab = any(next(directory.glob(pattern), None) for pattern in TOKENIZER_VOCAB_FILES)
    if not ((directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file() and has_vocab):
        missing.append("tokenizer (tokenizer.json, or tokenizer_config.json with a vocabulary file)")
    if not missing:
        return
    # The two mistakes train_math's layout invites: <run>/checkpoints/iter_N (policy/ inside) and <run>.
    if (directory / "policy").is_dir() or (directory / "manifest.json").is_file():
        fix = f"this is a checkpoint directory; pass its policy/ subfolder ({str(directory / 'policy')!r})"
    elif (directory / "checkpoints").is_dir():
        fix = "this is a run directory; pass its best/ subfolder or checkpoints/iter_N/policy/"
    else:
        fix = MODEL_DIR_FIX
    raise ModelDirError(f"{where} has no {', no '.join(missing)}: {fix}")


def load_tokenizer(model_dir: str | Path, role: str = "model_dir") -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model, with a pad token (see ``ensure_pad_token``)."""
    check_model_dir(model_dir, role)
    return ensure_pad_token(AutoTokenizer.from_pretrained(str(model_dir)), str(model_dir))


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, where: str) -> PreTrainedTokenizerBase:
    """A missing pad token becomes eos, with a warning (harmless here: masks never rely on pad ids)."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer in {where} has neither a pad nor an eos token; add one of them")
        logger.warning("tokenizer in %s has no pad token; using eos %r as pad (masks come from lengths)",
                       where, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                   role: str = "model_dir") -> PreTrainedModel:
    """``AutoModelForCausalLM`` from a local directory, with errors that say what to pass instead."""
    check_model_dir(model_dir, role)
    path = Path(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except ValueError as error:
        raise ValueError(f"{path} does not hold a causal language model (AutoModelForCausalLM could not "
                         f"load it): {error}") from error
    return model.to(device)


def checkpoints_activations(model: PreTrainedModel) -> bool:
    """Whether activation (gradient) checkpointing is on; transformers 5.24 renamed the property."""
    renamed = hasattr(type(model), "is_activation_checkpointing")
    return getattr(model, "is_activation_checkpointing" if renamed else "is_gradient_checkpointing")


def kv_cache_keyword(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes a KV cache by: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` still works but warns on every call), ``past_key_values`` before it and in
    remote-code models written for older versions."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class LanguagePolicy(nn.Module):
    """A causal LM policy with optional LoRA and an optional critic.

    Critic design. The value head is a linear layer on the final hidden state, fed by a trunk that the
    value loss trains (never a frozen no-grad trunk):
    - LoRA: the critic has its own LoRA adapter (``"critic"``) on the shared frozen base weights, so it
      learns through every targeted layer of the backbone while the actor adapter never sees the value
      loss. It costs a second forward pass (with the critic adapter active) but no extra copy of the base.
    - Full fine-tuning: the critic shares the trunk with the actor, and the value loss' gradient flows
      into the whole trunk (scaled by the trainer's value coefficient); no second model in memory, and
      ``evaluate(..., with_values=True)`` gets log-probs and values from one forward pass.
    ``param_groups(lr, critic_lr)`` puts the actor's parameters (actor adapter, or the full trunk) and the
    critic's (critic adapter + value head) in separate optimizer groups.

    Reference policy for KL: the base with adapters disabled (LoRA), or a frozen copy of the starting
    weights (full fine-tuning) loaded lazily from ``reference_dir`` on the first ``ref_log_probs`` call.

    Precision: ``dtype`` is the compute dtype. float32: plain. bfloat16/float16: fp32 master weights
    and autocast (float16 needs CUDA and a GradScaler in the trainer); ``low_precision_weights=True``
    stores bfloat16 weights outright. A frozen LoRA base is stored in the compute dtype.

    The policy starts in eval mode: call ``train()`` for updates (dropout and gradient checkpointing
    act only in training mode) and ``eval()`` when scoring must match the sampler exactly.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "auto",
        dtype: str = "float32",
        low_precision_weights: bool = False,
        lora: LoraSettings | None = None,
        with_critic: bool = False,
        gradient_checkpointing: bool = False,
        reference_dir: str | Path | None = None,
        role_adapters: Sequence[str] = (),
        value_heads: int = 1,
    ) -> None:
        super().__init__()
        if role_adapters and lora is None:
            raise ValueError(f"role_adapters={list(role_adapters)} are LoRA adapters on a shared base: give lora "
                             "(--lora_rank > 0)")
        self.role_adapters = tuple(role_adapters)
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.precision = resolve_precision(dtype, self.device, low_precision_weights)
        self.dtype_name = dtype
        self.lora = lora
        self.reference_dir = Path(reference_dir) if reference_dir is not None else self.model_dir
        # A frozen LoRA base needs no fp32 master copy: it is stored in the compute dtype (peft keeps
        # the adapters in fp32).
        base_dtype = self.precision.weights if lora is None else self.precision.compute
        causal_lm = load_causal_lm(model_dir, base_dtype, self.device)
        self.tokenizer = load_tokenizer(model_dir)
        if gradient_checkpointing:
            # transformers 5.24 renamed it activation checkpointing; the old name warns there
            enable = getattr(causal_lm, "activation_checkpointing_enable", causal_lm.gradient_checkpointing_enable)
            enable({"use_reentrant": False})
        self.model = causal_lm if lora is None else self._with_adapters(causal_lm, lora, with_critic, self.role_adapters)
        hidden_size = causal_lm.config.get_text_config().hidden_size
        if value_heads < 1:
            raise ValueError(f"value_heads={value_heads} must be >= 1 (one per role for per-role critics)")
        self.value_head = nn.Linear(hidden_size, value_heads, device=self.device) if with_critic else None
        self._trainable = [p for p in self.parameters() if p.requires_grad]
        # with role adapters the shared actor adapter stays frozen (peft's switches would unfreeze it)
        self._frozen_adapter = [p for name, p in self.named_parameters()
                                if self.role_adapters and f".{ACTOR_ADAPTER}." in name]
        object.__setattr__(self, "_reference", None)  # not a submodule: no state_dict/parameters/optimizer
        self._units: list[nn.Module] | None = None  # FSDP2 units once fully_shard ran, the policy last
        self.eval()

    @staticmethod
    def _with_adapters(causal_lm: PreTrainedModel, lora: LoraSettings, with_critic: bool,
                       role_adapters: tuple[str, ...]) -> nn.Module:
        """The actor adapter, the critic's, and one per role (each role then acts and learns through its own;
        the shared actor adapter stays frozen at zero: the base)."""
        from peft import get_peft_model

        peft_model = get_peft_model(causal_lm, lora.peft_config())
        extra = ((CRITIC_ADAPTER,) if with_critic else ()) + role_adapters
        for adapter in extra:
            peft_model.add_adapter(adapter, lora.peft_config())
        for name, param in peft_model.named_parameters():  # peft creates inactive adapters frozen
            if any(f".{adapter}." in name for adapter in extra):
                param.requires_grad_(True)
            elif role_adapters and f".{ACTOR_ADAPTER}." in name:
                param.requires_grad_(False)
        return peft_model

    # ---------------------------------------------------------------------------------------------
    # Views of the model
    # ---------------------------------------------------------------------------------------------

    @property
    def causal_lm(self) -> PreTrainedModel:
        """The HF model (with LoRA layers injected when LoRA is on); what generate() and save() use."""
        return self.model if self.lora is None else self.model.get_base_model()

    @property
    def with_critic(self) -> bool:
        return self.value_head is not None

    @property
    def sharded(self) -> bool:
        """Whether ``fully_shard`` split the weights over the ranks."""
        return self._units is not None

    def fully_shard(self, mesh) -> None:
        """FSDP2 over ``mesh`` (a 1-D DeviceMesh of the data-parallel ranks): each decoder layer one unit,
        then the policy itself (embeddings, final norm, lm_head, value head). Weights, gradients and the
        optimizer state are split over the ranks; a layer's weights are gathered for its forward and
        backward, so every rank must run the same number of forward and backward passes (the runner
        pads with zero-loss ones). Build the optimizer after this: the parameters are new objects.

        The code outside ``forward`` that calls the model (generation, values, saving) runs inside
        ``gathered()``. Full fine-tuning only: LoRA's few trainable weights gain nothing from it (DDP)."""
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        if self.lora is not None:
            raise ValueError("fully_shard shards full fine-tuning; a LoRA policy trains with DDP "
                             "(--data_parallel ddp)")
        units = [fully_shard(layer, mesh=mesh) for layer in self.causal_lm.get_decoder().layers]
        units.append(fully_shard(self, mesh=mesh))
        if dist.get_backend(mesh.get_group()) == "gloo":  # gloo has no average: reduce-scatter a sum, divide after
            for unit in units:
                unit.set_force_sum_reduction_for_comms(True)
        self._units = units
        pad = self.tokenizer.pad_token_id
        with torch.no_grad():  # FSDP takes the first module run as its root: the policy, not a layer
            self([[pad]], [[pad]], with_entropy=False)
        self.reshard()  # a root keeps its weights gathered after a forward without backward
        self._trainable = [p for p in self.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Whole weights on every rank in the enclosed code (no-op unless sharded): generation, values
        and reference scores then run any number of passes, different on each rank, without collectives.
        Every rank enters and leaves together; inside, no gradients and no ``state_dict``."""
        if not self.sharded:
            yield
            return
        layers = self._units[:-1]
        for unit in self._units:
            unit.unshard()
        for layer in layers:
            layer.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for layer in layers:
                layer.set_reshard_after_forward(True, recurse=False)
            for unit in self._units:
                unit.reshard()

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for forward passes: matmuls in the compute dtype, master weights as stored."""
        return torch.autocast(self.device.type, dtype=self.precision.compute,
                              enabled=self.precision.autocast_enabled)

    def actor_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of the policy: the actor adapter (LoRA) or the whole trunk."""
        critic_ids = {id(p) for p in self.critic_parameters()}
        return [p for p in self._trainable if id(p) not in critic_ids]

    def critic_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters only the value loss reaches: the critic adapter and the value head."""
        if self.value_head is None:
            return []
        adapter = [p for name, p in self.model.named_parameters() if f".{CRITIC_ADAPTER}." in name] if self.lora else []
        return adapter + list(self.value_head.parameters())

    def param_groups(self, lr: float, critic_lr: float | None = None) -> list[dict]:
        """Optimizer groups: actor at ``lr``, critic at ``critic_lr`` (default ``lr``)."""
        groups = [{"params": self.actor_parameters(), "lr": lr, "name": "actor"}]
        if self.with_critic:
            groups.append({"params": self.critic_parameters(), "lr": lr if critic_lr is None else critic_lr,
                           "name": "critic"})
        return groups

    @contextlib.contextmanager
    def using_adapter(self, name: str | None) -> Iterator[None]:
        """Runs the enclosed forward with LoRA adapter ``name`` active (None: adapters off, the base model).

        peft's switches also set requires_grad=False on inactive adapters, which would silently drop
        their gradients from graphs built earlier (AccumulateGrad skips leaves that no longer require
        grad); every trainable parameter is made trainable again on the way in and out.
        """
        switch = self.model.disable_adapter() if name is None else contextlib.nullcontext()
        try:
            if name is not None:
                self.model.set_adapter(name)
            with switch:
                self._restore_trainable()
                yield
        finally:
            self.model.set_adapter(ACTOR_ADAPTER)
            self._restore_trainable()

    def _restore_trainable(self) -> None:
        for param in self._trainable:
            param.requires_grad_(True)
        for param in self._frozen_adapter:
            param.requires_grad_(False)

    # ---------------------------------------------------------------------------------------------
    # Forward passes
    # ---------------------------------------------------------------------------------------------

    def _hidden_at_actions(self, causal_lm: PreTrainedModel, batch: PackedBatch | SharedPromptBatch) -> torch.Tensor:
        """``[B, L, H]`` final hidden states at the positions that predict each action token."""
        if isinstance(batch, SharedPromptBatch):
            return self._hidden_after_shared_prompts(causal_lm, batch)
        with self.autocast():
            hidden = causal_lm.get_decoder()(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False,
            ).last_hidden_state  # [B, T, H]
        index = batch.read_positions[..., None].expand(-1, -1, hidden.shape[-1])
        return hidden.gather(1, index)

    def _hidden_after_shared_prompts(self, causal_lm: PreTrainedModel, batch: SharedPromptBatch) -> torch.Tensor:
        """``_hidden_at_actions`` with each distinct prompt run once: the prompts' pass fills a KV cache, its
        rows are repeated for the rows that continue each prompt (an index, so gradients flow back to the one
        prompt pass), and the actions run on top. G rows per prompt cost one prompt instead of G."""
        decoder = causal_lm.get_decoder()
        keyword = kv_cache_keyword(decoder)  # the forward's cache keyword is also its output's field
        positions = torch.arange(batch.action_ids.shape[1], device=self.device)[None]  # [1, L]
        prompt_lengths = batch.prompt_mask.sum(1)[batch.prompt_of_row]  # [B]
        with self.autocast():
            prompted = decoder(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask,
                               position_ids=(batch.prompt_mask.cumsum(1) - 1).clamp(min=0), use_cache=True)
            cache = getattr(prompted, keyword)
            cache.batch_select_indices(batch.prompt_of_row)
            acted = decoder(input_ids=batch.action_ids,
                            attention_mask=torch.cat([batch.prompt_mask[batch.prompt_of_row],
                                                      batch.action_mask.long()], 1),
                            position_ids=prompt_lengths[:, None] + positions,
                            **{keyword: cache}, use_cache=True).last_hidden_state  # [B, L, H]
        last_prompt = prompted.last_hidden_state[batch.prompt_of_row, -1:]  # [B, 1, H] predicts action token 0
        return torch.cat([last_prompt, acted[:, :-1]], 1)

    def _token_scores(self, causal_lm: PreTrainedModel, hidden: torch.Tensor, batch: PackedBatch,
                      temperature: float, with_entropy: bool) -> ActionScores:
        """Log-probs (and entropies) of the action tokens from their ``[B, L, H]`` hidden states
        (``models.scoring``: the vocabulary projection in row chunks, never on all ``T`` positions)."""
        return token_scores(causal_lm.get_output_embeddings(), hidden, batch.action_ids, batch.action_mask,
                            temperature, with_entropy, self.autocast)

    @property
    def num_value_heads(self) -> int:
        """Outputs of the value head: 1, or one per role (per-role critics on a shared trunk)."""
        return 0 if self.value_head is None else self.value_head.out_features

    def _values(self, hidden: torch.Tensor, mask: torch.Tensor, heads: Sequence[int] | None = None) -> torch.Tensor:
        """``[B, L]`` values from ``[B, L, H]`` hidden states, row b read from value head ``heads[b]``
        (None: head 0); the head runs in fp32."""
        self._require_critic()
        values = self.value_head(hidden.float())  # [B, L, K]
        if heads is None:
            values = values[..., 0]
        else:
            rows = torch.arange(len(values), device=values.device)
            values = values[rows, :, torch.as_tensor(list(heads), dtype=torch.long, device=values.device)]
        return torch.where(mask, values, 0.0)

    def _require_critic(self) -> None:
        if self.value_head is None:
            raise ValueError("this policy has no critic; construct it with with_critic=True")

    def _critic_hidden(self, batch: PackedBatch | SharedPromptBatch) -> torch.Tensor:
        self._require_critic()
        if self.lora is None:
            return self._hidden_at_actions(self.causal_lm, batch)
        with self.using_adapter(CRITIC_ADAPTER):
            return self._hidden_at_actions(self.causal_lm, batch)

    def pack(self, prompts: TokenBatch, actions: TokenBatch,
             padding_side: str = "right") -> PackedBatch | SharedPromptBatch:
        """The rows for one pass: a ``SharedPromptBatch`` when prompts repeat (not when sharded, where every
        rank must run the same passes, nor under activation checkpointing, which runs without a KV cache),
        else one packed batch padded on ``padding_side``."""
        pad_id = self.tokenizer.pad_token_id
        if not self.sharded and not checkpoints_activations(self.causal_lm):
            shared = pack_shared(prompts, actions, pad_id, self.device)
            if shared is not None:
                return shared
        return pack(prompts, actions, pad_id, self.device, padding_side)

    def evaluate(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0, *,
                 with_entropy: bool = True, with_values: bool = False,
                 padding_side: str = "right", adapters: Sequence[str] | None = None,
                 critic_prompts: TokenBatch | None = None, value_heads: Sequence[int] | None = None) -> ActionScores:
        """Scores ``actions`` given ``prompts``: one forward pass (two with a LoRA critic) per group of rows
        of similar packed length (``_pass_rows``), so short rows are not padded to the longest, and a prompt
        that several rows continue runs once (``SharedPromptBatch``).

        ``temperature`` divides the logits, so log-probs are those of the distribution the sampler
        drew from (top-p/top-k filtering is not re-applied). Returns ``[B, L]`` tensors, L = longest action.
        ``adapters`` [B]: the role adapter each row acts with (passes of their own per adapter; a row's
        gradient reaches only its own adapter). Values: ``critic_prompts`` [B] what the critic reads instead
        of ``prompts`` (a centralized critic's joint transcript; a pass of its own), ``value_heads`` [B] the
        head each row's value is read from.
        """
        size = len(token_lengths(prompts))
        rows_of: dict[str | None, list[int]] = {}
        for row, adapter in enumerate(adapters if adapters is not None else [None] * size):
            rows_of.setdefault(adapter, []).append(row)
        passes = [(adapter, bucket) for adapter, rows in rows_of.items()
                  for bucket in self._pass_rows(prompts, actions, rows)]
        if len(passes) == 1 and passes[0][0] is None:
            return self._evaluate_pass(prompts, actions, temperature, with_entropy, with_values, padding_side,
                                       critic_prompts, value_heads)
        parts = []
        for adapter, rows in passes:
            with self.using_adapter(adapter) if adapter is not None else contextlib.nullcontext():
                parts.append((rows, self._evaluate_pass(
                    take(prompts, rows), take(actions, rows), temperature, with_entropy, with_values, padding_side,
                    None if critic_prompts is None else take(critic_prompts, rows),
                    None if value_heads is None else [value_heads[row] for row in rows])))
        return ActionScores.interleave(parts, size)

    def _pass_rows(self, prompts: TokenBatch, actions: TokenBatch, rows: list[int]) -> list[list[int]]:
        """``rows`` cut into the passes that cost least (``length_buckets``), the rows that continue one
        prompt kept in one pass so that its prompt runs once there; one pass when sharded."""
        if self.sharded:
            return [rows]
        lengths = [p + a for p, a in zip(token_lengths(prompts), token_lengths(actions))]
        _, prompt_of_row = distinct_rows(token_rows(take(prompts, rows)))
        groups: dict[int, list[int]] = {}
        for row, prompt in zip(rows, prompt_of_row):
            groups.setdefault(prompt, []).append(row)
        members = list(groups.values())
        buckets = length_buckets([max(lengths[row] for row in group) for group in members])
        return [[row for group in bucket for row in members[group]] for bucket in buckets]

    def _evaluate_pass(self, prompts: TokenBatch, actions: TokenBatch, temperature: float, with_entropy: bool,
                       with_values: bool, padding_side: str, critic_prompts: TokenBatch | None,
                       value_heads: Sequence[int] | None) -> ActionScores:
        """``evaluate``'s scores of every row in one packed forward pass, with the active adapter."""
        batch = self.pack(prompts, actions, padding_side)
        hidden = self._hidden_at_actions(self.causal_lm, batch)
        scores = self._token_scores(self.causal_lm, hidden, batch, temperature, with_entropy)
        if with_values and critic_prompts is not None:
            scores.values = self.token_values(critic_prompts, actions, padding_side, value_heads)
        elif with_values:
            critic_hidden = hidden if self.lora is None else self._critic_hidden(batch)
            scores.values = self._values(critic_hidden, batch.action_mask, value_heads)
        return scores

    def forward(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0, *,
                with_entropy: bool = True, with_values: bool = False, adapters: Sequence[str] | None = None,
                critic_prompts: TokenBatch | None = None, value_heads: Sequence[int] | None = None) -> ActionScores:
        """``evaluate``, as the module's call: what DDP wraps, so data-parallel training reduces the
        gradients of these scores over ranks."""
        return self.evaluate(prompts, actions, temperature, with_entropy=with_entropy, with_values=with_values,
                             adapters=adapters, critic_prompts=critic_prompts, value_heads=value_heads)

    def token_values(self, prompts: TokenBatch, actions: TokenBatch, padding_side: str = "right",
                     heads: Sequence[int] | None = None) -> torch.Tensor:
        """``[B, L]`` token-level values V(prompt, a_<k) (TPPO); 0 past each action's end. ``heads`` [B]:
        the value head of each row (None: head 0)."""
        batch = self.pack(prompts, actions, padding_side)
        return self._values(self._critic_hidden(batch), batch.action_mask, heads)

    def values(self, prompts: TokenBatch, heads: Sequence[int] | None = None) -> torch.Tensor:
        """``[B]`` action-level values V(prompt), read at the last prompt token (``heads`` as ``token_values``)."""
        empty_actions = [[] for _ in range(len(prompts[1] if isinstance(prompts, tuple) else prompts))]
        batch = self.pack(prompts, empty_actions)
        first = torch.ones_like(batch.action_mask[:, :1])
        return self._values(self._critic_hidden(batch)[:, :1], first, heads).squeeze(1)

    @torch.no_grad()
    def ref_log_probs(self, prompts: TokenBatch, actions: TokenBatch, temperature: float = 1.0,
                      padding_side: str = "right") -> torch.Tensor:
        """``[B, L]`` log-probs under the reference policy (for KL), 0 where the action mask is False."""
        batch = self.pack(prompts, actions, padding_side)
        if self.lora is not None:
            with self.using_adapter(None):
                hidden = self._hidden_at_actions(self.causal_lm, batch)
            return self._token_scores(self.causal_lm, hidden, batch, temperature, with_entropy=False).logprobs
        reference = self._reference_model()
        hidden = self._hidden_at_actions(reference, batch)
        return self._token_scores(reference, hidden, batch, temperature, with_entropy=False).logprobs

    def _reference_model(self) -> PreTrainedModel:
        """The frozen starting weights, loaded on first use so runs without KL never hold a copy."""
        if self._reference is None:
            reference = load_causal_lm(self.reference_dir, self.precision.weights, self.device, "reference_dir").eval()
            reference.requires_grad_(False)
            object.__setattr__(self, "_reference", reference)
        return self._reference

    # ---------------------------------------------------------------------------------------------
    # Weights out: inference engines and checkpoints
    # ---------------------------------------------------------------------------------------------

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()`` with whole tensors. Sharded (FSDP2) every rank must call it together: the
        shards are all-gathered, and every rank gets every tensor."""
        if not self.sharded:
            return self.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True))
        first_name: dict[int, str] = {}
        for name, param in self.named_parameters(remove_duplicate=False):  # tied weights: gathered apart,
            whole[name] = whole[first_name.setdefault(id(param), name)]  # made one tensor again as in state_dict()
        return whole

    def full_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the causal LM's state dict, the value head's) with whole tensors (sharded: ``whole_state_dict``,
        which every rank calls together)."""
        if not self.sharded:
            return self.causal_lm.state_dict(), self.value_head.state_dict() if self.value_head is not None else {}
        parts: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        for name, tensor in self.whole_state_dict().items():
            owner, _, leaf = name.partition(".")
            parts[owner == "value_head"][leaf] = tensor
        return parts

    def named_weights_for_inference(self, tensors: dict[str, torch.Tensor] | None = None,
                                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` of the current actor weights in plain HF names, LoRA merged (``tensors``:
        the causal LM's from ``full_tensors``, when the caller has them already).

        Merging is computed per layer (W + delta), never written into the model, so repeated syncs do
        not accumulate merge/unmerge rounding. Tensors are detached views except merged layers (new).
        Tied weights appear under both names (HF loaders and vLLM skip the tied duplicate).
        """
        causal_lm = self.causal_lm
        for name, tensor in (tensors if tensors is not None else self.full_tensors()[0]).items():
            if "lora_" in name:
                continue
            module_name, _, leaf = name.rpartition(".")
            if module_name.endswith(".base_layer") and leaf == "weight":  # a LoRA model: peft is loaded
                from peft.tuners.lora import LoraLayer

                lora_layer = causal_lm.get_submodule(module_name.rsplit(".", 1)[0])
                if isinstance(lora_layer, LoraLayer) and ACTOR_ADAPTER in lora_layer.lora_A:
                    tensor = tensor + lora_layer.get_delta_weight(ACTOR_ADAPTER).to(tensor.dtype)
            yield hf_param_name(name), tensor.detach()

    def save(self, out_dir: str | Path,
             tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None) -> Path:
        """Saves a directory that plain ``AutoModelForCausalLM.from_pretrained`` and vLLM load (merged
        actor weights + tokenizer at top level) and that ``LanguagePolicy.load`` restores exactly
        (LoRA adapters in ``adapters/``, value head in ``critic/``, settings in ``mathrl_policy.json``).
        ``tensors``: ``full_tensors()`` when the caller gathered them (sharded: every rank gathers, one writes)."""
        actor, head = tensors if tensors is not None else self.full_tensors()
        out = self.save_inference_weights(out_dir, actor)
        self.tokenizer.save_pretrained(out)
        if self.lora is not None:
            self.model.save_pretrained(out / ADAPTER_DIR)
        if self.value_head is not None:
            (out / VALUE_HEAD_FILE).parent.mkdir(exist_ok=True)
            save_file({k: v.detach().contiguous() for k, v in head.items()}, out / VALUE_HEAD_FILE)
        meta = {"lora": asdict(self.lora) if self.lora else None, "with_critic": self.with_critic,
                "value_heads": max(self.num_value_heads, 1),
                "reference_dir": str(self.reference_dir), "role_adapters": list(self.role_adapters)}
        (out / POLICY_META).write_text(json.dumps(meta, indent=2))
        return out

    def save_inference_weights(self, out_dir: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """The actor's weights as plain HF safetensors (LoRA merged, tied weights once) and its config
        (``tensors``: the causal LM's ``full_tensors``, when the caller has them)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.causal_lm.save_pretrained(out, state_dict=dict(self.named_weights_for_inference(tensors)))
        return out

    def save_actor_adapter(self, out_dir: str | Path) -> Path:
        """The actor's LoRA adapter alone, in peft's layout (``adapter_config.json`` and
        ``adapter_model.safetensors``): what vLLM hot-loads as a LoRA adapter."""
        if self.lora is None:
            raise ValueError("save_actor_adapter needs a LoRA policy (lora_rank > 0); this one trains all weights")
        self.model.save_pretrained(out_dir, selected_adapters=[ACTOR_ADAPTER])
        return Path(out_dir)

    def save_role_adapters(self, out_dir: str | Path) -> dict[str, Path]:
        """Each role's LoRA adapter alone, in peft's layout, in ``out_dir/<role>/`` (peft writes every adapter
        but the actor's into a folder of its name): what vLLM loads as one LoRA per role. Returns
        {role: its folder}."""
        if not self.role_adapters:
            raise ValueError("save_role_adapters needs a policy with role adapters (--noshare_policy --lora_rank > 0 "
                             "on a multi-agent env); this one has none")
        self.model.save_pretrained(out_dir, selected_adapters=list(self.role_adapters))
        return {role: Path(out_dir) / role for role in self.role_adapters}

    @classmethod
    def load(cls, checkpoint_dir: str | Path, **kwargs) -> "LanguagePolicy":
        """Restores a policy written by ``save`` (device/dtype/gradient_checkpointing via ``kwargs``).

        With LoRA the top-level weights are base + delta; the base is recovered by subtracting the saved
        adapter's delta, so the checkpoint directory alone suffices (reference = that base).
        """
        path = Path(checkpoint_dir)
        meta_file = path / POLICY_META
        if not meta_file.is_file():
            raise FileNotFoundError(f"{meta_file} not found: {path} is not a LanguagePolicy.save() directory; "
                                    "use LanguagePolicy(path) to start from plain HF weights")
        meta = json.loads(meta_file.read_text())
        lora = None
        if meta["lora"]:
            lora_fields = dict(meta["lora"])
            if isinstance(lora_fields["target_modules"], list):
                lora_fields["target_modules"] = tuple(lora_fields["target_modules"])
            lora = LoraSettings(**lora_fields)
        policy = cls(path, lora=lora, with_critic=meta["with_critic"], reference_dir=meta["reference_dir"],
                     role_adapters=meta.get("role_adapters", ()), value_heads=meta.get("value_heads", 1), **kwargs)
        if lora is not None:
            policy._restore_adapters(path / ADAPTER_DIR)
        if policy.value_head is not None:
            policy.value_head.load_state_dict(load_file(path / VALUE_HEAD_FILE, device=str(policy.device)))
        return policy

    @torch.no_grad()
    def _restore_adapters(self, adapters_dir: Path) -> None:
        """Loads saved adapter weights, then turns the merged top-level weights back into the base."""
        from peft import set_peft_model_state_dict
        from peft.tuners.lora import LoraLayer

        adapter_files = {ACTOR_ADAPTER: adapters_dir / "adapter_model.safetensors"}
        for adapter in ((CRITIC_ADAPTER,) if self.with_critic else ()) + self.role_adapters:
            adapter_files[adapter] = adapters_dir / adapter / "adapter_model.safetensors"
        for adapter, file in adapter_files.items():
            set_peft_model_state_dict(self.model, load_file(file, device=str(self.device)), adapter_name=adapter)
        for module in self.causal_lm.modules():
            if isinstance(module, LoraLayer) and ACTOR_ADAPTER in module.lora_A:
                weight = module.get_base_layer().weight
                weight -= module.get_delta_weight(ACTOR_ADAPTER).to(weight.dtype)
        self._restore_trainable()
