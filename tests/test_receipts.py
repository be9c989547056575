"""Weights in a stage's average: the policy (swarm/receipts.py) without a network."""

from __future__ import annotations

import threading

from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.receipts import (
    FLOOR,
    SLACK,
    WINDOW_STEPS,
    Receipts,
    capped_weight,
    credible_samples,
    most_declared,
    sample_caps,
)
from swarm.records import (
    TrainerRecord,
    averaging_prefix,
    make_dht,
    read_progress,
    shutdown_dht,
    visible_maddrs,
)

G = 64  # global batch


def test_receipts_count_per_stage_and_peer_over_the_last_steps_only():
    receipts = Receipts(window=3)
    receipts.add(0, "a", 4)
    receipts.add(1, "b", 4)
    receipts.add(0, "a", 2)
    assert receipts.recent() == {"0": {"a": 6}, "1": {"b": 4}}
    for _ in range(3):
        receipts.next_step()
        receipts.add(0, "c", 1)
    assert receipts.recent() == {"0": {"c": 3}}  # a's step left the window
    # announced in the trainer's record as it is
    assert TrainerRecord(trainer_id="t", served=receipts.recent()).served == {"0": {"c": 3}}


def test_receipts_add_from_many_threads_at_once():
    receipts = Receipts()
    threads = [threading.Thread(target=lambda: [receipts.add(0, "a", 1) for _ in range(1000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert receipts.recent() == {"0": {"a": 8000}}


def test_a_peer_weighs_at_most_its_served_share_with_slack():
    caps = sample_caps([{"a": 300, "b": 100}], {"a", "b", "newcomer"}, G)
    assert caps == {"a": SLACK * G * 0.75, "b": SLACK * G * 0.25, "newcomer": FLOOR}
    # receipts of two trainers add up; peers of other stages (not members) do not count
    caps = sample_caps([{"a": 100}, {"b": 100, "elsewhere": 500}], {"a", "b"}, G)
    assert caps == {"a": SLACK * G / 2, "b": SLACK * G / 2}
    assert sample_caps([{"a": 100}], {"a"}, G) == {"a": SLACK * G}  # all of it, with slack


def test_without_receipts_weights_stay_as_declared_up_to_the_most_anyone_holds():
    assert sample_caps([], {"a", "b"}, G) is None
    assert sample_caps([{"elsewhere": 5}], {"a"}, G) is None
    assert capped_weight(None, "a", 40, G) == 40
    assert capped_weight(None, "liar", 10**6, G) == most_declared(G)


def test_a_trainer_vouching_for_more_than_its_window_holds_is_left_out():
    forged = {"liar": WINDOW_STEPS * most_declared(G) + 1}
    caps = sample_caps([forged, {"a": 100, "liar": 1}], {"a", "liar"}, G)
    assert caps == {"a": SLACK * G * 100 / 101, "liar": FLOOR}


def test_capped_weights():
    caps = {"a": 48.0, "b": 16.0}
    assert capped_weight(caps, "a", 32, G) == 32  # honest: under its cap, as declared
    assert capped_weight(caps, "b", 10**6, G) == 16
    assert capped_weight(caps, "unknown", 32, G) == FLOOR


def test_reports_beyond_what_any_replica_holds_are_left_out_of_the_count():
    reports = [("a", 3, 40), ("b", 3, 24), ("old", 2, 64), ("liar", 3, 10**6)]
    assert credible_samples(reports, 3, G) == (64, ["liar"])
    assert credible_samples([("a", 3, most_declared(G))], 3, G) == (most_declared(G), [])
    assert credible_samples([], 3, G) == (0, [])


def test_progress_reports_count_only_when_their_replica_signed_them(processes):
    """A member cannot get an honest replica banned (or its count left out) by storing a report of 10^6
    samples in its name: a report counts only under the owner marker of the peer it names."""
    victim = make_dht()
    forger = make_dht(visible_maddrs(victim), record_key=RSAPrivateKey())
    try:
        key = f"{averaging_prefix('run', 0)}_progress"
        expires = get_dht_time() + 60

        def report(dht, peer_id, samples) -> dict:
            return {"peer_id": peer_id.to_bytes(), "epoch": 3, "samples_accumulated": samples, "client_mode": False}

        assert victim.store(key, report(victim, victim.peer_id, 40), expires, subkey=victim.record_owner.encode())
        # in the victim's name, under the forger's own marker, and under no marker at all
        assert forger.store(key, report(forger, victim.peer_id, 10**6), expires, subkey=forger.record_owner.encode())
        forger.store(key, report(forger, victim.peer_id, 10**6), expires, subkey=b"unsigned")
        reports = read_progress(victim, "run", 0)
        assert reports == [(victim.peer_id.to_base58(), 3, 40)]
        # its own lie it can tell, and it is read as its own
        later = expires + 1  # a subkey's value is replaced by a newer one only
        assert forger.store(key, report(forger, forger.peer_id, 10**6), later, subkey=forger.record_owner.encode())
        assert sorted(read_progress(victim, "run", 0)) == sorted(
            [(victim.peer_id.to_base58(), 3, 40), (forger.peer_id.to_base58(), 3, 10**6)]
        )
    finally:
        shutdown_dht(forger)
        shutdown_dht(victim)
