# A volunteer's GPU peer. Build from the repository root:
#   docker build -f docker/peer.Dockerfile -t swarm-peer .
#   docker run --gpus all -e SWARM_COORDINATOR=http://HOST:8000 -e SWARM_PUBLIC_NAME=me swarm-peer
# PyPI's torch 2.13.0 for Linux x86_64 is built for CUDA 13.0 and brings its own CUDA libraries; the
# CUDA base image tells the NVIDIA container runtime which driver the image needs (>= 580).
FROM nvidia/cuda:13.0.2-runtime-ubuntu22.04

ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The base image's tag is the pin; Ubuntu's point releases of python3.11 carry its security fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/*
# The project's virtual environment, and the user that runs the peer. Its ~/.cache/swarm (measured
# throughput, checkpoints) exists in the image, so that a volume mounted there is the user's to write.
RUN python3.11 -m venv --upgrade-deps /opt/venv \
    && useradd --create-home --uid 1000 swarm \
    && mkdir -p /home/swarm/.cache/swarm \
    && chown -R swarm:swarm /home/swarm/.cache
ENV PATH=/opt/venv/bin:$PATH

# torch first, in a layer of its own, so that a change to the source does not download it again;
# the README's install line below then finds torch==2.13.0 installed.
RUN pip install torch==2.13.0
WORKDIR /opt/swarm
COPY . .
RUN pip install -c constraints.txt torch==2.13.0 -e .

USER 1000:1000
WORKDIR /home/swarm
# Listen on every interface of the container, so that trainers and the stage's other peers reach it.
ENTRYPOINT ["swarm", "peer", "--host", "0.0.0.0"]
