"""Options: a config field's default and help written once, the absl flag generated from them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import pytest
from absl import flags

from train.options import define_flags, option, section_from_flags


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Section:
    count: int = option(3, "How many.", lower_bound=1)
    rate: float = option(0.5, "How fast.")
    colour: Colour = option(Colour.RED, "Which colour.", flag="paint")
    label: str | None = option(None, "A label. Default: resolved from --count.")
    verbose: bool = option(True, "Say more.")
    derived: int = field(default=0)  # not an option: no flag


def parsed(*argv: str) -> flags.FlagValues:
    flag_values = flags.FlagValues()
    define_flags(Section, "toy_module", flag_values)
    flag_values(["prog", *argv])
    return flag_values


def test_flags_are_generated_from_the_fields_with_their_defaults_and_help():
    flag_values = parsed()
    assert sorted(flag_values.get_flags_for_module("toy_module"), key=lambda f: f.name) == [
        flag_values[name] for name in ("count", "label", "paint", "rate", "verbose")]
    assert flag_values["paint"].help == "<red|blue>: Which colour." and flag_values["paint"].default == "red"
    assert "derived" not in flag_values
    assert section_from_flags(Section, flag_values, label="3 red") == Section(label="3 red")


def test_a_section_takes_the_parsed_values_enums_as_members():
    section = section_from_flags(Section, parsed("--count=7", "--paint=blue", "--noverbose", "--rate=0.25"))
    assert section == Section(count=7, rate=0.25, colour=Colour.BLUE, verbose=False)
    assert section.colour is Colour.BLUE


@pytest.mark.parametrize("argv", [["--count=0"], ["--paint=green"], ["--rate=fast"]])
def test_bounds_choices_and_types_are_checked_at_parse_time(argv):
    with pytest.raises(flags.Error):
        parsed(*argv)


def test_an_option_of_an_unsupported_type_is_refused_at_definition():
    @dataclass(frozen=True)
    class Bad:
        pairs: dict = option(None, "Not a flag type.")

    with pytest.raises(TypeError, match=r"Bad.pairs: an option is a bool, int, float, str or Enum"):
        define_flags(Bad, "bad_module", flags.FlagValues())
