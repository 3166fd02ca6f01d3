"""A policy's weights out: whole tensors from FSDP2 shards, plain HF weights with LoRA merged (what
inference engines load), and the checkpoint directory ``LanguagePolicy.save`` writes and ``load`` reads
(merged weights and tokenizer at top level, LoRA adapters, value head, settings)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

ACTOR_ADAPTER = "default"  # peft's name for the first adapter; the one vLLM and save() merge
CRITIC_ADAPTER = "critic"
POLICY_META = "mathrl_policy.json"
ADAPTER_DIR = "adapters"  # peft layout: actor adapter here, critic adapter in adapters/critic/
VALUE_HEAD_FILE = "critic/value_head.safetensors"  # a subfolder: vLLM globs top-level *.safetensors
WRAPPER_PREFIXES = ("base_model.model.", "module.", "_orig_mod.")


def hf_param_name(name: str) -> str:
    """Plain HF parameter name: wrapper prefixes (peft, DDP, torch.compile) and peft's ``.base_layer`` removed."""
    name = name.replace("._orig_mod.", ".").replace(".base_layer.", ".")
    while name.startswith(WRAPPER_PREFIXES):
        name = name[len(next(p for p in WRAPPER_PREFIXES if name.startswith(p))):]
    return name



def cast_floating(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype``; tensors that share storage (tied weights) stay one tensor, which
    save_pretrained then writes once."""
    cast: dict[tuple[int, torch.Size], torch.Tensor] = {}
    out = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            key = (tensor.data_ptr(), tensor.shape)
            if key not in cast:
                cast[key] = tensor.to(dtype)
            tensor = cast[key]
        out[name] = tensor
    return out


class PolicyWeights:
    """The weight export of ``LanguagePolicy`` (its base class): reads the policy's modules (``causal_lm``,
    ``model``, ``value_head``), its settings (``lora``, ``with_critic``, ``role_adapters``...) and ``sharded``."""

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

    def save(self, out_dir: str | Path, tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
             dtype: torch.dtype | None = None) -> Path:
        """Saves a directory that plain ``AutoModelForCausalLM.from_pretrained`` and vLLM load (merged
        actor weights + tokenizer at top level) and that ``LanguagePolicy.load`` restores exactly
        (LoRA adapters in ``adapters/``, value head in ``critic/``, settings in ``mathrl_policy.json``).
        ``tensors``: ``full_tensors()`` when the caller gathered them (sharded: every rank gathers, one writes);
        ``dtype``: the HF weights' (None: as the policy holds them; LoRA adapters and value head stay as held)."""
        actor, head = tensors if tensors is not None else self.full_tensors()
        out = self.save_inference_weights(out_dir, actor, dtype)
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

    def save_inference_weights(self, out_dir: str | Path, tensors: dict[str, torch.Tensor] | None = None,
                               dtype: torch.dtype | None = None) -> Path:
        """The actor's weights as plain HF safetensors (LoRA merged, tied weights once) and its config
        (``tensors``: the causal LM's ``full_tensors``, when the caller has them; ``dtype``: the weights'
        floating dtype, None: as held)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        weights = dict(self.named_weights_for_inference(tensors))
        if dtype is not None:
            weights = cast_floating(weights, dtype)
        self.causal_lm.save_pretrained(out, state_dict=weights)
        if dtype is not None:  # save_pretrained records the model's dtype, not the file's
            config = json.loads((out / "config.json").read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
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
        self._restore_requires_grad()
