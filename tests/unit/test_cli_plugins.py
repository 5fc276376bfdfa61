"""`sweeper drill` reaches the CLI through the sweeper.commands entry point group."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from service.commands import parser
from service.commands.check_config import cmd_check_config


def test_the_drill_command_is_registered_through_its_entry_point() -> None:
    args = parser.build_parser().parse_args(["drill", "--list"])
    assert args.command == "drill" and args.list is True
    assert args.func.__module__ == "drills.command"


def test_a_plugin_that_cannot_be_imported_leaves_the_other_commands_working(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    broken = EntryPoint(name="broken", value="no_such_module_here:register",
                        group=parser.PLUGIN_GROUP)
    monkeypatch.setattr(parser, "entry_points", lambda group: [broken])
    args = parser.build_parser().parse_args(["check-config"])
    assert args.func is cmd_check_config
    assert "command 'broken' is unavailable" in capsys.readouterr().err
