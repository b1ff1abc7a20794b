"""One table of flags makes the command lines and the settings the Python API reads."""

from __future__ import annotations

import dataclasses
import os
import re

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


def test_collective_version_prints_the_package_version(capsys):
    from importlib import metadata

    from collective.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"collective {metadata.version('collective')}\n"


def test_an_unknown_option_gets_its_subcommands_usage_and_the_option_meant(capsys):
    """`launch --devices 2` printed the top-level usage and no hint."""
    from collective.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["launch", "--devices", "2"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: collective launch "), err
    assert err.endswith("collective launch: error: unrecognized arguments: --devices 2 "
                        "(--devices: did you mean --devices-per-worker?)\n"), err
    with pytest.raises(SystemExit):
        worker_parser().parse_args(["--chief=h:1", "--devcies", "cpu:0"])
    assert "(--devcies: did you mean --devices?)" in capsys.readouterr().err


def _commands():
    """Every command's parser as the options page finds them (tools.docgen.commands), and the
    top-level ``collective`` one; bench (collective/bench, not the package's flag table) aside."""
    from collective.cli import build_parser
    from tools.docgen import commands

    yield "collective", build_parser()
    for title, _, parser in commands():
        if title != "bench":
            yield title, parser


def _package_classes() -> set[str]:
    """The names of the classes the package defines that read as a class name (two capitals:
    ChiefService, WorkerAgent, TlsFiles), not as a word."""
    import ast
    import re

    from tests.procs import ROOT

    names = set()
    for path in (ROOT / "collective").rglob("*.py"):
        names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return {n for n in names if re.fullmatch(r"_?[A-Z][a-z0-9]+[A-Z]\w*", n)}


def test_no_help_shows_markup_or_names_an_internal_class():
    """`collective --help` printed ``collective``, and mpi's named ChiefService and WorkerAgent:
    a help text is plain words for a user, not the docs' markup or the code's class names."""
    import re

    classes = _package_classes()
    assert {"ChiefService", "WorkerAgent"} <= classes
    markup = re.compile(r"``|`[^`]+`|:(?:class|func|meth|mod|attr|param|py):|\*\*\w")
    checked = 0
    for title, parser in _commands():
        text = parser.format_help()
        checked += 1
        assert not markup.search(text), f"{title} --help shows markup: {markup.search(text).group()!r}\n{text}"
        named = sorted(c for c in classes if re.search(rf"\b{re.escape(c)}\b", text))
        assert not named, f"{title} --help names the internal class(es) {named}\n{text}"
    assert checked >= 9  # collective, chief, launch, status, logs, fetch, doctor, mpi, worker


def test_a_help_text_with_markup_or_a_class_name_would_be_caught():
    """The check above is not vacuous: the old mpi description fails it."""
    import re

    old = "Rank 0 loads the model, runs ChiefService behind the MPI driver. Ranks 1..N run WorkerAgent."
    assert [c for c in _package_classes() if re.search(rf"\b{c}\b", old)]


def test_every_option_of_every_command_comes_from_the_one_flag_table():
    """Flags were written three times (options, launch's in cli.py, mpi.py's) with help texts
    that differed: now each command's options are the table's entries, help text included."""
    import argparse

    from collective.options import CHIEF_TLS, FLAGS

    for title, parser in _commands():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            flag = getattr(action, "flag", None)
            assert flag is not None, f"{title}: {action.option_strings[0]} is not made from the flag table"
            entry = next((f for f in CHIEF_TLS if title == "chief" and f.name == flag.name), FLAGS[flag.name])
            words = re.sub(r"\\\{\w+\\\}", ".*", re.escape(entry.help))  # a command's own words in braces
            assert re.fullmatch(words, flag.help), f"{title}: --{flag.name} has a help text of its own: {flag.help!r}"


def test_no_option_is_defined_twice():
    """One definition per option, in options.FLAGS: no Flag(...) or add_argument("--...") anywhere
    else in the package; the only names defined twice are the three TLS files, whose meaning
    differs between the chief that serves (CHIEF_TLS) and a caller (worker, doctor, fetch). The
    benchmark (collective/bench: a measuring tool, not one of the service's commands) keeps its
    own options, as the help check above leaves it out."""
    import ast
    from collections import Counter

    from tests.procs import ROOT

    defined, elsewhere = Counter(), []
    for path in (ROOT / "collective").rglob("*.py"):
        if (ROOT / "collective" / "bench") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if name == "Flag":
                defined[first] += 1
                if path.name != "options.py":
                    elsewhere.append(f"{where} Flag({first!r})")
            elif name in ("add_argument", "add_option") and isinstance(first, str) and first.startswith("--") \
                    and first != "--version":
                elsewhere.append(f"{where} {name}({first!r})")
    assert not elsewhere, "options defined outside the flag table (collective/options.py):\n" + "\n".join(elsewhere)
    twice = {n: c for n, c in defined.items() if c > 1}
    assert twice == {"tls-ca": 2, "tls-cert": 2, "tls-key": 2}, twice
    assert None not in defined  # every definition names its option literally


def test_fetch_tells_a_fetcher_about_holders_not_the_chief():
    """`collective fetch --help` told a fetcher its certificate must be signed like the chief's
    and carry the worker id."""
    from collective.cli import build_parser

    parser = dict(_commands())["fetch"]
    text = " ".join(parser.format_help().split())
    assert "each holder's certificate" in text and "this fetcher's own certificate" in text
    assert "chief" not in text.replace("the chief (or a holder)", "") and "worker id" not in text
    assert build_parser()  # the fetch parser is the one collective builds


@pytest.mark.parametrize("env", [{"COLLECTIVE_TRANSPORT": "foo"}, {"COLLECTIVE_WORKERS": "x"},
                                 {"COLLECTIVE_LOG_LEVEL": "loud"}, {"COLLECTIVE_TOPOLOGY": "ring"}])
def test_a_bad_environment_value_is_one_line_of_one_form_naming_the_variable(env):
    """`COLLECTIVE_TRANSPORT=foo` was reported as `--transport 'foo'`, in a log line; the log
    level's error began a third way."""
    import subprocess
    import sys

    from tests.procs import ROOT

    clean = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    proc = subprocess.run([sys.executable, "-m", "collective.cli", "launch"], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    [(name, value)] = env.items()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: environment variable {name}={value!r}: "), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("argv", [["--version"], ["logs", "--help"], ["launch", "--workers", "1", "--transport", "grpc",
                                                                    "--quiet", "--json"]])
