# syntax=docker/dockerfile:1
# Build stage: a virtualenv with Sweeper and its dependencies (the dependency layer is
# cached apart from the source, so code changes do not reinstall everything).
FROM python:3.12-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
RUN mkdir service && touch service/__init__.py \
    && /opt/venv/bin/pip install . \
    && /opt/venv/bin/pip uninstall -y sweeper
COPY service ./service
COPY migrations ./migrations
RUN /opt/venv/bin/pip install --no-deps .

# Runtime stage: only the virtualenv, a non-root user, no compilers.
FROM python:3.12-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/sweeper --create-home sweeper
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    SWEEPER_HOST=0.0.0.0 SWEEPER_PORT=8080 SWEEPER_DATA_DIR=/var/lib/sweeper
USER 10001
WORKDIR /var/lib/sweeper
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["sweeper"]
CMD ["serve"]
