# The coordinator (CPU only): the run's first DHT node, REST API and dashboard. Build from the
# repository root:
#   docker build -f docker/coordinator.Dockerfile -t swarm-coordinator .
#   docker run -p 8000:8000 -v swarm-state:/var/lib/swarm swarm-coordinator --config configs/small.toml
# The DHT addresses it hands to joining peers are its container's; peers on other machines need
# `--network host`, so that they are the machine's.
# docker/compose.yaml also runs CPU peers and the trainer from this image, with another entry point.
FROM python:3.11.14-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# PyPI's torch 2.13.0 for Linux x86_64 is the CUDA build (several GB) that a CPU-only image has no
# use for: take the CPU build of the same release first. The README's install line below then finds
# torch==2.13.0 satisfied (2.13.0+cpu) and installs nothing more of it.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
WORKDIR /opt/swarm
COPY . .
RUN pip install -c constraints.txt torch==2.13.0 -e .

RUN useradd --create-home --uid 1000 swarm \
    && mkdir -p /var/lib/swarm \
    && chown swarm:swarm /var/lib/swarm
USER 1000:1000
# Relative paths (--config configs/small.toml) are the repository's.
WORKDIR /opt/swarm
# What outlives the coordinator (DHT identity, peers last seen, operator pause, history) for one run:
# give each run a volume of its own.
VOLUME ["/var/lib/swarm"]
# HTTP (REST API, dashboard, /metrics) and the DHT; a fixed DHT port keeps the multiaddrs the same
# across restarts.
EXPOSE 8000 8001
ENTRYPOINT ["swarm", "coordinator", "--host", "0.0.0.0", "--port", "8000", "--dht-port", "8001", "--state-dir", "/var/lib/swarm"]
CMD ["--config", "configs/small.toml"]