def test_a_bad_environment_value_is_refused_only_by_a_command_that_takes_it(argv):
    """A bad `COLLECTIVE_TRANSPORT` broke every command, `--version` and `logs` included, since
    the environment was parsed when the parsers were built; an option given on the command line
    overrides it as any default."""
    import subprocess
    import sys

    from tests.procs import ROOT

    clean = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    proc = subprocess.run([sys.executable, "-m", "collective.cli", *argv], env={**clean, "COLLECTIVE_TRANSPORT": "foo"},
                          capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "COLLECTIVE_TRANSPORT" not in proc.stderr, proc.stderr


def test_the_options_reference_hides_what_help_hides():
    from tools.docgen import generate

    text = generate()
    assert "SUPPRESS" not in text and "`--no-table`" not in text


def test_the_compose_files_topology_comment_names_every_topology():
    from collective.topology import TOPOLOGIES
    from tests.procs import ROOT

    lines = (ROOT / "docker-compose.yml").read_text().splitlines()
    [i] = [i for i, line in enumerate(lines) if line.strip().startswith("COLLECTIVE_TOPOLOGY:")]
    comment = lines[i - 1]
    assert comment.strip().startswith("#") and all(t in comment for t in TOPOLOGIES), comment
    assert "16 MiB" not in comment  # auto is a time model, not a size threshold


def test_the_options_page_finds_every_command_without_a_list():
    """docgen had a hand list of commands, so a new one would have been missing from the page:
    it now walks every module `python -m` runs and every subcommand of `collective`."""
    import argparse

    from collective.cli import build_parser
    from tools.docgen import commands

    found = [(title, prog) for title, prog, _ in commands()]
    titles = [t for t, _ in found]
    [subs] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(subs.choices) <= set(titles), (sorted(subs.choices), titles)
    assert {"chief", "worker", "mpi"} <= set(titles) and len(titles) == len(set(titles)), titles
    assert ("mpi", "mpiexec -n N+1 python -m collective.mpi") in found


BIG = "9" * 5000  # past the 4,300 digits Python reads from text


@pytest.mark.parametrize(("argv", "env", "says"), [
    (["collective.chief", "--workers", BIG], {}, "is not a whole number"),
    (["collective.chief", "--workers", "-" + BIG[:4000]], {}, "must be at least 1"),
    (["collective.chief", "--workers", "2", "--join-timeout", "x" * 5000], {}, "is not a number of seconds"),
    (["collective.chief", "--workers", "2", "--bind", "127.0.0.1:" + BIG], {}, "is not HOST:PORT"),
    (["collective.worker", "--chief", "127.0.0.1:" + BIG], {}, "is not HOST:PORT"),
    (["collective.chief"], {"COLLECTIVE_WORKERS": BIG}, "is not a whole number"),
], ids=["int", "negative-int", "seconds", "bind", "chief", "environment"])
def test_a_5000_character_value_is_quoted_cut_in_its_one_line_error(argv, env, says):
    """`positive_int` echoed a 5,000-digit value whole into its one line (6,286 bytes of stderr;
    5,170 through COLLECTIVE_WORKERS) and `parse_address` ended in a ValueError traceback (exit
    1: int() reads at most 4,300 digits): now one line quoting its first 80 characters and its
    length, exit 2."""
    import subprocess
    import sys

    from tests.procs import ROOT

    clean = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    proc = subprocess.run([sys.executable, "-m", *argv], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") <= 1 or proc.stderr.startswith("usage:"), proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert says in last and "characters)" in last and len(last) < 400, last[:2000]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("argv", "env"), [
    (["collective.chief", "--workers", "2", "--join-timeout", "inf"], {}),
    (["collective.chief", "--workers", "2", "--ready-timeout", "1e300"], {}),
    (["collective.worker", "--chief", "127.0.0.1:1", "--heartbeat-timeout", "Infinity"], {}),
    (["collective.chief", "--workers", "2"], {"COLLECTIVE_JOIN_TIMEOUT": "inf"}),
], ids=["inf", "1e300", "worker-infinity", "environment"])
def test_a_wait_of_infinite_or_astronomical_seconds_is_refused(argv, env):
    """`--join-timeout inf` was taken (a chief that waits for ever: no deadline), and 1e300 s
    overflows the waits' clocks; a wait is at most 30 days, said in one line, exit 2."""
    import subprocess
    import sys

    from tests.procs import ROOT

    clean = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    proc = subprocess.run([sys.executable, "-m", *argv], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "more than 2592000 seconds" in last and "Traceback" not in proc.stderr, last


def test_no_name_of_the_cli_package_is_one_of_its_command_modules():
    """``collective.cli`` bound ``logs`` (the event log) while ``collective/cli/logs.py`` is the
    ``collective logs`` command: once a test imported the command, ``collective.cli.logs`` was the
    command module and ``collective bench`` / ``launch`` in that process failed with
    "module 'collective.cli.logs' has no attribute 'configure'" (3 bench tests, in the suite only)."""
    import ast

    from tests.procs import ROOT

    folder = ROOT / "collective" / "cli"
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}
    tree = ast.parse((folder / "__init__.py").read_text())
    bound = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    assert "logs" in modules and not bound & modules, bound & modules
    import collective.cli
    import collective.cli.logs  # noqa: F401 - the command module, imported as the suite does

    assert callable(collective.cli.configure_logs)
