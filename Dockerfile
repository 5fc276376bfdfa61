# syntax=docker/dockerfile:1
# Build stage: a virtualenv with Sweeper and its dependencies. The dependency layer is built
# from pyproject.toml alone (no project build, so no source is needed yet): a code change
# reuses it, and only the last layer installs the project itself, without its dependencies.
FROM python:3.12-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml ./
RUN python -c "import tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; open('requirements.txt', 'w').write('\n'.join(project['dependencies']))" \
    && /opt/venv/bin/pip install -r requirements.txt
COPY README.md ./
COPY service ./service
COPY drills ./drills
COPY migrations ./migrations
RUN /opt/venv/bin/pip install --no-deps .

# Runtime stage: only the virtualenv, a non-root user, no compilers, no curl.
FROM python:3.12-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/sweeper --create-home sweeper
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SWEEPER_HOST=0.0.0.0 SWEEPER_PORT=8080 SWEEPER_DATA_DIR=/var/lib/sweeper
USER 10001
WORKDIR /var/lib/sweeper
EXPOSE 8080
# Liveness of the process itself, on whatever port it was given. With SWEEPER_TLS_* set it
# speaks HTTPS; the certificate names the public host, never 127.0.0.1, so this local probe
# cannot verify it and does not try. Any error or non-2xx answer exits 1 (unhealthy).
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s \
    CMD ["python", "-c", "import os, ssl, urllib.request; tls = bool(os.environ.get('SWEEPER_TLS_CERT_FILE')); url = ('https' if tls else 'http') + '://127.0.0.1:' + os.environ.get('SWEEPER_PORT', '8080') + '/healthz'; urllib.request.urlopen(url, timeout=2, context=ssl._create_unverified_context() if tls else None)"]
ENTRYPOINT ["sweeper"]
CMD ["serve"]
