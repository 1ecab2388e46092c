# kubetitan operator image: the kopf operator and the `kubetitan` CLI. No torch (the operator
# package must install and run without it), only the dependencies of operator/pyproject.toml and of
# the shared kubetitan-core (operator/core/pyproject.toml), pinned by the repository's constraints.txt.
#   docker build -f images/operator.Dockerfile -t kubetitan/operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt ./
COPY operator/ ./operator/
RUN python -m venv /opt/kubetitan \
 && /opt/kubetitan/bin/pip install -c constraints.txt ./operator/core ./operator

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/kubetitan/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/kubetitan /opt/kubetitan
# Non-root; the chart also sets runAsNonRoot, readOnlyRootFilesystem and drops all capabilities.
RUN groupadd --system --gid 10001 kubetitan \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kubetitan
USER 10001:10001
EXPOSE 8080 8081
ENTRYPOINT ["kubetitan"]
CMD ["operator", "--all-namespaces"]
