# kubetitan trainer image: torchtitan 0.2.2 + torchao 0.17.0 on PyTorch 2.11 with CUDA, and the
# kubetitan_trainer package (entry point: /opt/conda/bin/python -s -m kubetitan_trainer.launch, set by the planner).
#   docker build -f images/trainer.Dockerfile -t kubetitan/trainer:0.1.0 .
#   docker build -f images/trainer.Dockerfile --build-arg TRAINER_UID=0 -t kubetitan/trainer:0.1.0-root .
# The base image already has torch 2.11.0 (CUDA 12.8 runtime, for the 570+ drivers of current EKS
# GPU AMIs; take the cuda13.0 tag on 580+ drivers); constraints.txt pins torch==2.11.0, which that
# build satisfies, so pip keeps it and adds only the rest.
#
# EFA (p4d/p5/p5e/p5en): NCCL reaches EFA only through the aws-ofi-nccl net plugin on libfabric; without
# them it silently falls back to TCP sockets (the trainer's start-up check, kubetitan_trainer.netcheck,
# then ends the run with exit code 5 on eks/hyperpod). Both come from AWS's EFA installer:
#   EFA installer 1.51.0 = libfabric 2.7.0amzn2.0 + aws-ofi-nccl 1.22.0 (+ rdma-core 65.0; the EFA kernel
#   driver 3.3.1 is the node's, skipped here) -- source: the "Elastic Fabric Adapter release notes" table of
#   the Amazon EC2 user guide (efa-changelog), release 1.51.0 of October 22, 2026.
#   aws-ofi-nccl keeps backward compatibility with NCCL 2.17.1 and later (its v1.21.1/v1.22.0 release notes),
#   which covers the NCCL that torch 2.11.0's CUDA 12.8 wheels bring.
# Pass the installer tarball's address (AWS's EFA "get started" guide names it) when building:
#   docker build -f images/trainer.Dockerfile --build-arg EFA_INSTALLER_URL=<aws-efa-installer-1.51.0.tar.gz URL> .
ARG PYTORCH_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

ARG EFA_INSTALLER_VERSION=1.51.0
ARG LIBFABRIC_VERSION=2.7.0amzn2.0
ARG AWS_OFI_NCCL_VERSION=1.22.0
ARG EFA_INSTALLER_URL
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# ADD of a URL given as a build argument (not a local file: COPY cannot fetch it).
# hadolint ignore=DL3020
ADD ${EFA_INSTALLER_URL} /tmp/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz
# The installer's own apt-get runs need the lists: they go after it (DL3009). Its packages pin their
# versions; ca-certificates/pciutils take the base image's (DL3008).
# hadolint ignore=DL3008,DL3009
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates pciutils \
 && tar -xf /tmp/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz -C /tmp
# In a container: no kernel module (the node has it), no ulimit files (the runtime sets them), no GPG step.
# The checks after it fail the build when libfabric is not the named version, or the plugin or libfabric's
# efa provider is missing.
WORKDIR /tmp/aws-efa-installer
RUN ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
 && rm -rf /tmp/aws-efa-installer* /var/lib/apt/lists/* \
 && /opt/amazon/efa/bin/fi_info --version | grep -F "${LIBFABRIC_VERSION}" \
 && find /opt/amazon/ofi-nccl -name 'libnccl-net-ofi.so*' | grep -q . \
 && /opt/amazon/efa/bin/fi_info -l | grep -q '^efa:'
ENV PATH=/opt/amazon/efa/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    NCCL_NET_PLUGIN=ofi \
    KUBETITAN_EFA_INSTALLER_VERSION=${EFA_INSTALLER_VERSION} \
    KUBETITAN_AWS_OFI_NCCL_VERSION=${AWS_OFI_NCCL_VERSION}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/var/cache/kubetitan/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/kubetitan/inductor \
    TRITON_CACHE_DIR=/var/cache/kubetitan/triton

WORKDIR /opt/kubetitan/src
COPY constraints.txt ./
# The trainer shares only kubetitan-core with the operator (operator/core): the operator package (kopf, the
# Kubernetes client) is not in this image.
COPY operator/core/ ./operator/core/
COPY trainer/ ./trainer/
# The pins are the project's own (trainer/pyproject.toml, constraints.txt); tests/chart checks
# that these lines agree with them. The planner runs the launcher by the interpreter's absolute path
# (kubetitan_core.contract.TRAINER_PYTHON, never `python` through PATH): the last line runs it as the pod does and
# fails the build when that path is not the Python the packages went into.
RUN python -m pip install -c constraints.txt \
      torch==2.11.0 torchtitan==0.2.2 torchao==0.17.0 \
      ./operator/core ./trainer \
 && python -c "import torch, torchtitan, torchao; assert torch.__version__.startswith('2.11.0'), torch.__version__" \
 && /opt/conda/bin/python -s -m kubetitan_trainer.launch --help >/dev/null

# Non-root by default (uid 10001); build with TRAINER_UID=0 where the node setup needs root.
ARG TRAINER_UID=10001
RUN if [ "$TRAINER_UID" != "0" ]; then \
      groupadd --gid "$TRAINER_UID" kubetitan \
      && useradd --uid "$TRAINER_UID" --gid "$TRAINER_UID" --create-home --shell /bin/bash kubetitan; \
    fi \
 && mkdir -p /var/cache/kubetitan /checkpoints \
 && chown -R "$TRAINER_UID:$TRAINER_UID" /var/cache/kubetitan /checkpoints
USER ${TRAINER_UID}
WORKDIR /checkpoints
EXPOSE 9090 29500
ENTRYPOINT []
CMD ["/opt/conda/bin/python", "-s", "-m", "kubetitan_trainer.launch", "--help"]
