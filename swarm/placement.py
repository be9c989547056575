"""Where a joining peer should serve: a pure function of the stages' announced load."""

from __future__ import annotations


def pick_stage(throughputs: list[float], peers: list[int]) -> int:
    """The stage with the lowest total throughput; among equals, the one with fewest peers (peers
    still joining have announced no throughput yet), then the lowest index."""
    if not throughputs or len(throughputs) != len(peers):
        raise ValueError("need one throughput and one peer count per stage")
    return min(range(len(throughputs)), key=lambda k: (throughputs[k], peers[k], k))
