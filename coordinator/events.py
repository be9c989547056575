"""What happened in the swarm between two reads of the DHT: joins, leaves, moves, failures, bans, steps.

`diff_events` is a pure function of the previous and the new view (and of the peers already seen
online, which the caller remembers): no clock, no network, so every rule below is unit-tested on
hand-made views.

- a peer online for the first time → join;
- a peer whose record turns 'leaving' → leave, or move when it names the stage it moves to;
- a peer whose records vanish without having said 'leaving' → failure (its record expired);
- a trainer's failed-call and ban counters growing → failure and ban;
- a peer new in a trainer's spot-check bans (swarm/verify.py) → ban, naming the peer;
- a trainer's step count growing → one step event with the latest loss, however many steps came.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from pydantic import BaseModel, Field

from swarm.records import PeerRecord, SwarmView, TrainerRecord

EventKind = Literal["join", "leave", "move", "failure", "ban", "step", "control"]


class Event(BaseModel):
    id: int = Field(0, description="ascending from 1 (0 for an event not stored yet)")
    t: float = Field(description="unix time")
    kind: EventKind
    peer: str | None = Field(None, description="the public name of the peer it is about")
    stage: int | None = Field(None, description="the stage it is about (for a move: the stage moved to)")
    text: str


def peer_name(record: PeerRecord) -> str:
    return record.public_name or record.peer_id[-8:]


def trainer_name(record: TrainerRecord) -> str:
    return record.public_name or record.trainer_id


def _records(view: SwarmView) -> dict[tuple[str, int], PeerRecord]:
    """Every peer record of the view by (peer id, stage): a moving peer has one on each of two stages."""
    return {(p.peer_id, k): p for k, peers in enumerate(view.stages) for p in peers}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def diff_events(old: SwarmView, new: SwarmView, seen_online: Collection[str] = ()) -> list[Event]:
    """The events that turn `old` into `new`, dated `new.read_at`. `seen_online`: ids of peers seen
    online before `old` (a peer that comes online again after a move, or after the coordinator
    restarted, has not joined anew)."""
    t = new.read_at
    before, after = _records(old), _records(new)
    was_online = {pid for (pid, _), p in before.items() if p.state == "online"}
    present = {pid for pid, _ in after}
    events: list[Event] = []

    # Vanished: every record of the peer is gone. One that said 'leaving' first went as announced.
    gone: dict[str, list[PeerRecord]] = {}
    for (pid, _), p in before.items():
        if pid not in present:
            gone.setdefault(pid, []).append(p)
    for records in gone.values():
        last = [p for p in records if p.state != "leaving"]
        if last:
            p = max(last, key=lambda r: r.updated)
            events.append(
                Event(
                    t=t,
                    kind="failure",
                    peer=peer_name(p),
                    stage=p.stage,
                    text=f"peer {peer_name(p)} of stage {p.stage} vanished: "
                    "record expired: the peer died or lost its network",
                )
            )

    for (pid, k), p in after.items():
        prev = before.get((pid, k))
        if p.state == "leaving" and prev is not None and prev.state != "leaving":
            if p.moving_to is not None:
                text = f"peer {peer_name(p)} moves from stage {k} to stage {p.moving_to}"
                events.append(Event(t=t, kind="move", peer=peer_name(p), stage=p.moving_to, text=text))
            else:
                text = f"peer {peer_name(p)} left stage {k}"
                events.append(Event(t=t, kind="leave", peer=peer_name(p), stage=k, text=text))
        elif p.state == "online" and pid not in was_online and pid not in seen_online:
            device = p.device or "unknown device"
            text = f"peer {peer_name(p)} joined stage {k} ({device}, {p.throughput:.1f} samples/s)"
            events.append(Event(t=t, kind="join", peer=peer_name(p), stage=k, text=text))

    trainers = {r.trainer_id: r for r in old.trainers}
    for r in new.trainers:
        first_seen = r.trainer_id not in trainers
        prev = trainers.get(r.trainer_id) or TrainerRecord(trainer_id=r.trainer_id)
        name = trainer_name(r)
        if r.failures > prev.failures:
            n = _plural(r.failures - prev.failures, "call")
            events.append(Event(t=t, kind="failure", text=f"trainer {name}: {n} failed, retried on other peers"))
        if r.bans > prev.bans:
            n = _plural(r.bans - prev.bans, "time")
            events.append(Event(t=t, kind="ban", text=f"trainer {name} banned a failing peer ({n})"))
        names = {pid: peer_name(p) for (pid, _), p in {**before, **after}.items()}
        for pid, k in r.spot_banned.items():
            if pid not in prev.spot_banned:
                who = names.get(pid, pid[-8:])
                text = f"trainer {name} banned peer {who} of stage {k}: its outputs disagreed with two agreeing peers"
                events.append(Event(t=t, kind="ban", peer=who, stage=k, text=text))
        if r.steps > prev.steps:
            # A trainer first seen mid-run may have started at any step: name only the one it is at.
            one = first_seen or r.steps == prev.steps + 1
            steps = f"step {r.steps}" if one else f"steps {prev.steps + 1}–{r.steps}"
            loss = f"loss {r.loss:.4f}" if r.loss is not None else "no loss yet"
            val = f", val_loss {r.val_loss:.4f}" if r.val_loss is not None and r.val_loss != prev.val_loss else ""
            events.append(Event(t=t, kind="step", text=f"{steps}: {loss}{val} ({name})"))
    return events
