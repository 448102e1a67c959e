# mmserver's container image: the server on a slim Python, as a non-root user, the model store
# a volume, configured by MMSERVER_* environment variables.
#
#   pip wheel --wheel-dir wheelhouse '.[all]'        # on the host: the package and its deps
#   docker build -t mmserver .                        # installs from ./wheelhouse only
#   docker run -p 127.0.0.1:8080:8080 -v "$PWD/model_store:/models:ro" \
#       -e MMSERVER_MANAGEMENT_TOKEN=... mmserver
#
# The build reads no package index: it installs the wheels in ./wheelhouse (so a build works
# where the container has no network, and installs what was tested). BASE is any image with
# Python >= 3.11 and its venv module whose Python matches the wheels' (python:3.12-slim, or a
# Debian image with python3 and python3-venv).
#
# Models with a requirements.txt run in environments of their own, built on first load into
# /envs (MMSERVER_ENV_DIR) from the package index the container's pip is configured with. To
# bake them into an image instead (no build, no index at run time), build them in an image of
# your own on this one, with the store in it and the index reachable while it builds:
#
#   FROM mmserver
#   COPY --chown=mmserver model_store /models
#   RUN mmserver envs build --model-store /models      # into /envs, one line per environment
#
# The server then finds them at start and builds nothing (a model whose set is not there is
# built on its first load, as without them).
ARG BASE=python:3.12-slim

FROM ${BASE} AS build
COPY wheelhouse /wheelhouse
RUN python3 -m venv /opt/mmserver \
    && /opt/mmserver/bin/pip install --no-index --find-links /wheelhouse --no-cache-dir \
        'mmserver[all]' \
    && /opt/mmserver/bin/mmserver --version

FROM ${BASE}
COPY --from=build /opt/mmserver /opt/mmserver
# LightGBM's library needs the OpenMP runtime (libgomp1), which slim bases lack.
RUN if ! ldconfig -p | grep -q libgomp.so.1; then \
        apt-get update && apt-get install -y --no-install-recommends libgomp1 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && useradd --system --uid 10001 --no-create-home --home-dir /nonexistent mmserver \
    && mkdir -p /models /cache /envs \
    && chown mmserver /cache /envs
# The store is read-only to the server; archives are unpacked into /cache (a volume or tmpfs
# where the store is read-only). 0.0.0.0 inside the container, published where the operator
# chooses: a non-loopback address needs MMSERVER_MANAGEMENT_TOKEN (or
# MMSERVER_INSECURE_MANAGEMENT=true) for the management calls, or the server refuses to start.
ENV PATH=/opt/mmserver/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MMSERVER_MODEL_STORE=/models \
    MMSERVER_CACHE_DIR=/cache \
    MMSERVER_ENV_DIR=/envs \
    MMSERVER_HOST=0.0.0.0 \
    MMSERVER_PORT=8080
VOLUME ["/models", "/cache"]
EXPOSE 8080
USER mmserver
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import os, sys, urllib.request; port = os.environ.get('MMSERVER_PORT', '8080'); sys.exit(urllib.request.urlopen(f'http://127.0.0.1:{port}/v2/health/live', timeout=2).status != 200)"]
# The server is PID 1 (exec form, no shell): docker stop's SIGTERM reaches it and it drains
# (drain_timeout) before it exits; give docker stop a longer --time than drain_timeout.
ENTRYPOINT ["mmserver", "serve"]
