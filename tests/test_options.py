"""Options: a config field's default and help written once, the absl flag generated from them."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import pytest
from absl import flags

from algorithms.options import flag_name, option, options
from train.config import EnvConfig, RunConfig
from train.options import define_flags, section_from_flags


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Section:
    count: int = option(3, "How many.", lower_bound=1)
    rate: float = option(0.5, "How fast.")
    colour: Colour = option(Colour.RED, "Which colour.", flag="paint", aliases={"crimson": "red"})
    label: str | None = option(None, "A label. Default: resolved from --count.")
    verbose: bool = option(True, "Say more.")
    names: tuple[str, ...] = option((), "A name (repeatable).", flag="name")
    derived: int = field(default=0)  # not an option: no flag


def parsed(*argv: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    define_flags(Section, "toy_module", flag_values)
    flag_values(["prog", *argv])
    return flag_values


def test_flags_are_generated_from_the_fields_with_their_defaults_and_help():
    flag_values = parsed()
    assert sorted(flag_values.get_flags_for_module("toy_module"), key=lambda f: f.name) == [
        flag_values[name] for name in ("count", "label", "name", "paint", "rate", "verbose")]
    assert flag_values["paint"].help == "<blue|crimson|red>: Which colour." and flag_values["paint"].default == "red"
    assert "derived" not in flag_values
    assert section_from_flags(Section, flag_values, label="3 red") == Section(label="3 red")


def test_a_section_takes_the_parsed_values_enums_as_members():
    section = section_from_flags(Section, parsed("--count=7", "--paint=blue", "--noverbose", "--rate=0.25",
                                                 "--name=a", "--name=b"))
    assert section == Section(count=7, rate=0.25, colour=Colour.BLUE, verbose=False, names=("a", "b"))
    assert section.colour is Colour.BLUE


def test_an_alias_of_an_enum_choice_reads_as_its_member_in_any_case():
    assert section_from_flags(Section, parsed("--paint=Crimson")).colour is Colour.RED
    assert section_from_flags(Section, parsed("--paint=BLUE")).colour is Colour.BLUE


@pytest.mark.parametrize("argv", [["--count=0"], ["--paint=green"], ["--rate=fast"]])
def test_bounds_choices_and_types_are_checked_at_parse_time(argv):
    with pytest.raises(flags.Error):
        parsed(*argv)


def test_an_option_of_an_unsupported_type_is_refused_at_definition():
    @dataclass(frozen=True)
    class Bad:
        pairs: dict = option(None, "Not a flag type.")

    with pytest.raises(TypeError, match=r"Bad.pairs: an option is a bool, int, float, str, tuple\[str, ...\] or Enum"):
        define_flags(Bad, "bad_module", flags.FlagValues())


RUN_SECTIONS = {part.name: type(getattr(RunConfig(), part.name)) for part in dataclasses.fields(RunConfig)
                if dataclasses.is_dataclass(getattr(RunConfig(), part.name))}


@pytest.mark.parametrize("name", RUN_SECTIONS)
def test_every_section_built_from_its_flags_defaults_is_its_own_default(name):
    """A flag's default is its field's: parsing no flag gives each RunConfig section its dataclass defaults."""
    section = RUN_SECTIONS[name]
    flag_values = flags.FlagValues()
    define_flags(section, name, flag_values)
    flag_values(["prog"])
    assert options(section) and section_from_flags(section, flag_values) == section()


def test_every_train_math_flag_is_one_option_of_one_section():
    """No flag is defined outside the options (so none has a second default), and each --helpfull section
    is one RunConfig section."""
    from train.flags import FLAGS, SECTIONS, section_module

    by_module = {section: {flag.name for flag in FLAGS.get_flags_for_module(section_module(section))}
                 for section in SECTIONS.values()}
    by_section = {name: {flag_name(field) for field in options(section)} for name, section in RUN_SECTIONS.items()}
    assert sorted(SECTIONS.values()) == sorted(RUN_SECTIONS) and by_module == by_section


def test_the_tool_options_help_names_the_env_defaults():
    """--max_tool_calls, --max_tool_response_length and --tool_timeout default to the env's own (None); their help
    names those values, which live in envs.math_env (too heavy to import where the flags are defined)."""
    from envs.math_env import MAX_TOOL_CALLS, MAX_TOOL_OUTPUT_CHARS, TOOL_TIMEOUT_S

    helps = {field.name: field.metadata["help"] for field in options(EnvConfig)}
    for name, default in (("max_tool_calls", MAX_TOOL_CALLS), ("max_tool_output_chars", MAX_TOOL_OUTPUT_CHARS),
                          ("tool_timeout", TOOL_TIMEOUT_S)):
        assert helps[name].endswith(f"Default: the env's ({default:g})."), helps[name]
