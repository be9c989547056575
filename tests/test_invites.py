"""Per-volunteer invites and revocation (coordinator/invites.py), with real coordinators over HTTP.

An invite admits the peer identities its operator allows and no more; a revoked invite admits no
one, and every peer certified under it, like every peer the operator removed, is refused a new
certificate and published in the DHT as removed, for members to refuse; all of it outlives a
restart of the coordinator. `swarm coordinator invite|revoke` does the same from the command line.
"""

from __future__ import annotations

import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey

from coordinator.ca import peer_id_of
from swarm.children import stop_all
from swarm.records import PeerRecord, announce_peer, maddr_peer_ids, read_removed
from tests.conftest import CONFIGS, run_cli
from tests.harness import swarm_fixture
from tests.processes import Proc, free_port, member_dht, start_coordinator, wait_for_state

TINY = CONFIGS / "tiny.toml"
OPERATOR_TOKEN = "operator-secret"
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
SHARED_TOKEN = "shared-secret"


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_pem(key: rsa.RSAPrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def certify(url: str, key: rsa.RSAPrivateKey, token: str | None) -> httpx.Response:
    body = {"public_key": public_pem(key), "role": "peer"}
    return httpx.post(f"{url}/api/v1/certificate", json=body, headers=bearer(token) if token else {}, timeout=10)


def mint(url: str, name: str, **fields) -> dict:
    response = httpx.post(f"{url}/api/v1/invites", json={"name": name, **fields}, headers=OPERATOR, timeout=5)
    assert response.status_code == 201, response.text
    return response.json()


def revoke(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/invites/{name}/revoke", headers=OPERATOR, timeout=5)


def listing(url: str) -> dict:
    return httpx.get(f"{url}/api/v1/invites", timeout=5).json()


def wait_removed(url: str, token: str, wanted: set[str], timeout: float = 10.0) -> float:
    """Seconds until a member DHT node, new now, joined with `token`, reads every peer id of `wanted`
    as removed by the coordinator at `url` (read_removed, as members do)."""
    maddrs = httpx.get(f"{url}/api/v1/join", headers=bearer(token), timeout=5).json()["initial_peers"]
    member = member_dht(url, token)
    try:
        start = time.monotonic()
        while not wanted <= (seen := read_removed(member, "tiny", maddr_peer_ids(maddrs))):
            assert time.monotonic() - start < timeout, f"removed in the DHT after {timeout} s: {seen}, not {wanted}"
            time.sleep(0.5)
        return time.monotonic() - start
    finally:
        member.shutdown()


@swarm_fixture(scope="module")
def guarded(tmp_path_factory) -> Iterator[str]:
    """A coordinator with a shared join token and an operator token."""
    tmp = tmp_path_factory.mktemp("guarded")
    proc, url = start_coordinator(TINY, tmp / "c.log", "--join-token", SHARED_TOKEN, "--token", OPERATOR_TOKEN)
    yield url
    assert proc.stop() == 0, proc.output()[-3000:]


def test_an_invite_certifies_its_max_peers_identities_and_no_third(guarded: str):
    invite = mint(guarded, "alice", max_peers=2)
    assert invite["guarded"] and invite["max_peers"] == 2 and invite["expires"] is None
    first, second, third = new_key(), new_key(), new_key()
    for key in (first, second):
        given = certify(guarded, key, invite["token"])
        assert given.status_code == 200, given.text
        assert given.json()["peer_id"] == peer_id_of(key.public_key())
    renewed = certify(guarded, first, invite["token"])  # the same identity again: a renewal, not a third
    assert renewed.status_code == 200, renewed.text

    # The attack: the invite's holder makes a third identity (a Sybil) with the same token.
    refused = certify(guarded, third, invite["token"])
    assert refused.status_code == 403
    assert "invite 'alice' admits at most 2 peer identities" in refused.json()["detail"]
    alice = next(i for i in listing(guarded)["invites"] if i["name"] == "alice")
    assert alice == {"name": "alice", "identities": 2, "max_peers": 2, "expires": None, "revoked": False}

    # --join-token works beside the invites, as the shared invite without a limit.
    assert certify(guarded, third, SHARED_TOKEN).status_code == 200
    assert httpx.get(f"{guarded}/api/v1/join", headers=bearer(SHARED_TOKEN), timeout=5).status_code == 200
    assert httpx.get(f"{guarded}/api/v1/join", headers=bearer(invite["token"]), timeout=5).status_code == 200
    for token in (None, "not-an-invite"):
        join = httpx.get(f"{guarded}/api/v1/join", headers=bearer(token) if token else {}, timeout=5)
        assert join.status_code == 401 and "join token" in join.json()["detail"]
        assert certify(guarded, new_key(), token).status_code == 401
    shared = next(i for i in listing(guarded)["invites"] if i["name"] == "shared")
    assert shared["max_peers"] is None and shared["identities"] >= 1
    conflict = revoke(guarded, "shared")
    assert conflict.status_code == 409 and "--join-token" in conflict.json()["detail"]

    # The listing shows no token, nor anything made from one.
    text = httpx.get(f"{guarded}/api/v1/invites", timeout=5).text
    assert invite["token"] not in text and SHARED_TOKEN not in text and "sha256" not in text


def test_the_invite_endpoints_want_the_operator_token_and_good_input(guarded: str):
    for headers in ({}, bearer("wrong"), bearer(SHARED_TOKEN)):
        refused = httpx.post(f"{guarded}/api/v1/invites", json={"name": "mallory"}, headers=headers, timeout=5)
        assert refused.status_code == 401, refused.text
        assert httpx.post(f"{guarded}/api/v1/invites/alice/revoke", headers=headers, timeout=5).status_code == 401
    assert "mallory" not in {i["name"] for i in listing(guarded)["invites"]}

    for body, field in [
        ({"name": "a/b"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"name": "bob", "max_peers": 0}, "max_peers"),
        ({"name": "bob", "expires_s": -3 * 86400}, "expires_s"),
        ({"name": "bob", "expires": 60}, "expires"),
    ]:
        bad = httpx.post(f"{guarded}/api/v1/invites", json=body, headers=OPERATOR, timeout=5)
        assert bad.status_code == 422, (body, bad.text)
        assert [e["loc"] for e in bad.json()["detail"]] == [["body", field]], bad.text
    mint(guarded, "bob", expires_s=3600)
    taken = httpx.post(f"{guarded}/api/v1/invites", json={"name": "bob"}, headers=OPERATOR, timeout=5)
    assert taken.status_code == 409 and "exists already" in taken.json()["detail"]
    unknown = revoke(guarded, "nobody")
    assert unknown.status_code == 404 and "nobody" in unknown.json()["detail"]
    assert httpx.get(f"{guarded}/healthz", timeout=5).json() == {"ok": True}  # still serving


def test_swarm_coordinator_invite_prints_a_token_that_lets_a_volunteer_in(guarded: str):
    made = run_cli(
        "coordinator", "invite", "--name", "carol", "--max-peers", "1", "--expires", "12h",
        "--coordinator", guarded, "--token", OPERATOR_TOKEN, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    token = re.search(r"^token \(shown only now\): (\S+)$", made.stdout, re.M).group(1)
    assert f"swarm peer --coordinator {guarded} --join-token {token}" in made.stdout
    assert "at most 1 peer identities, expires" in made.stdout
    assert httpx.get(f"{guarded}/api/v1/join", headers=bearer(token), timeout=5).status_code == 200
    carol = next(i for i in listing(guarded)["invites"] if i["name"] == "carol")
    assert carol["max_peers"] == 1 and 11.9 * 3600 < carol["expires"] - time.time() <= 12 * 3600

    wrong = run_cli("coordinator", "invite", "--name", "dan", "--coordinator", guarded, "--token", "wrong")
    assert wrong.returncode != 0 and "refused the operator token" in wrong.stderr, wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1
    for flags, named in [
        (["--name", "a/b"], "argument --name: invite name 'a/b'"),
        (["--name", "dan", "--max-peers", "0"], "argument --max-peers: 0 must be at least 1"),
        (["--name", "dan", "--expires=-3d"], "argument --expires: '-3d' is not a duration"),
        (["--name", "dan", "--expires", "soon"], "argument --expires: 'soon' is not a duration"),
    ]:
        bad = run_cli("coordinator", "invite", *flags, "--coordinator", guarded, "--token", OPERATOR_TOKEN)
        assert bad.returncode == 2 and named in bad.stderr, bad.stderr
    taken = run_cli("coordinator", "invite", "--name", "carol", "--coordinator", guarded, "--token", OPERATOR_TOKEN)
    assert taken.returncode != 0 and "(409): an invite named 'carol' exists already" in taken.stderr, taken.stderr

    revoked = run_cli("coordinator", "revoke", "--invite", "carol", "--coordinator", guarded, "--token", OPERATOR_TOKEN)
    assert revoked.returncode == 0 and "invite carol revoked" in revoked.stdout, revoked.stderr
    assert httpx.get(f"{guarded}/api/v1/join", headers=bearer(token), timeout=5).status_code == 403
    nobody = run_cli("coordinator", "revoke", "--peer", "QmNobody", "--coordinator", guarded, "--token", OPERATOR_TOKEN)
    assert nobody.returncode != 0 and "(404): no peer 'QmNobody'" in nobody.stderr, nobody.stderr


def test_revocations_reach_the_dht_refuse_certificates_and_outlive_a_restart(processes, tmp_path: Path):
    state = tmp_path / "state"
    args = ["--invite-only", "--token", OPERATOR_TOKEN, "--state-dir", str(state), "--dht-port", str(free_port())]
    proc, url = start_coordinator(TINY, tmp_path / "c0.log", *args)
    port = int(url.rsplit(":", 1)[1])
    procs: list[Proc] = [proc]
    removed = RSAPrivateKey()  # the removed peer's DHT node signs with it
    invited_key, removed_key = new_key(), removed._private_key  # hivemind keeps the cryptography key there
    invited_id, removed_id = peer_id_of(invited_key.public_key()), peer_id_of(removed_key.public_key())
    try:
        # Invite-only, with no join token: nobody joins without an invite's token.
        assert httpx.get(f"{url}/api/v1/join", timeout=5).status_code == 401
        bob, carol = mint(url, "bob", max_peers=3), mint(url, "carol")
        assert certify(url, invited_key, bob["token"]).status_code == 200

        # A peer the operator removes: a DHT node with a key we hold announces itself on stage 0.
        node = member_dht(url, carol["token"], record_key=removed, client_mode=False)  # a member, until removed
        try:
            assert announce_peer(node, "tiny", PeerRecord(peer_id=removed_id, stage=0, address="127.0.0.1:1"))
            wait_for_state(url, lambda s: any(p["peer_id"] == removed_id for p in s["stages"][0]["peers"]))
            removal = httpx.post(f"{url}/api/v1/peers/{removed_id}/remove", headers=OPERATOR, timeout=5)
            assert removal.json() == {"removed": removed_id}
        finally:
            node.shutdown()
        assert revoke(url, "bob").json() == {
            "name": "bob", "identities": 1, "max_peers": 3, "expires": None, "revoked": True,
        }  # fmt: skip
        took = wait_removed(url, carol["token"], {invited_id, removed_id})
        print(f"both revocations read by a member {took:.1f} s after the revocation")

        for attempt in range(2):  # before and after the coordinator restarts on its state
            # The revoked invite admits no one; its identity and the removed peer get no certificate
            # under any invite.
            assert httpx.get(f"{url}/api/v1/join", headers=bearer(bob["token"]), timeout=5).status_code == 403
            refused = certify(url, new_key(), bob["token"])
            assert refused.status_code == 403 and "invite 'bob' has been revoked" in refused.json()["detail"]
            for key, peer_id in ((invited_key, invited_id), (removed_key, removed_id)):
                again = certify(url, key, carol["token"])
                assert again.status_code == 403 and f"peer {peer_id} has been revoked" in again.json()["detail"]
            assert certify(url, new_key(), carol["token"]).status_code == 200  # the other invite still works
            assert [(i["name"], i["revoked"]) for i in listing(url)["invites"]] == [("bob", True), ("carol", False)]
            if attempt == 0:
                assert proc.stop() == 0, proc.output()[-3000:]
                # The old DHT is gone with the coordinator: only a re-publication brings the list back.
                proc, url = start_coordinator(TINY, tmp_path / "c1.log", *args, port=port)
                procs.append(proc)
                took = wait_removed(url, carol["token"], {invited_id, removed_id})
                print(f"both revocations back in the DHT {took:.1f} s after the restarted coordinator served")

        saved = state / "invites.json"
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        text = saved.read_text()
        assert bob["token"] not in text and carol["token"] not in text and invited_id in text and removed_id in text
    finally:
        stop_all(procs)


def test_a_damaged_invites_file_stops_the_coordinator_with_a_clear_error(processes, tmp_path: Path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "invites.json").write_text('{"invites": [{"name": "a/b"}]}')
    started = run_cli("coordinator", "--config", str(TINY), "--port", "0", "--state-dir", str(state), timeout=60)
    assert started.returncode == 2
    assert f"error: {state / 'invites.json'}: invites.0.name: invite name 'a/b'" in started.stderr, started.stderr
