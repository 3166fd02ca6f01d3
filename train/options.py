"""The absl flags generated from options (``algorithms.options.option``: a field with its own default and help).

A section of ``train.config.RunConfig`` declares each user option once::

    temperature: float = option(0.5, "Sampling temperature for rollouts.")
    backend: Backend = option(Backend.HF, "Generation backend.", flag="generation_backend")

``define_flags(GenerationConfig, "train.flags.generation")`` (train/flags.py, for each section) defines
``--temperature`` and ``--generation_backend`` from those fields, so ``RunConfig()`` and
``train_math.py`` without flags start from the same values by construction. ``flag=`` keeps OpenR's
flag name where the field's name is clearer; an Enum type (``X`` or ``X | None``) gives the flag its choices
(``aliases``: other names it accepts, case-insensitive), and ``with_members`` holds a config built in code
to the same choices; a ``tuple[str, ...]`` field is a repeatable flag. A default of None
means "resolved from other options" (the help says to what); ``train.resolve`` resolves it.
``secret=True`` (a key) keeps the value out of the field's repr, and its flag's value out of what a run
logs and saves (``masked``).

Light on purpose (absl, dataclasses, enum): flags are defined and checked before torch is imported.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
from typing import Any

from absl import flags

from algorithms.options import flag_name, options

SECRET_MASK = "<hidden>"
"""What a secret flag's value is logged and saved as (when it has one)."""
SECRET_FLAGS: set[str] = set()
"""The names of the flags of ``secret`` options defined so far."""

DEFINE = {"bool": flags.DEFINE_boolean, "int": flags.DEFINE_integer, "float": flags.DEFINE_float,
          "str": flags.DEFINE_string, "tuple[str, ...]": flags.DEFINE_multi_string}
"""absl's definer for each annotated field type (``X | None`` reads as X)."""


def masked(name: str, value: Any) -> Any:
    """A flag's value as logs and checkpoints may hold it: ``SECRET_MASK`` for a secret flag with a value."""
    return SECRET_MASK if name in SECRET_FLAGS and value else value


def define_flags(section: type, module_name: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines one absl flag per ``option`` field of ``section`` in ``flag_values``, registered as
    ``module_name``'s (so --helpfull lists them under that module's section)."""
    for field in options(section):
        name, help_, default = flag_name(field), field.metadata["help"], field.default
        if field.metadata["secret"]:
            SECRET_FLAGS.add(name)
        kind = enum_of(section, field)
        if kind is not None:
            aliases = field.metadata["aliases"]
            choices = [member.value for member in kind]
            flags.DEFINE_enum(name, None if default is None else default.value,
                              sorted([*choices, *aliases]) if aliases else choices, help_,
                              case_sensitive=not aliases, module_name=module_name, flag_values=flag_values)
            continue
        kind = field.type.split(" | ")[0].strip()
        if kind not in DEFINE:
            raise TypeError(f"{section.__name__}.{field.name}: an option is a bool, int, float, str, "
                            f"tuple[str, ...] or Enum (got {field.type!r})")
        bounds = {key: field.metadata[key] for key in ("lower_bound", "upper_bound")
                  if field.metadata[key] is not None}
        default = list(default) if isinstance(default, tuple) else default
        DEFINE[kind](name, default, help_, module_name=module_name, flag_values=flag_values, **bounds)


def enum_of(section: type, field: dataclasses.Field) -> type[enum.Enum] | None:
    """The Enum an option holds (its type ``X`` or ``X | None``, looked up in the module of the class of
    ``section``'s bases that declares it), or None."""
    if isinstance(field.default, enum.Enum):
        return type(field.default)
    owner = next(kind for kind in section.__mro__ if field.name in inspect.get_annotations(kind))
    kind = vars(sys.modules[owner.__module__]).get(field.type.split(" | ")[0].strip())
    return kind if isinstance(kind, type) and issubclass(kind, enum.Enum) else None


def member(section: type, field: dataclasses.Field, value: Any) -> Any:
    """``value`` of an Enum option as its member: a member, its value, or an alias (any case); None stays
    None. Raises ValueError naming the option, the value and the choices."""
    kind = enum_of(section, field)
    if value is None or isinstance(value, kind):
        return value
    aliases = field.metadata["aliases"]
    try:
        return kind(aliases.get(str(value).lower(), value))
    except ValueError:
        choices = ", ".join([*(choice.value for choice in kind), *aliases])
        raise ValueError(f"{section.__name__}.{field.name}={value!r} (--{flag_name(field)}) must be one of "
                         f"{choices}") from None


def with_members(config: Any) -> Any:
    """``config`` (a section) with each Enum option as its member, so the modes are checked once, at the
    edge, for a config built in code as for one from flags. Raises ValueError as ``member``."""
    section = type(config)
    values = {field.name: member(section, field, getattr(config, field.name)) for field in options(section)
              if enum_of(section, field) is not None}
    return dataclasses.replace(config, **values)


def section_from_flags(section: type, flag_values: flags.FlagValues, **resolved: Any) -> Any:
    """``section`` with each ``option`` field taken from its flag (an Enum field as its member), and the
    fields in ``resolved`` (values worked out from other flags, or not user options) as given."""
    values = {}
    for field in options(section):
        value = flag_values[flag_name(field)].value
        if enum_of(section, field) is not None:
            value = member(section, field, value)
        elif isinstance(field.default, tuple):
            value = tuple(value)
        values[field.name] = value
    return section(**{**values, **resolved})
