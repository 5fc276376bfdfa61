"""What the `sweeper` command promises in README.md (Commands), checked in process through
`cli.main`: --version, help with defaults, one exit code per kind of failure, one line per
problem and no traceback."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.commands import cli
from service.commands.exits import Exit
from service.commands.parser import HelpFormatter, build_parser, sweeper_version
from tests.conftest import REPO_ROOT


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No SWEEPER_* variable of the machine leaks into these commands, and the logging a
    command configures (onto the captured stderr) is undone after it."""
    for name in list(os.environ):
        if name.startswith("SWEEPER_"):
            monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def sweeper(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `sweeper argv...` in process: (exit code, stdout, stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own exits (--version, --help, usage errors)
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = sweeper(capsys, "--version")
    assert (code, out) == (0, f"sweeper {sweeper_version()}\n")
    assert sweeper_version()[0].isdigit()


def test_the_command_line_loads_no_server() -> None:
    """The parser imports every subcommand's module, which import the app, uvicorn and the
    worker only when their command runs: `sweeper --help`, `run` and `check-config` start
    without them."""
    heavy = ("service.app", "service.http", "service.worker", "uvicorn", "fastapi")
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys; import service.commands.cli; "
         f"print(sorted(m for m in {heavy!r} if m in sys.modules))"],
        capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_every_command_and_option_has_help_with_its_default(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    commands = _subcommands(parser)
    assert {"serve", "worker", "migrate", "check-config", "run", "local", "demo", "drill",
            "openapi"} <= set(commands)
    listed = parser.format_help()
    # what Sweeper is, in a sentence: it was the module docstring's first line, a list of
    # commands cut at `drill,` (credentials, evidence and openapi left out)
    assert parser.description is not None and parser.description.endswith(".")
    assert not any(f" {name}," in parser.description for name in commands)
    for name, command in commands.items():
        assert re.search(rf"^    {re.escape(name)}\s+\w", listed, re.MULTILINE), (
            f"{name} has no help line in `sweeper --help`")
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{label} has no help"
            if action.option_strings:
                shown = HelpFormatter("sweeper")._get_help_string(action) or ""
                assert "default" in shown, f"{label} does not say its default: {shown!r}"
        code, out, _ = sweeper(capsys, name, "--help")
        assert code == 0 and "usage: sweeper " + name in out
    # the epilog documents the exit codes README.md lists
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    for code in Exit:
        assert f"| {code.value} |" in readme, f"README.md does not list exit code {code}"
        assert f"{code.value} " in listed.replace("\n", " ")


def _leaves(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """Each command that runs (`credentials rotate-key`, not `credentials`) and its help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                command = action.choices[choice.dest]
                if any(isinstance(a, argparse._SubParsersAction) for a in command._actions):
                    yield from _leaves(command)
                else:
                    yield command, choice.help or ""


def commands_table(parser: argparse.ArgumentParser) -> str:
    """The markdown table of every command with all its options (argparse's own usage
    line, less -h) and its help: what README.md shows."""
    rows = ["| command | what it does |", "|---|---|"]
    for command, help_text in _leaves(parser):
        formatter = argparse.HelpFormatter(command.prog, width=10_000)  # never wrapped
        formatter.add_usage(command.usage, [a for a in command._actions
                                            if not isinstance(a, argparse._HelpAction)],
                            command._mutually_exclusive_groups, prefix="")
        usage = formatter.format_help().strip()
        cells = (f"`{usage}`", help_text)  # a | in a cell, even in code, ends it unescaped
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def test_the_readme_lists_every_command_with_all_its_options() -> None:
    """README.md's commands table is generated from the parser (it had left out options:
    `local --workers`, `demo --tenants`, `openapi --output`, `run --url` ...); a change to
    either shows here, with the table to paste."""
    expected = commands_table(build_parser())
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("| command | what it does |")
    table = readme[start:readme.index("\n\n", start)]
    assert table == expected, ("README.md's commands table is not the parser's; it reads, "
                               f"from the parser:\n\n{expected}\n")


@pytest.mark.parametrize("argv", [["bogus"], ["serve", "--bogus"], ["run", "--max-items", "x"],
                                  ["serve", "--port", "83639"], ["serve", "--port", "0"],
                                  ["local", "--port", "-1"], ["demo", "--items", "0"], []])
def test_usage_errors_have_their_own_code(capsys: pytest.CaptureFixture[str],
                                          argv: list[str]) -> None:
    code, _, err = sweeper(capsys, *argv)
    assert code == Exit.USAGE
    assert "usage error" in err and "Traceback" not in err


def test_a_port_number_beyond_the_range_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = sweeper(capsys, "serve", "--port", "83639")
    assert "83639 is not a port (1-65535)" in err


def test_a_port_in_use_is_not_a_database_failure(capsys: pytest.CaptureFixture[str],
                                                 busy_port: int) -> None:
    code, _, err = sweeper(capsys, "serve", "--port", str(busy_port))
    assert code == Exit.LISTEN
    assert one_line(err) == (f"sweeper: cannot listen on 127.0.0.1:{busy_port}: "
                             "Address already in use")


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid", "::ffff:zz"])
def test_an_address_not_on_this_host(capsys: pytest.CaptureFixture[str], host: str) -> None:
    code, _, err = sweeper(capsys, "serve", "--host", host, "--port", "8080")
    assert code == Exit.LISTEN
    where = f"[{host}]:8080" if ":" in host else f"{host}:8080"
    assert one_line(err).startswith(f"sweeper: cannot listen on {where}: ")


def test_localhost_binds_its_ipv4_address_as_uvicorn_did() -> None:
    from service.http.serving import listening_socket

    with listening_socket("localhost", 0) as sock:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "127.0.0.1"


async def test_connections_to_our_socket_send_without_delay_on_plain_asyncio() -> None:
    """`sweeper local` serves on the standard event loop, which sets TCP_NODELAY on an
    accepted connection only when the listening socket names IPPROTO_TCP: without it a
    keep-alive client's requests waited out delayed ACKs (~40 ms each)."""
    from service.http.serving import listening_socket

    nodelay: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        nodelay.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock = listening_socket("127.0.0.1", 0)
    server = await asyncio.start_server(accepted, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        for _ in range(100):
            if nodelay:
                break
            await asyncio.sleep(0.01)
        writer.close()
    assert nodelay and nodelay[0] != 0


def test_local_refuses_a_busy_store_port_before_starting_anything(
        capsys: pytest.CaptureFixture[str], busy_port: int) -> None:
    code, _, err = sweeper(capsys, "local", "--port", "1", "--store-port", str(busy_port))
    assert code == Exit.LISTEN  # port 1 needs root or is refused: either way, exit 4
    code, _, err = sweeper(capsys, "local", "--store-port", "8080")
    assert code == Exit.CONFIG and "must differ" in one_line(err)


def test_an_unreadable_tls_certificate_is_one_line(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    monkeypatch.setenv("SWEEPER_TLS_CERT_FILE", str(cert))
    monkeypatch.setenv("SWEEPER_TLS_KEY_FILE", str(key))
    code, _, err = sweeper(capsys, "serve")
    assert code == Exit.CONFIG
    line = one_line(err)
    assert line.startswith("sweeper: configuration error: SWEEPER_TLS_CERT_FILE ")
    assert "not a PEM certificate and its unencrypted private key" in line

    monkeypatch.setenv("SWEEPER_TLS_CERT_FILE", str(tmp_path / "missing.pem"))
    code, _, err = sweeper(capsys, "serve")
    assert code == Exit.CONFIG
    assert one_line(err) == ("sweeper: configuration error: SWEEPER_TLS_CERT_FILE: "
                             f"{tmp_path / 'missing.pem'}: cannot be read (No such file or "
                             "directory)")


def test_drill_with_the_database_down_is_one_line(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/postgres")
    code, _, err = sweeper(capsys, "drill", "all")
    assert code == Exit.DATABASE
    assert one_line(err).startswith(
        "sweeper: database unavailable: cannot reach PostgreSQL at "
        "postgresql://postgres@127.0.0.1:1/postgres")
    code, _, err = sweeper(capsys, "drill", "no-such-drill")
    assert code == Exit.USAGE and "unknown drill" in err


def test_check_config_lists_every_problem_at_once(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    policies = tmp_path / "policies.toml"
    policies.write_text("""
[upstreams.shop]
base_url = "http://127.0.0.1:9"
headers_from_env = { Authorization = "SHOP_AUTH_UNSET" }
timeout_seconds = 10

[policies.carts]
version = 1
upstream = "shop"
path = "/carts/{object_id}"
scope = "tenant:{tenant_id}"
rate = { per_second = 5 }
lease_seconds = 5

[policies.orders]
version = 1
upstream = "warehouse"
path = "/orders/{object_id}"
scope = "tenant:{tenant_id}"
rate = { per_second = 5 }
""")
    monkeypatch.setenv("SWEEPER_POLICIES_FILE", str(policies))
    monkeypatch.setenv("SWEEPER_WORKERS", "-3")
    monkeypatch.setenv("SWEEPER_LOG_LEVEL", "loud")
    monkeypatch.setenv("SWEEPER_WORKRES", "8")
    code, out, err = sweeper(capsys, "check-config")
    assert (code, out) == (Exit.CONFIG, "")
    lines = err.strip().splitlines()
    assert lines == [
        "sweeper: warning: SWEEPER_WORKRES is not a setting Sweeper knows; it is ignored "
        "(did you mean SWEEPER_WORKERS?)",
        "sweeper: configuration error: SWEEPER_WORKERS: Input should be greater than or "
        "equal to 0",
        "sweeper: configuration error: SWEEPER_LOG_LEVEL: log_level must be DEBUG, INFO, "
        "WARNING or ERROR",
        f"sweeper: configuration error: policies file {policies}: "
        "upstreams.shop.headers_from_env.Authorization: environment variable "
        "SHOP_AUTH_UNSET is not set",
        f"sweeper: configuration error: policies file {policies}: policies.carts."
        "lease_seconds: must be longer than upstream 'shop' timeout_seconds (10.0)",
        f"sweeper: configuration error: policies file {policies}: policies.orders.upstream: "
        "unknown upstream 'warehouse'; declared: ['shop']",
    ]
    assert "Value error" not in err


def test_check_config_lists_every_schema_problem(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    policies = tmp_path / "policies.toml"
    policies.write_text('[upstreams.shop]\nbase_ulr = "x"\n\n[policies.carts]\nversoin = 1\n')
    monkeypatch.setenv("SWEEPER_POLICIES_FILE", str(policies))
    code, _, err = sweeper(capsys, "check-config")
    assert code == Exit.CONFIG
    problems = [line.split(f"{policies}: ", 1)[1] for line in err.strip().splitlines()]
    unknown = "unknown key (check the spelling; see docs/configuration.md)"
    assert f"upstreams.shop.base_ulr: {unknown}" in problems
    assert f"policies.carts.versoin: {unknown}" in problems
    assert "upstreams.shop.base_url: required key is missing" in problems
    assert "policies.carts.version: required key is missing" in problems


def test_an_empty_policies_file_variable_means_not_set(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_POLICIES_FILE", "")
    code, out, err = sweeper(capsys, "check-config")
    assert code == Exit.OK
    assert out.startswith("ok: 0 upstream(s), 0 policy(ies)")
    assert one_line(err) == ("sweeper: warning: SWEEPER_POLICIES_FILE is not set: there are "
                             "no policies, so no item can be registered and no webhook "
                             "accepted")


def test_check_config_accepts_the_local_policies(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_POLICIES_FILE",
                       str(REPO_ROOT / "service" / "commands" / "local" / "policies.toml"))
    code, out, err = sweeper(capsys, "check-config")
    assert (code, err) == (Exit.OK, "")
    assert out.startswith("ok: 1 upstream(s), 1 policy(ies), 0 webhook source(s)")
    assert out.rstrip().endswith("evidence exports: signed with the key under .sweeper")


def test_check_config_names_the_evidence_key_and_never_the_secret(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """(Unsigned exports, with a database URL: tests/integration/test_cli.py.)"""
    monkeypatch.setenv("SWEEPER_POLICIES_FILE", "")
    key = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="  # bytes 0..31
    monkeypatch.setenv("SWEEPER_EVIDENCE_SIGNING_KEY", key)
    code, out, err = sweeper(capsys, "check-config")
    assert code == Exit.OK and "evidence exports: signed with key " in out
    assert key not in out + err
    monkeypatch.setenv("SWEEPER_EVIDENCE_SIGNING_KEY", key[:-4])
    code, out, err = sweeper(capsys, "check-config")
    assert code == Exit.CONFIG and "SWEEPER_EVIDENCE_SIGNING_KEY: neither PEM nor base64" in err
    assert key[:-4] not in out + err


def test_run_without_a_token_is_a_configuration_error(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    code, _, err = sweeper(capsys, "run", "--url", "http://127.0.0.1:1")
    assert code == Exit.CONFIG
    assert one_line(err) == ("sweeper: configuration error: SWEEPER_TOKEN (or --token) is "
                             "required to call the API")


def test_serve_warns_about_unknown_variables(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch,
                                             busy_port: int) -> None:
    """`serve` and `worker` log what check-config warns about, then go on (here to the
    busy port's refusal)."""
    monkeypatch.setenv("SWEEPER_WORKRES", "8")
    monkeypatch.setenv("SWEEPER_LOG_FORMAT", "console")
    code, _, err = sweeper(capsys, "serve", "--port", str(busy_port))
    assert code == Exit.LISTEN
    warning, refusal = err.strip().splitlines()
    assert "SWEEPER_WORKRES is not a setting Sweeper knows; it is ignored (did you mean " \
           "SWEEPER_WORKERS?)" in warning
    assert refusal.startswith("sweeper: cannot listen on 127.0.0.1:")


@pytest.mark.parametrize("argv", [["run", "--url", "http://127.0.0.1:1"],
                                  ["credentials", "rotate-key"], ["drill", "no-such-drill"]])
def test_every_command_that_reads_settings_names_a_misspelt_variable(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        argv: list[str]) -> None:
    """`sweeper run` with SWEEPER_TOKN said only that a token is required: a SWEEPER_*
    variable nothing reads is a warning line, with the known name nearest to it, before
    whatever the command says next."""
    monkeypatch.setenv("SWEEPER_TOKN", "x" * 20)
    _, _, err = sweeper(capsys, *argv)
    assert err.splitlines()[0] == ("sweeper: warning: SWEEPER_TOKN is not a setting Sweeper "
                                   "knows; it is ignored (did you mean SWEEPER_TOKEN?)")
    assert err.count("SWEEPER_TOKN") == 1


@pytest.mark.parametrize("command", [["check-config"], ["worker"]])
def test_credentials_through_the_api_without_a_key_is_a_config_error(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        command: list[str]) -> None:
    policies = tmp_path / "policies.toml"
    policies.write_text(
        '[upstreams.stripe]\nbase_url = "https://api.stripe.com"\n'
        'credentials = { api = true }\nheaders = { Authorization = "Bearer {credential}" }\n')
    monkeypatch.setenv("SWEEPER_POLICIES_FILE", str(policies))
    code, _, err = sweeper(capsys, *command)
    assert code == Exit.CONFIG
    assert "upstreams.stripe.credentials: api = true needs SWEEPER_CREDENTIALS_KEY" in err
