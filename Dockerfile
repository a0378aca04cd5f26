# syntax=docker/dockerfile:1
#
# Checkpoint coordinator image.
#   docker build -t ckpt-coordinator:0.1.0 .
#   docker run -p 8080:8080 -e CKPTC_DATABASE_URL=postgresql://... ckpt-coordinator:0.1.0
# Without CKPTC_DATABASE_URL, `serve` starts an embedded PostgreSQL under
# /var/lib/ckpt-coordinator (mount a volume there to keep it). In a cluster the URL
# is required: see deploy/README.md.
#
# BASE_IMAGE: any image with Python 3.11, its venv module and useradd (python:3.11-slim,
# or a Debian bookworm with python3 and python3-venv, as tests/image builds it). Both
# stages use it: the venv made in the builder is copied as is, so the interpreter it
# points at must be the same one.
ARG BASE_IMAGE=python:3.11-slim

# ---- builder: wheels for the project and every dependency, installed in a venv -------
FROM ${BASE_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
COPY clients/ clients/
COPY gymsim/ gymsim/
COPY migrations/ migrations/
COPY demo/ demo/
COPY launcher/ launcher/

# A venv, not the system site-packages: Debian's python3 refuses pip installs (PEP 668).
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip wheel --wheel-dir /wheels . \
 && python3 -m venv /opt/ckpt-coordinator \
 && /opt/ckpt-coordinator/bin/pip install --no-index --find-links /wheels checkpoint-coordinator \
 && /opt/ckpt-coordinator/bin/pip uninstall -y -q pip setuptools

# ---- runtime: no compilers, no build tools, no pip, non-root --------------------------
FROM ${BASE_IMAGE} AS runtime

# LANG: the embedded PostgreSQL's initdb takes its locale from it, and not every base sets it.

ENV PATH=/opt/ckpt-coordinator/bin:$PATH \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CKPTC_HOST=0.0.0.0 \
    CKPTC_PORT=8080 \
    CKPTC_LOG_FORMAT=json \
    CKPTC_DATA_DIR=/var/lib/ckpt-coordinator

# The same uid/gid as runAsUser/runAsGroup in deploy/k8s.
RUN groupadd --system --gid 10001 ckptc \
 && useradd --system --uid 10001 --gid ckptc --home-dir /var/lib/ckpt-coordinator \
        --create-home --shell /usr/sbin/nologin ckptc

# Only the installed venv: the wheels stay in the builder, not in a layer of this image.
COPY --from=builder /opt/ckpt-coordinator /opt/ckpt-coordinator

USER 10001:10001
WORKDIR /var/lib/ckpt-coordinator
EXPOSE 8080

# Liveness only (/healthz never touches the database); stdlib, no curl in the image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; url = 'http://127.0.0.1:%s/healthz' % os.environ.get('CKPTC_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(url, timeout=4).status == 200 else 1)"]

ENTRYPOINT ["ckpt-coordinator"]
CMD ["serve"]
