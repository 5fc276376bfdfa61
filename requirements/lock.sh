#!/bin/sh
# Regenerate requirements/image.txt, the container image's dependencies: every package that
# [project].dependencies of pyproject.toml needs (no extras: no embedded PostgreSQL), pinned
# with == and the sha256 of every file PyPI publishes for that version, so the one file serves
# the image on linux/amd64 and linux/arm64 (and Python 3.11 for the tests).
#
# Resolve under the image's Python on Linux, from the repository root:
#   requirements/lock.sh                  # keep every pin that still fits pyproject.toml
#   requirements/lock.sh --upgrade        # newest releases that fit
#   requirements/lock.sh -P fastapi       # move one package only
# PYTHON names the interpreter (default python3.12); without one, inside the base image:
#   docker run --rm -v "$PWD:/src" -w /src python:3.12.14-slim-bookworm requirements/lock.sh
# tests/integration/test_container_image.py checks that the file agrees with pyproject.toml
# and with the Dockerfile's Python, and installs it into a fresh virtualenv.
set -eu
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.12}
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
# from the package index alone (PIP_INDEX_URL is honoured): no machine's pip.conf, local
# wheel folder or constraints file decides what the image gets
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_CONSTRAINT PIP_NO_INDEX
"$python" -m venv "$tools/venv"
"$tools/venv/bin/pip" install --quiet "pip-tools==7.6.2"
# --allow-unsafe: pin pip/setuptools too should a dependency ever need them (hash-checking
# mode refuses anything unpinned); --strip-extras: plain pins, usable as constraints.
CUSTOM_COMPILE_COMMAND="requirements/lock.sh" "$tools/venv/bin/pip-compile" --quiet \
    --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
    --no-emit-find-links --output-file requirements/image.txt "$@" pyproject.toml
{
    echo "# The container image's dependencies (the Dockerfile's dependency layer installs this"
    echo "# file alone, with --require-hashes --only-binary=:all:): [project].dependencies of"
    echo "# pyproject.toml without extras, resolved for Python 3.12 on Linux, with the sha256 of"
    echo "# every file PyPI has for each version (linux/amd64 and linux/arm64 alike). Do not edit:"
    echo "# run requirements/lock.sh (how: docs/operations.md#the-image)."
    cat requirements/image.txt
} > "$tools/image.txt"
mv "$tools/image.txt" requirements/image.txt

# What the image's build will do on each architecture: fetch a wheel of every pin for
# CPython 3.12 on glibc 2.36 (Debian bookworm) and check it against the hashes.
for arch in x86_64 aarch64; do
    platforms=$(for minor in $(seq 36 -1 5); do printf ' --platform manylinux_2_%s_%s' "$minor" "$arch"; done)
    # shellcheck disable=SC2086 # one word per option
    "$tools/venv/bin/pip" download --quiet --require-hashes --only-binary=:all: --no-deps \
        $platforms --platform "manylinux2014_$arch" --python-version 3.12 \
        --implementation cp --abi cp312 --dest "$tools/wheels-$arch" -r requirements/image.txt
    echo "requirements/image.txt: $(ls "$tools/wheels-$arch" | wc -l) wheels for linux/$arch, hashes match"
done
