"""Every command-line flag of train_math.py, defined once per section; flags only parse.

Each section of ``train.config.RunConfig`` (model, env, generation, rollouts, rewards, algorithm, PRIME,
multi-agent, Prefix-RL, services, distributed, budget, logging) generates its flags
(``train.options.define_flags``), registered under the section's name for --helpfull, so a field's default and help
are written once. absl checks each value's type, choices and declared bounds; every other check is
``train.validation.validate``'s, which a config built in code goes through too, before any model is loaded or heavy
module imported, so a wrong path, a bad value or a contradictory combination fails at once naming the flag and the
fix. After parsing, train_math.py resolves --resume first (``--resume auto`` looks in the experiment directory the
flags name, ``experiment_dir``); ``inherit`` then gives every flag the command line left out its value in that
checkpoint; only then is the RunConfig built, once, validated and with the values that depend on others resolved
(``config_from_flags``). No flag changes after that.

OpenR's flags keep their names and meanings (``--dataset_path``, ``--model_name_or_path``,
``--prm_model_name_or_path``, ``--algorithm_name``, ``--num_mini_batch``, ``--ppo_epoch``, ...), so
OpenR's ``train_math.py`` command runs unchanged.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from absl import flags

from train.config import RunConfig, sections
from train.options import SECRET_MASK, define_flags, masked, section_from_flags
from train.validation import APPLIES_TO

FLAGS = flags.FLAGS
SECTIONS = {"model": "model", "data and env": "env", "generation": "generation",
            "rollouts (dynamic sampling, cut-off answers, rollout correction)": "rollout", "rewards": "rewards",
            "algorithm": "learning", "PRIME (RLOO)": "prime", "multi-agent": "multi_agent", "Prefix-RL": "prefix_rl",
            "services": "services", "distributed": "distributed", "budget": "budget",
            "logging and checkpoints": "logging"}
"""--helpfull's sections, in reading order: {title: the RunConfig section whose options they are}."""


def section_module(section: str) -> str:
    """The module name a RunConfig section's flags are registered under (absl groups flags by module)."""
    return f"{__name__}.{section}"


for _section, _kind in sections().items():
    define_flags(_kind, section_module(_section))
for _name, _algorithms in APPLIES_TO.items():  # a flag only some algorithms read says which in its help
    FLAGS[_name].help += f" [{'/'.join(_algorithms)} only]"

NEWCOMER_FLAGS = {
    "model": ("model_name_or_path", "prompt_template", "device"),
    "data": ("dataset_path", "env_id"),
    "algorithm": ("algorithm_name", "reward", "lr", "group_size"),
    "budget": ("num_env_steps", "n_rollout_threads", "max_new_tokens"),
    "logging": ("logdir", "eval_interval", "resume"),
}
"""--help's flags: the ones a first run needs, grouped."""

HELP_FLAGS = {"--help": False, "-help": False, "-h": False, "-?": False, "--helpshort": False, "--helpfull": True,
              "-helpfull": True}
"""Help flags on the command line: {flag: whether it asks for every flag}."""


def section_flags(section: str) -> list[flags.Flag]:
    """The flags of the RunConfig section ``section``, by name."""
    return sorted(FLAGS.get_flags_for_module(section_module(section)), key=lambda flag: flag.name)


def describe(flag: flags.Flag) -> str:
    """One flag's help: its name, what it does, and its default."""
    name = f"--[no]{flag.name}" if isinstance(flag, flags.BooleanFlag) else f"--{flag.name}"
    text = textwrap.fill(f"{name}: {flag.help}", width=100, initial_indent="  ", subsequent_indent="      ")
    if flag.default is None and "Default:" in flag.help:  # the help says what it resolves to
        return text
    return f"{text}\n      (default: {flag.default_as_str or flag.default})"


def help_text(usage: str, full: bool) -> str:
    """--help (the newcomer's flags, grouped) or --helpfull (every flag, by section) under ``usage``."""
    if full:
        groups = {title: section_flags(section) for title, section in SECTIONS.items()}
        tail = ("absl's own flags also apply: --flagfile=FILE reads flags from FILE (one per line); --verbosity, "
                "--logtostderr and the rest of absl.logging's.")
    else:
        groups = {title: [FLAGS[name] for name in names] for title, names in NEWCOMER_FLAGS.items()}
        tail = "--helpfull lists every flag, by section."
    parts = [usage.strip(), ""]
    for title, members in groups.items():
        parts += [f"{title}:", *(describe(flag) for flag in members), ""]
    return "\n".join([*parts, tail, ""])


def flag_dict(flag_values: flags.FlagValues = FLAGS) -> dict:
    """{name: value} of every flag the sections define (saved with checkpoints, logged as TensorBoard text),
    a secret one (--service_api_key) as ``SECRET_MASK``."""
    found = [flag for section in SECTIONS.values()
             for flag in flag_values.get_flags_for_module(section_module(section))]
    return {flag.name: masked(flag.name, flag.value) for flag in sorted(found, key=lambda flag: flag.name)}


def inherit(saved: dict, flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """Resuming: every flag not given on this command line takes its value in the checkpoint's ``saved``
    flags (a ``flag_dict``), so a resumed run trains as the run it continues unless told otherwise.
    A flag the checkpoint lacks (added since) keeps its default; one it has that no longer exists is
    skipped, and so is a secret one (saved masked: a resume takes the key from its flag or environment
    variable again). Returns the names whose value changed; absl checks their bounds and choices again."""
    inherited = []
    for name, value in saved.items():
        if name == "resume" or name not in flag_values or flag_values[name].present or value == SECRET_MASK:
            continue
        if flag_values[name].value != value:
            flag_values[name].value = value
            inherited.append(name)
    flag_values.validate_all_flags()
    return inherited


def given_config(flag_values: flags.FlagValues = FLAGS) -> RunConfig:
    """The sections as the flags give them, nothing resolved yet."""
    return RunConfig(**{name: section_from_flags(section, flag_values) for name, section in sections().items()},
                     flags=flag_dict(flag_values))


def config_from_flags(flag_values: flags.FlagValues = FLAGS) -> RunConfig:
    """Every flag validated and resolved once into a RunConfig (``train.resolve.resolved``, as for a config built
    in code). Raises flags.ValidationError (a usage error) with the message naming the flag and the fix."""
    from train.resolve import resolved  # here: the env and model layers load once the flags have parsed

    try:
        return resolved(given_config(flag_values))
    except ValueError as error:
        raise flags.ValidationError(str(error)) from None


def experiment_dir(flag_values: flags.FlagValues = FLAGS) -> Path:
    """<logdir>/<experiment> as the flags name it: where ``--resume auto`` looks for the run to continue,
    before that run's flags are inherited and the config is built."""
    from train.resolve import experiment_name, registered_env_id

    given = given_config(flag_values)
    try:
        env_id = registered_env_id(given.env.env_id, given.env.dataset_path)
    except ValueError as error:
        raise flags.ValidationError(str(error)) from None
    return Path(given.logging.logdir) / experiment_name(given, env_id)
