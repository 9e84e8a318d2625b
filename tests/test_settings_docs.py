"""Each setting is described once, on its field in ``worker/config.py``: ``docs/settings.md`` and the help of
``berth``'s flags are made from the fields. These tests fail when either drifts from them: a description
edited without ``python -m worker.config``, a flag for a setting written by hand (its own help, names or
default), a field that says it has a flag no command takes, a flag that no field says it has."""

from __future__ import annotations

import click
import pytest

from jobs import cli
from worker.config import DOCS_PATH, SECTIONS, Settings, default_text, flag_group, flag_names, settings_markdown

NOT_GIVEN = (None, getattr(click.core, "UNSET", None))  # an option without a default (click 8.3 says UNSET)


def commands(group: click.Group, prefix: str = "berth"):
    """Every command of ``berth``, with its full name."""
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", command


def setting_flags():
    """(command, option) for every option of every command whose value is a setting."""
    return [(name, param) for name, command in commands(cli.main) for param in command.params
            if isinstance(param, click.Option) and param.name in Settings.model_fields]


def test_docs_are_made_from_the_fields():
    assert DOCS_PATH.read_text() == settings_markdown(), (
        "docs/settings.md differs from the fields of worker/config.py: run `python -m worker.config` "
        "(and describe a setting on its field, not in the file)")


def test_every_setting_is_described_in_a_section():
    fields = list(Settings.model_fields)
    assert fields[0] in SECTIONS and set(SECTIONS) <= set(fields)
    undescribed = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert not undescribed, f"settings without a description: {undescribed}"


def test_a_flag_for_a_setting_is_made_from_its_field():
    flags = setting_flags()
    assert len(flags) > 50  # the engine's flags on seven commands, and more
    for command, option in flags:
        name = option.name
        where = f"`{command}` {'/'.join(option.opts)}"
        assert flag_group(name), f"{where}: its field says no flag (setting(cli=...) in worker/config.py)"
        assert tuple(option.opts + option.secondary_opts) == flag_names(name), f"{where}: not the field's names"
        shown = default_text(name)
        help_text = option.help if option.is_flag or not shown else option.help.removesuffix(f"  [default: {shown}]")
        assert help_text == Settings.model_fields[name].description, \
            f"{where}: its help is not its field's description (and default)"
        assert option.default in NOT_GIVEN, f"{where}: a flag's own default would hide BERTH_{name.upper()}"


def test_every_setting_that_has_a_flag_is_on_a_command():
    on_commands = {option.name for _, option in setting_flags()}
    missing = [name for name in Settings.model_fields if flag_group(name) and name not in on_commands]
    assert not missing, f"settings whose field says a flag that no command takes: {missing}"


@pytest.mark.parametrize("group, command", [("engine", "generate"), ("service", "status"), ("worker", "worker"),
                                            ("serve", "serve")])
def test_a_group_of_flags_is_whole_on_a_command(group, command):
    """A field added to a group of flags is on the commands that take the group, with no other line."""
    taken = {p.name for p in cli.main.commands[command].params}
    assert {name for name in Settings.model_fields if flag_group(name) == group} <= taken


@pytest.mark.parametrize("command", ["submit", "retry", "submit-consumer"])
def test_a_command_that_runs_no_engine_takes_only_the_model_of_its_flags(command):
    """submit and retry listed twenty engine flags that do nothing there: only the model's name and file
    check their lines."""
    taken = {p.name for p in cli.main.commands[command].params}
    engine = {name for name in Settings.model_fields if flag_group(name) == "engine"}
    assert taken & engine == {"model", "model_name"}
