"""The model layer (under reward_models/ and train/): Hugging Face loading, devices and dtypes, padding,
the trainable LanguagePolicy and the generation backends that sample from it."""
