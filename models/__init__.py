"""The model layer: Hugging Face loading (local directories and hub ids), devices and dtypes,
padding, prompts through chat templates, the trainable LanguagePolicy (LoRA, per-role adapters,
critic), memory-lean token scoring, the generation backends that sample from it (HF, vLLM
in-process, vLLM server) and the service clients. It may import envs/ and algorithms/ below it;
reward_models/ and train/ build on it and are never imported from it (tests/test_layers.py checks
the order). The tiny-model build is its subpackage models.tiny."""
