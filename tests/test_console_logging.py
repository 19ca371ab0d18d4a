"""`dgr -q` / `dgr -v`: the root options set what the project's loggers print on stderr."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from dgr.console import setup_logging, verbosity_level
from dgr.main import app


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    root = logging.getLogger()
    for h in [h for h in root.handlers if h.get_name() == "dgr-console"]:
        root.removeHandler(h)
    for name in ("dgr", "meshnet_adapter"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def _emit_through(args: list[str], capsys) -> str:
    """Run the root command with ``args`` (its callback configures logging), then log one line
    per level from a logic module's logger and return what reached stderr."""
    r = CliRunner().invoke(app, [*args, "pin", "--help"])
    assert r.exit_code == 0, r.output
    capsys.readouterr()
    lg = logging.getLogger("dgr.route.local")
    lg.debug("debug-line")
    lg.info("info-line")
    lg.warning("warning-line")
    return capsys.readouterr().err


def test_default_shows_info_not_debug(capsys):
    err = _emit_through([], capsys)
    assert "info-line" in err and "warning-line" in err and "debug-line" not in err


def test_quiet_shows_no_info_lines(capsys):
    for flag in ("-q", "--quiet"):
        err = _emit_through([flag], capsys)
        assert "info-line" not in err and "debug-line" not in err and "warning-line" in err


def test_verbose_shows_debug_with_the_logger_name(capsys):
    for flag in ("-v", "--verbose"):
        err = _emit_through([flag], capsys)
        assert "debug-line" in err and "info-line" in err and "dgr.route.local" in err


def test_quiet_wins_over_verbose_and_setup_is_idempotent():
    assert verbosity_level(True, True) == logging.WARNING
    setup_logging(logging.INFO)
    setup_logging(logging.INFO)
    assert sum(h.get_name() == "dgr-console" for h in logging.getLogger().handlers) == 1


def test_third_party_loggers_keep_their_level(capsys):
    _emit_through(["-v"], capsys)
    logging.getLogger("some.library").info("library-info")
    assert "library-info" not in capsys.readouterr().err


def test_results_on_stdout_are_unchanged_by_quiet():
    plain = CliRunner().invoke(app, ["pin", "--help"])
    quiet = CliRunner().invoke(app, ["-q", "pin", "--help"])
    assert plain.exit_code == quiet.exit_code == 0 and plain.stdout == quiet.stdout
