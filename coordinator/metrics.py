"""`GET /metrics`: the swarm in Prometheus' text format, built from the latest state at scrape time.

A custom collector on its own registry (not the process-wide default one, so two apps in one
process never clash) turns the coordinator's current state (the same StateResponse that
/api/v1/state answers, from the latest view) into metric families on every scrape: nothing is kept
between scrapes. The counters are sums over the trainers announced now: one that leaves takes its
share with it, which Prometheus' rate() reads as a counter reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, get_args

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.records import PeerState

if TYPE_CHECKING:
    from coordinator.app import StateResponse


# The trainers' counters (TrainerRecord fields), each exported as the sum over the trainers listed now.
TRAINER_COUNTERS: list[tuple[str, str, str]] = [  # (metric, field, help)
    ("swarm_wire_bytes", "wire_bytes", "Bytes the trainers sent and received in stage calls"),
    ("swarm_call_failures", "failures", "Stage calls that failed and were retried on another peer"),
    ("swarm_bans", "bans", "Times a trainer banned a failing peer"),
    ("swarm_spot_checks", "spot_checks", "Forward calls the trainers spot-checked on a second peer of the stage"),
    ("swarm_spot_disagreements", "spot_disagreements", "Spot checks whose answers differed beyond the tolerance"),
    (
        "swarm_spot_bans",
        "spot_bans",
        "Peers banned by the trainers' spot checks, outvoted by two agreeing peers (per trainer that banned them)",
    ),
]


class SwarmCollector(Collector):
    def __init__(self, current_state: Callable[[], StateResponse]):
        self.current_state = current_state

    def collect(self) -> Iterator[Metric]:
        state = self.current_state()
        peers = GaugeMetricFamily(
            "swarm_peers", "Peers announced in the DHT, by stage and state", labels=["stage", "state"]
        )
        throughput = GaugeMetricFamily(
            "swarm_stage_throughput_samples_per_second", "Total samples/s of a stage's online peers", labels=["stage"]
        )
        bottleneck = GaugeMetricFamily(
            "swarm_stage_bottleneck", "1 for the stage(s) with the lowest throughput, else 0", labels=["stage"]
        )
        for stage in state.stages:
            k = str(stage.index)
            for s in get_args(PeerState):
                peers.add_metric([k, s], sum(p.state == s for p in stage.peers))
            throughput.add_metric([k], stage.throughput)
            bottleneck.add_metric([k], float(stage.bottleneck))
        yield from (peers, throughput, bottleneck)

        trainers = state.trainers
        yield GaugeMetricFamily(
            "swarm_tokens_per_second", "Training tokens/s, all trainers together", state.tokens_per_s
        )
        yield _optional_gauge("swarm_loss", "Last training loss of the trainer with the most steps", state.loss)
        yield _optional_gauge("swarm_val_loss", "Last validation loss of that trainer", state.val_loss)
        yield GaugeMetricFamily("swarm_global_step", "Global optimizer steps taken", state.global_step)
        for name, field, documentation in TRAINER_COUNTERS:
            yield CounterMetricFamily(name, documentation, sum(getattr(t, field) for t in trainers))
        yield GaugeMetricFamily(
            "swarm_coordinator_view_age_seconds",
            "Seconds since the coordinator last read the swarm from the DHT",
            state.age_s,
        )


def _optional_gauge(name: str, documentation: str, value: float | None) -> GaugeMetricFamily:
    """A gauge with no sample while there is no value (Prometheus then has no series, not a zero)."""
    family = GaugeMetricFamily(name, documentation)
    if value is not None:
        family.add_metric([], value)
    return family


def metrics_router(current_state: Callable[[], StateResponse]) -> APIRouter:
    registry = CollectorRegistry()
    registry.register(SwarmCollector(current_state))
    router = APIRouter(tags=["metrics"])

    @router.get("/metrics", summary="Prometheus metrics (text format)", response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
