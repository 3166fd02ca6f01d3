"""FSDP2 sharding of ``LanguagePolicy`` (its base class): each decoder layer one unit, the policy the root;
a start in which only rank 0 reads the weights and the other ranks build on the meta device; whole
weights on every rank inside ``gathered()`` for the passes that run outside ``forward``."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn


def builds_empty(weights_from_rank0: bool, lora: object | None) -> bool:
    """Whether this process builds the model on the meta device (no weights read) and receives its shards
    from rank 0 in ``fully_shard``: with ``weights_from_rank0``, on every rank but 0."""
    if not weights_from_rank0:
        return False
    if lora is not None:
        raise ValueError("weights_from_rank0 is for FSDP2 full fine-tuning; a LoRA policy (DDP) reads its weights "
                         "on every rank: pass weights_from_rank0=False")
    if not dist.is_initialized():
        raise ValueError("weights_from_rank0=True needs a process group (torchrun, then init_process_group); "
                         "without one pass weights_from_rank0=False")
    return dist.get_rank() != 0


class ShardedPolicy:
    """The sharding of ``LanguagePolicy``: reads the policy's modules (``causal_lm``), its settings
    (``lora``, ``tokenizer``, ``device``), ``_weights_from_rank0`` and keeps ``_units`` (None until sharded)."""

    _units: list[nn.Module] | None

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
        ``gathered()``. Full fine-tuning only: LoRA's few trainable weights gain nothing from it (DDP).
        Built with ``weights_from_rank0``, rank 0 broadcasts the weights it read into every rank's shards.
        """
        from torch.distributed.fsdp import fully_shard

        if self.lora is not None:
            raise ValueError("fully_shard shards full fine-tuning; a LoRA policy trains with DDP "
                             "(--data_parallel ddp)")
        whole = self.state_dict() if self._weights_from_rank0 and dist.get_rank() == 0 else None
        units = [fully_shard(layer, mesh=mesh) for layer in self.causal_lm.get_decoder().layers]
        units.append(fully_shard(self, mesh=mesh))
        if dist.get_backend(mesh.get_group()) == "gloo":  # gloo has no average: reduce-scatter a sum, divide after
            for unit in units:
                unit.set_force_sum_reduction_for_comms(True)
        self._units = units
        if self._weights_from_rank0:
            self._receive_weights(whole, mesh.get_group())
        del whole  # rank 0's whole copy: freed before the first pass
        pad = self.tokenizer.pad_token_id
        with torch.no_grad():  # FSDP takes the first module run as its root: the policy, not a layer
            self([[pad]], [[pad]], with_entropy=False)
        self.reshard()  # a root keeps its weights gathered after a forward without backward
        self._trained_parameters = [p for p in self.parameters() if p.requires_grad]

    def _receive_weights(self, whole: dict[str, torch.Tensor] | None, group: dist.ProcessGroup) -> None:
        """Fills every rank's shards from rank 0's ``whole`` state dict (None elsewhere: those ranks' weights
        are on the meta device until now) and every buffer from rank 0's (rotary frequencies are buffers
        outside the state dict)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if whole is None:
            self.to_empty(device=self.device)
        set_model_state_dict(self, whole if whole is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for buffer in self.buffers():
            dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)

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
