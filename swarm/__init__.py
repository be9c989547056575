"""swarm: train one transformer language model on a swarm of volunteer GPUs (SWARM parallelism)."""

__version__ = "0.1.0"
