"""The model layer of train/: Hugging Face loading, devices and dtypes, padding, the trainable LanguagePolicy and the generation backends that sample from it."""
