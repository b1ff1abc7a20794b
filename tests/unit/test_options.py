"""One table of flags makes the command lines and the settings the Python API reads."""

from __future__ import annotations

import dataclasses

import pytest

from collective import config
from collective.errors import UsageError
from collective.options import (
    CHIEF_FLAGS,
    WORKER_FLAGS,
    ChiefSettings,
    WorkerSettings,
    chief_parser,
    worker_parser,
)

ROLES = [(ChiefSettings, chief_parser, CHIEF_FLAGS), (WorkerSettings, worker_parser, WORKER_FLAGS)]
ENV = {"COLLECTIVE_JOIN_TIMEOUT": "7", "COLLECTIVE_SHM": "false", "COLLECTIVE_TOKEN": "t0k",
       "COLLECTIVE_TLS_CA": "/ca.pem", "COLLECTIVE_LOG_FORMAT": "json", "COLLECTIVE_WORKERS": "3",
       "COLLECTIVE_CHUNK_BYTES": "64KiB", "COLLECTIVE_RANK": "2", "COLLECTIVE_DEVICES": "cpu:0,cpu:1"}


@pytest.mark.parametrize(("settings", "parser", "flags"), ROLES, ids=["chief", "worker"])
def test_the_settings_class_has_a_field_per_flag_and_the_parser_an_option_per_flag(settings, parser, flags):
    fields = [f.name for f in dataclasses.fields(settings)]
    assert fields == [f.dest for f in flags]
    options = {a.dest for a in parser()._actions if a.dest != "help"}
    assert options == set(fields)


@pytest.mark.parametrize(("settings", "parser", "flags"), ROLES, ids=["chief", "worker"])
@pytest.mark.parametrize("env", [{}, ENV], ids=["defaults", "environment"])
def test_settings_from_the_environment_are_what_the_command_line_parses_with_no_arguments(settings, parser, flags, env):
    with config.reading({k: v for k, v in env.items() if k[len("COLLECTIVE_"):].lower().replace("_", "-")
                         in {f.name for f in flags}}):
        parsed = vars(parser().parse_args([]))
    assert dataclasses.asdict(settings.from_env(env)) == parsed


def test_a_bad_variable_is_named_and_a_skipped_one_is_not_read():
    with pytest.raises(UsageError, match="environment variable COLLECTIVE_CHUNK_BYTES='lots'"):
        ChiefSettings.from_env({"COLLECTIVE_CHUNK_BYTES": "lots"})
    with pytest.raises(UsageError, match="COLLECTIVE_TOPOLOGY='ring': not one of auto, star, tree, chain"):
        ChiefSettings.from_env({"COLLECTIVE_TOPOLOGY": "ring"})
    assert ChiefSettings.from_env({"COLLECTIVE_CHUNK_BYTES": "lots"}, skip=("chunk-bytes",)).chunk_bytes is None


def test_no_parser_takes_an_abbreviated_option(capsys):
    """`launch --devices 2` was silently `--devices-per-worker 2`: every parser refuses a prefix."""
    from collective.cli import build_parser
    from collective.mpi import build_parser as mpi_parser

    cases = [(build_parser(), ["launch", "--devices", "2"]), (build_parser(), ["status", "--int", "2"]),
             (build_parser(), ["doctor", "--time", "2"]), (chief_parser(), ["--work", "2"]),
             (worker_parser(), ["--dev", "cpu:0"]), (mpi_parser(), ["--devices", "2"])]
    for parser, argv in cases:
        with pytest.raises(SystemExit) as info:
            parser.parse_args(argv)
        assert info.value.code == 2
        assert f"unrecognized arguments: {' '.join(argv[-2:])}" in capsys.readouterr().err
    assert build_parser().parse_args(["launch", "--devices-per-worker", "2"]).devices_per_worker == 2
