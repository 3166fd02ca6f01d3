"""Options: a config field that declares a user option once, its default, help text and flag name beside it.

    clip_param: float = option(0.2, "PPO ratio clip epsilon.")
    backend: Backend = option(Backend.HF, "Generation backend.", flag="generation_backend")

A dataclass of such fields is a section of a run's configuration; ``train.options.define_flags`` generates
one absl flag per field from it, and ``train.validation`` checks its bounds in a config built in code. Plain
dataclasses, so the algorithms' own hyper-parameters (``algorithms.config``), which RunConfig's sections
extend, are declared here at the bottom of the house, read before torch or absl is imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def option(default: Any, help: str, *, flag: str | None = None, lower_bound: float | None = None,
           upper_bound: float | None = None, aliases: dict[str, str] | None = None, secret: bool = False) -> Any:
    """A dataclass field that is also a command-line flag: ``default`` and ``help`` written once;
    ``flag``: the flag's name when it differs from the field's (OpenR compatibility); bounds checked at
    parse time, and in a config built in code by ``train.validation``; ``secret``: a key, never in a repr,
    a log or a checkpoint. A field whose type is an Enum takes its members' values as the flag's choices,
    and ``aliases`` ({other name: member value}) as further ones, matched case-insensitively."""
    metadata = {"help": help, "flag": flag, "lower_bound": lower_bound, "upper_bound": upper_bound,
                "aliases": aliases or {}, "secret": secret}
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


def options(section: type) -> list[dataclasses.Field]:
    """The fields of ``section`` (a dataclass) declared with ``option``, in declaration order (a base class's
    first)."""
    return [field for field in dataclasses.fields(section) if "help" in field.metadata]


def flag_name(field: dataclasses.Field) -> str:
    """The flag an ``option`` field generates: ``flag=`` where given, else the field's name."""
    return field.metadata["flag"] or field.name
