# syntax=docker/dockerfile:1
# The base of both stages, pinned by digest: the multi-platform index (linux/amd64 and
# linux/arm64 among its platforms) that Docker Hub published for python:3.12.14-slim-bookworm
# on 2026-08-25. The tag says what it is; the digest is what is pulled, so two builds of one
# commit start from the same bytes. Moving it (a new patch release, a rebuilt Debian base) and
# keeping it in step with requirements/image.txt: docs/operations.md#the-image.
FROM python:3.12.14-slim-bookworm@sha256:0f5b26b9518d002b6173fd61daad821fa340635ebfec5bba471013f9ca114579 AS base

# Build stage: a virtualenv with Sweeper and its dependencies. The dependency layer installs
# the lock file alone: every package pinned and checked against its sha256, wheels only (no
# build of anything at install time), nothing from the extras (no embedded PostgreSQL). A code
# change reuses that layer; only the last one installs the project itself, without its
# dependencies.
FROM base AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY requirements/image.txt ./requirements/
RUN /opt/venv/bin/pip install --require-hashes --only-binary=:all: -r requirements/image.txt
COPY pyproject.toml README.md ./
COPY service ./service
COPY drills ./drills
COPY migrations ./migrations
RUN /opt/venv/bin/pip install --no-deps .

# Runtime stage: only the virtualenv, a non-root user, no compilers, no curl.
FROM base
# OCI annotations: what the image is and what it was built from; the build names the commit
# and the moment (docs/operations.md#the-image): --build-arg REVISION=... CREATED=...
ARG REVISION="" CREATED=""
LABEL org.opencontainers.image.title="sweeper" \
      org.opencontainers.image.description="Scheduled, rate-limited, crash-safe data cleanup for e-commerce back ends" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="docker.io/library/python:3.12.14-slim-bookworm" \
      org.opencontainers.image.base.digest="sha256:0f5b26b9518d002b6173fd61daad821fa340635ebfec5bba471013f9ca114579"
RUN useradd --system --uid 10001 --home-dir /var/lib/sweeper --create-home sweeper
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SWEEPER_HOST=0.0.0.0 SWEEPER_PORT=8080 SWEEPER_METRICS_PORT=9090 \
    SWEEPER_DATA_DIR=/var/lib/sweeper
USER 10001
WORKDIR /var/lib/sweeper
EXPOSE 8080 9090
# Liveness of the process itself, whichever command it runs: `serve` answers /healthz on
# SWEEPER_PORT; `sweeper worker` serves none, so when nothing listens there the probe asks
# the worker's own /healthz on SWEEPER_METRICS_PORT (its loop turned lately:
# service/worker/health.py). With SWEEPER_TLS_* set the API speaks HTTPS; the certificate
# names the public host, never 127.0.0.1, so this local probe cannot verify it and does
# not try. Any error or non-2xx answer exits 1 (unhealthy).
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s \
    CMD ["python", "-c", "import os, socket, ssl, urllib.request; tls = bool(os.environ.get('SWEEPER_TLS_CERT_FILE')); api = int(os.environ.get('SWEEPER_PORT', '8080')); serving = socket.socket().connect_ex(('127.0.0.1', api)) == 0; port = api if serving else int(os.environ.get('SWEEPER_METRICS_PORT', '9090')); secure = tls and serving; urllib.request.urlopen(('https' if secure else 'http') + '://127.0.0.1:' + str(port) + '/healthz', timeout=2, context=ssl._create_unverified_context() if secure else None)"]
ENTRYPOINT ["sweeper"]
CMD ["serve"]
