"""The coordinator's link test (coordinator/api_speedtest.py) and what a peer makes of it
(peer/throughput.py): a real coordinator over HTTP, timed by the peer's own client."""

from __future__ import annotations

import httpx
import pytest

from coordinator.api_speedtest import MAX_BYTES
from peer.throughput import capacity, link_speed, sample_bytes
from swarm.config import load_config
from tests.harness import TINY, swarm_fixture
from tests.processes import start_coordinator

TOKEN = "link-test-token"


@swarm_fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("speedtest")
    proc, url = start_coordinator(TINY, tmp / "c.log", "--join-token", TOKEN)
    try:
        yield url
    finally:
        proc.stop()


def test_a_member_times_its_link_both_ways(coordinator: str):
    up, down = link_speed(coordinator, TOKEN, nbytes=MAX_BYTES)
    assert 8e6 < up < float("inf") and 8e6 < down < float("inf"), (up, down)  # loopback: far above 1 MB/s


def test_an_outsider_cannot_make_the_coordinator_send_or_take_bytes(coordinator: str):
    where = f"{coordinator}/api/v1/speedtest"
    download = httpx.get(where, params={"bytes": MAX_BYTES})
    assert download.status_code == 401 and len(download.content) < 1000
    assert httpx.post(where, content=b"x" * 1000).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert httpx.get(where, params={"bytes": 10}, headers=wrong).status_code == 401
    with pytest.raises(httpx.HTTPStatusError):
        link_speed(coordinator, None, nbytes=1000)


def test_sizes_out_of_bounds_are_refused_with_the_bound_and_the_coordinator_goes_on(coordinator: str):
    where, member = f"{coordinator}/api/v1/speedtest", {"Authorization": f"Bearer {TOKEN}"}
    for n in (0, -1, MAX_BYTES + 1, "many"):
        refused = httpx.get(where, params={"bytes": n}, headers=member)
        assert refused.status_code == 422 and "bytes" in refused.text, (n, refused.text)
    flood = httpx.post(where, content=b"x" * (MAX_BYTES + 1), headers=member, timeout=30)
    assert flood.status_code == 413 and str(MAX_BYTES) in flood.json()["detail"]
    assert len(httpx.get(where, params={"bytes": 5}, headers=member).content) == 5
    assert httpx.get(f"{coordinator}/healthz").json() == {"ok": True}


def test_a_stage_sends_and_receives_its_activations_and_gradients_as_the_codec_encodes_them():
    run = load_config(TINY)
    t, d = run.model.seq_len, run.model.d_model
    hidden = t * d * 4  # float32, codec none
    assert run.stages.count == 2 and run.model.dtype == "float32" and run.wire.codec == "none"
    assert sample_bytes(run, 0) == (hidden, t * 8 + hidden)  # tokens in, activations out, gradients in
    assert sample_bytes(run, 1) == (hidden, hidden)  # activations in, their gradients out
    int8 = run.model_copy(update={"wire": run.wire.model_copy(update={"codec": "int8"})})
    assert sample_bytes(int8, 1)[0] < hidden / 3


def test_a_peer_on_a_slow_uplink_announces_what_it_serves_through_it():
    run = load_config(TINY)
    out, back = sample_bytes(run, 1)
    fast = capacity(50.0, 1e9, 1e9, out, back)
    home = capacity(50.0, 10e6, 100e6, out, back)  # 10 Mbit/s up: a home uplink
    assert home < fast < 50.0
    assert home == pytest.approx(1 / (1 / 50.0 + 8 * out / 10e6 + 8 * back / 100e6))


def test_the_link_test_is_in_the_openapi_schema_with_its_bound(coordinator: str):
    schema = httpx.get(f"{coordinator}/openapi.json").json()
    get = schema["paths"]["/api/v1/speedtest"]["get"]
    bound = next(p for p in get["parameters"] if p["name"] == "bytes")["schema"]
    assert bound["minimum"] == 1 and bound["maximum"] == MAX_BYTES
    assert "post" in schema["paths"]["/api/v1/speedtest"]
