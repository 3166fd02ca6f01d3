"""A config's modes are its Enums' members, checked once at the edge: the flags take their choices from
the Enum types, and ``train.validation`` holds a RunConfig built in code to the same choices. float16
training is refused on both paths, naming the fix."""

from __future__ import annotations

import pytest
from absl import flags

from envs.modes import Critic, DType, LossAgg, PrmType, Tool
from train.config import (FLOAT16_TRAINING, EnvConfig, LearningConfig, LoggingConfig, ModelConfig, RewardConfig,
                          RunConfig)
from train.flags import FLAGS, config_from_flags
from train.resolve import resolved
from train.validation import checked_modes


def parsed(*argv: str) -> flags.FlagValues:
    """The global flags parsed from ``argv`` (validators run); unparsed again by the caller's fixture."""
    FLAGS.unparse_flags()
    FLAGS(["train_math", *argv])
    return FLAGS


@pytest.fixture(autouse=True)
def unparsed_flags():
    yield
    FLAGS.unparse_flags()


def test_modes_given_as_strings_become_members_aliases_included():
    config = checked_modes(RunConfig(learning=LearningConfig(loss_agg_mode="seq_mean", critic="on"),
                                     rewards=RewardConfig(prm_type="MS"), env=EnvConfig(tools="python"),
                                     logging=LoggingConfig(save_dtype="float16")))
    assert config.learning.loss_agg_mode is LossAgg.SEQ_MEAN_TOKEN_MEAN
    assert config.learning.critic is Critic.ON
    assert config.rewards.prm_type is PrmType.SHEPHERD
    assert config.env.tools is Tool.PYTHON
    assert config.logging.save_dtype is DType.FLOAT16
    assert config.env.env_id is None and checked_modes(RunConfig()) == RunConfig()


@pytest.mark.parametrize(("config", "message"), [
    (RunConfig(learning=LearningConfig(scale_rewards="std")),
     "LearningConfig.scale_rewards='std' (--scale_rewards) must be one of group, batch, none"),
    (RunConfig(env=EnvConfig(tools="bash")), "EnvConfig.tools='bash' (--tools) must be one of python, none"),
    (RunConfig(env=EnvConfig(env_kwargs='{"tools": "bash"}')),
     "tools='bash' must be one of 'python', 'none' (--tools, or the env's 'tools' keyword)"),
    (RunConfig(rewards=RewardConfig(prm_type="orm")),
     "RewardConfig.prm_type='orm' (--prm_type) must be one of shepherd, classifier, ms, qwen"),
])
def test_a_mode_outside_its_choices_is_refused_naming_them(config, message):
    with pytest.raises(ValueError) as error:
        resolved(config)
    assert str(error.value) == message


def test_float16_training_is_refused_in_code_with_the_fix():
    with pytest.raises(ValueError) as error:
        resolved(RunConfig(model=ModelConfig(dtype="float16")))
    assert str(error.value) == f"ModelConfig.dtype='float16' (--dtype): {FLOAT16_TRAINING}"
    assert FLOAT16_TRAINING.endswith("use --dtype bfloat16 (or float32)")


def test_float16_training_is_refused_from_flags_and_float16_exports_are_not():
    with pytest.raises(flags.ValidationError) as error:
        config_from_flags(parsed("--dtype", "float16"))
    assert str(error.value) == f"ModelConfig.dtype='float16' (--dtype): {FLOAT16_TRAINING}"
    assert config_from_flags(parsed("--dtype", "bfloat16", "--save_dtype", "float16")).logging.save_dtype == "float16"


def test_an_optional_enum_option_takes_its_choices_and_none_by_default():
    assert FLAGS["save_dtype"].default is None and FLAGS["tools"].default is None
    assert FLAGS["save_dtype"].parser.enum_values == ["float32", "bfloat16", "float16"]
    assert FLAGS["tools"].parser.enum_values == ["python", "none"]
    with pytest.raises(flags.IllegalFlagValueError, match="value should be one of <python|none>"):
        parsed("--tools", "bash")
