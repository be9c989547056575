"""Where a joining peer should serve: a pure function of the stages' announced load."""

from __future__ import annotations

from collections.abc import Collection


def pick_stage(throughputs: list[float], peers: list[int], allowed: Collection[int] | None = None) -> int:
    """The stage with the lowest total throughput; among equals, the one with fewest peers (peers
    still joining have announced no throughput yet), then the lowest index. Only stages in `allowed`
    (those this peer's device can hold; None: all) are picked."""
    if not throughputs or len(throughputs) != len(peers):
        raise ValueError("need one throughput and one peer count per stage")
    stages = [k for k in range(len(throughputs)) if allowed is None or k in allowed]
    if not stages:
        raise ValueError("no stage allowed")
    return min(stages, key=lambda k: (throughputs[k], peers[k], k))
