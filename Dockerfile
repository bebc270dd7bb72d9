# syntax=docker/dockerfile:1
# One image for the operator and the router: `tandem operator` (the chart's Deployment) and
# `tandem router` (each ServingCluster's router Deployment). Engines run the vLLM image instead.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: a self-contained virtual environment with the package and its dependencies ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tandem
WORKDIR /src
# Dependencies first, so that a source-only change reuses this layer.
COPY pyproject.toml README.md LICENSE ./
RUN python - <<'PY' > /tmp/requirements.txt
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PY
RUN /opt/tandem/bin/pip install -r /tmp/requirements.txt
COPY tandem ./tandem
RUN /opt/tandem/bin/pip install --no-deps . \
 && /opt/tandem/bin/tandem --help >/dev/null

# --- runtime: the environment only, as an unprivileged user ----------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="Tandem operator and KV-aware prefill/decode router" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid tandem --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin tandem
COPY --from=build /opt/tandem /opt/tandem
COPY --from=build /src/LICENSE /licenses/LICENSE
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 8080
ENTRYPOINT ["tandem"]
CMD ["operator", "--all-namespaces"]
