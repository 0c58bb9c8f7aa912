# picker: the ext_proc endpoint picker (`picker serve`) and, for the demo, the lab's vLLM simulator (`picker sim`)
# in one image.
#
#   docker build -t llm-picker:0.1.0 .
#   docker run --rm -p 9002:9002 -p 9003:9003 -p 9090:9090 llm-picker:0.1.0 serve --endpoints 10.0.0.5:8000
#
# Two stages: the first builds a virtualenv (our protos compiled while the package is built), the
# second copies only that virtualenv and runs it as a non-root user that cannot write to it.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/picker
ENV PATH=/opt/picker/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY protos/ protos/
COPY picker/ picker/
COPY lab/ lab/
# `picker envoy-config` looks for its templates in the package when there is no source checkout.
COPY envoy/envoy.yaml envoy/envoy-full-duplex.yaml picker/envoy_templates/
# setup.py's build step compiles our picker.v1 stubs into the wheel (grpcio-tools is a build dependency only;
# .dockerignore keeps local stubs out); the image also runs the simulator: the lab beside the picker.
RUN pip install . ./lab

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/picker/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/picker /opt/picker
# A numeric UID, so Kubernetes' runAsNonRoot can check it.
RUN groupadd --system --gid 10001 picker \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin picker
USER 10001:10001
WORKDIR /tmp
# Fail the build, not the first request, if the API stubs or the Envoy templates are missing.
RUN python -c "import picker.api; from picker.api.v1 import picker_pb2_grpc; \
from picker.serving.envoyconfig import template_path; template_path('buffered'); template_path('full-duplex')" \
 && picker serve --help > /dev/null && picker sim --help > /dev/null
# ext_proc + picker.v1 API, gRPC health, Prometheus /metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["picker"]
CMD ["serve"]
