# kubetitan trainer image: torchtitan 0.2.2 + torchao 0.17.0 on PyTorch 2.11 with CUDA, and the
# kubetitan_trainer package (entry point: python -m kubetitan_trainer.launch, set by the planner).
#   docker build -f images/trainer.Dockerfile -t kubetitan/trainer:0.1.0 .
#   docker build -f images/trainer.Dockerfile --build-arg TRAINER_UID=0 -t kubetitan/trainer:0.1.0-root .
# The base image already has torch 2.11.0 (CUDA 12.8 runtime, for the 570+ drivers of current EKS
# GPU AMIs; take the cuda13.0 tag on 580+ drivers); constraints.txt pins torch==2.11.0, which that
# build satisfies, so pip keeps it and adds only the rest. For EFA on p5, add the aws-ofi-nccl
# plugin your node image documents.
ARG PYTORCH_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/var/cache/kubetitan/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/kubetitan/inductor \
    TRITON_CACHE_DIR=/var/cache/kubetitan/triton

WORKDIR /opt/kubetitan/src
COPY constraints.txt ./
COPY operator/ ./operator/
COPY trainer/ ./trainer/
# The pins are the project's own (trainer/pyproject.toml, constraints.txt); tests/chart checks
# that these lines agree with them.
RUN python -m pip install -c constraints.txt \
      torch==2.11.0 torchtitan==0.2.2 torchao==0.17.0 \
      ./operator ./trainer \
 && python -c "import torch, torchtitan, torchao; assert torch.__version__.startswith('2.11.0'), torch.__version__"

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
CMD ["python", "-m", "kubetitan_trainer.launch", "--help"]
