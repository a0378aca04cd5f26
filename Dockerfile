# syntax=docker/dockerfile:1
#
# Checkpoint coordinator image.
#   docker build -t ckpt-coordinator:0.1.0 .
#   docker run -p 8080:8080 -e CKPTC_DATABASE_URL=postgresql://... ckpt-coordinator:0.1.0
# Without CKPTC_DATABASE_URL, `serve` starts an embedded PostgreSQL under
# /var/lib/ckpt-coordinator (mount a volume there to keep it). In a cluster the URL
# is required: see deploy/README.md.

# ---- builder: wheels for the project and every dependency --------------------------
FROM python:3.11-slim AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
COPY clients/ clients/
COPY gymsim/ gymsim/
COPY migrations/ migrations/

RUN pip wheel --wheel-dir /wheels .

# ---- runtime: no compilers, no build tools, non-root ----------------------------------
FROM python:3.11-slim AS runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CKPTC_HOST=0.0.0.0 \
    CKPTC_PORT=8080 \
    CKPTC_LOG_FORMAT=json \
    CKPTC_DATA_DIR=/var/lib/ckpt-coordinator

# The same uid/gid as runAsUser/runAsGroup in deploy/k8s.
RUN groupadd --system --gid 10001 ckptc \
 && useradd --system --uid 10001 --gid ckptc --home-dir /var/lib/ckpt-coordinator \
        --create-home --shell /usr/sbin/nologin ckptc

COPY --from=builder /wheels /wheels
RUN pip install --no-index --find-links /wheels checkpoint-coordinator \
 && rm -rf /wheels

USER 10001:10001
WORKDIR /var/lib/ckpt-coordinator
EXPOSE 8080

# Liveness only (/healthz never touches the database); stdlib, no curl in the image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; url = 'http://127.0.0.1:%s/healthz' % os.environ.get('CKPTC_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(url, timeout=4).status == 200 else 1)"]

ENTRYPOINT ["ckpt-coordinator"]
CMD ["serve"]
