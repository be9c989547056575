"""Trust in a run: a join token keeps strangers out, signed DHT records keep peers honest.

A run started with `swarm coordinator --join-token` hands its config, DHT addresses and run
certificates only to those who send the token; its stage workers answer only members of the run
(mutual TLS, the run's CA as root) and its DHT only members' nodes. Every record in
the DHT is signed by its writer (hivemind's RSASignatureValidator on every node), so a forging DHT
node can neither overwrite a live peer's record nor slip in a record nobody signed; and a node's
peer id derives from the key it signs with, so it cannot pass off a stage record as another peer's.
Neither token ever shows in a log line, the API or the dashboard.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import hivemind
import httpx
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from coordinator.ca import RunCA
from swarm.cli import build_parser
from swarm.client import StageClient
from swarm.config import ConfigError
from swarm.identity import RunAuthorizer
from swarm.join import join_dht, join_run, request_certificate
from swarm.records import (
    OWNER_MARKER,
    ControlState,
    PeerRecord,
    _write_identity,
    announce_control,
    announce_peer,
    announce_removed,
    maddr_peer_ids,
    make_dht,
    owned_subkey,
    read_control,
    read_removed,
    read_stage,
    shutdown_dht,
    signer_peer_id,
    stage_key,
    started_dht,
    visible_maddrs,
)
from swarm.rpc import SERVICE, method_path, pb
from swarm.wire import encode
from tests.harness import Swarm, peer_record, swarm_fixture
from tests.processes import child, member_dht, wait_for_state
from tests.test_averaging import FAST_AVERAGING, config_with

JOIN_TOKEN = "join-7f3a9c1e5d"
OPERATOR_TOKEN = "operator-b42e8d06aa"
STEPS = 2


@swarm_fixture(scope="module")
def guarded(tmp_path_factory):
    """A run with a join token and an operator token: one peer per stage, both given the token, and
    a trainer with it that has finished STEPS steps (`trainers`: the state's trainers, read before
    the gone trainer's record expires)."""
    tmp = tmp_path_factory.mktemp("trust")
    path, run = config_with(tmp, FAST_AVERAGING)
    swarm = Swarm(tmp, path, ("--join-token", JOIN_TOKEN, "--token", OPERATOR_TOKEN))
    swarm.run = run
    try:
        swarm.add_peer("p0", 0, "--join-token", JOIN_TOKEN)
        swarm.add_peer("p1", 1, "--join-token", JOIN_TOKEN)
        swarm.wait_online(["p0", "p1"])
        swarm.trainer = child(
            [
                "train",
                "--coordinator",
                swarm.url,
                "--steps",
                str(STEPS),
                "--join-token",
                JOIN_TOKEN,
                "--log-json",
                str(tmp / "train.jsonl"),
            ],
            tmp / "trainer.log",
        )
        swarm.finish_training(timeout=120)
        finished = wait_for_state(swarm.url, lambda s: any(t["steps"] == STEPS for t in s["trainers"]))
        swarm.trainers = finished["trainers"]
        yield swarm
    finally:
        swarm.close()


def test_join_needs_the_token(guarded):
    url = f"{guarded.url}/api/v1/join"
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": f"Basic {JOIN_TOKEN}"}):
        refused = httpx.get(url, headers=headers, timeout=5)
        assert refused.status_code == 401, headers
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        assert "join token" in refused.json()["detail"] and JOIN_TOKEN not in refused.text
    joined = httpx.get(url, headers={"Authorization": f"Bearer {JOIN_TOKEN}"}, timeout=5)
    assert joined.status_code == 200 and joined.json()["initial_peers"]
    # Watching the run stays open to everyone.
    assert httpx.get(f"{guarded.url}/api/v1/state", timeout=5).status_code == 200


def test_a_peer_without_the_token_is_refused(guarded, tmp_path):
    strangers = [
        child(["peer", "--coordinator", guarded.url, "--stage", "0", *extra], tmp_path / f"stranger-{i}.log")
        for i, extra in enumerate([(), ("--join-token", "not-the-token")])
    ]
    try:
        codes = [p.popen.wait(60) for p in strangers]
    finally:
        for p in strangers:
            p.stop()
    assert codes == [2, 2]
    for p in strangers:
        assert "join token" in p.output() and JOIN_TOKEN not in p.output() and "Traceback" not in p.output()


REQUESTS = {
    "Info": pb.InfoRequest(),
    "Parameters": pb.ParametersRequest(run_id="tiny", stage=0),
    "Forward": pb.ForwardRequest(run_id="tiny", stage=0, microbatch_id="x"),
    "Backward": pb.BackwardRequest(run_id="tiny", stage=0, microbatch_id="x"),
    "Retract": pb.RetractRequest(run_id="tiny", stage=0, microbatch_id="x"),
}


def test_stage_workers_answer_members_of_the_run_only(guarded, tmp_path):
    """Stage calls are mutual TLS with the run's CA as root: a plaintext call gets nothing, even with
    the join token; so does a certificate of another CA (of a run with the same id), and a member
    that dials an address expecting another peer than the one serving there."""
    state = wait_for_state(guarded.url, lambda s: peer_record(s, "p0") and peer_record(s, "p1"))
    p0, p1 = peer_record(state, "p0"), peer_record(state, "p1")
    channel = grpc.insecure_channel(p0["address"])
    try:
        for method, request in REQUESTS.items():
            call = channel.unary_unary(method_path(method), request_serializer=lambda m: m.SerializeToString())
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=10, metadata=(("authorization", f"Bearer {JOIN_TOKEN}"),))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, method
    finally:
        channel.close()
    member = join_run(guarded.url, RSAPrivateKey(), "trainer", "tiny", JOIN_TOKEN)
    foreign = RunCA.load_or_create(tmp_path, "tiny").member("trainer")
    for who, expected in ((foreign, p0["peer_id"]), (member, p1["peer_id"])):
        client = StageClient(p0["address"], guarded.run, member=who, peer_id=expected)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                client.info()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            client.close()
    client = StageClient(p0["address"], guarded.run, member=member, peer_id=p0["peer_id"])
    try:
        assert client.info().stage == 0
    finally:
        client.close()


class Intruder:
    """A gRPC server of an outsider: it answers every stage method with UNAVAILABLE and keeps what each
    call carried (its metadata, the join token among it if a trainer sent one)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

        def handler(method: str):
            def record(request: bytes, context: grpc.ServicerContext) -> None:
                self.calls.append((method, dict(context.invocation_metadata())))
                context.abort(grpc.StatusCode.UNAVAILABLE, "busy")

            return grpc.unary_unary_rpc_method_handler(record)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {m: handler(m) for m in REQUESTS}),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def test_a_member_cannot_take_back_the_gradient_of_anothers_training_call(guarded):
    """A hostile member that learned a microbatch id (every stage sees the ids) asks the last stage's
    peer to take back that microbatch's gradient (`Retract`), which would silently drop a trainer's
    samples: refused, as only the caller that sent the training call may."""
    state = wait_for_state(guarded.url, lambda s: peer_record(s, "p1"))
    p1 = peer_record(state, "p1")
    run = guarded.run
    trainer = join_run(guarded.url, RSAPrivateKey(), "trainer", run.run_id, JOIN_TOKEN)
    hostile = join_run(guarded.url, RSAPrivateKey(), "trainer", run.run_id, JOIN_TOKEN)
    clients = [StageClient(p1["address"], run, member=m, peer_id=p1["peer_id"]) for m in (trainer, hostile)]
    honest, thief = clients
    try:
        step = honest.info().optimizer_steps
        x = encode(torch.randn(2, 8, run.model.d_model))
        targets = encode(torch.randint(0, run.model.vocab_size, (2, 8)))
        scale = 2 / run.training.global_batch
        honest.forward(1, x, "trainer-mb-7", step, targets=targets, train=True, loss_scale=scale)
        served = honest.info().samples_served
        with pytest.raises(grpc.RpcError) as refused:
            thief.retract(1, "trainer-mb-7")
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
        assert "only the caller that sent 'trainer-mb-7'" in refused.value.details()
        assert honest.info().samples_served == served, "the thief's retract dropped the trainer's samples"
        assert honest.retract(1, "trainer-mb-7").samples == 2  # its own caller may
        assert honest.info().samples_served == served - 2
    finally:
        for c in clients:
            c.close()


def test_an_outsider_who_joins_the_dht_with_its_own_key_gets_no_call_and_no_token(guarded, tmp_path):
    """An outsider reads everything public, learns the coordinator's DHT address (say, by scanning),
    joins the DHT with a key of its own and publishes a stage-0 record, signed by that key, that
    points at its own server and claims a huge throughput. The run's DHT takes none of it, no
    trainer calls it, and it never sees the join token."""
    public = httpx.get(f"{guarded.url}/api/v1/state", timeout=5).json()
    assert public["stages"][0]["peers"] and not [p for s in public["stages"] for p in s["peers"] if p["dht_addrs"]]
    insider = {"Authorization": f"Bearer {JOIN_TOKEN}"}
    listed = httpx.get(f"{guarded.url}/api/v1/state", headers=insider, timeout=5).json()
    assert all(p["dht_addrs"] for s in listed["stages"] for p in s["peers"])
    peers = httpx.get(f"{guarded.url}/api/v1/join", headers=insider, timeout=5).json()["initial_peers"]

    intruder = Intruder()
    key = RSAPrivateKey()
    validator = RSASignatureValidator(key)
    node = started_dht(
        initial_peers=peers,
        identity_path=str(_write_identity(key, tmp_path / "intruder.key")),
        record_validators=[validator],
        ensure_bootstrap_success=False,  # it starts even when nobody answers it
    )
    node.record_owner = validator.local_public_key.decode()
    try:
        fake = PeerRecord(
            peer_id=node.peer_id.to_base58(),
            stage=0,
            address=f"127.0.0.1:{intruder.port}",
            public_name="fastest",
            state="online",
            throughput=1e6,
            capacity=1e6,
        )
        for _ in range(3):  # it keeps its own copy; no member takes one
            announce_peer(node, "tiny", fake, ttl=600, timeout=10)
        reader = member_dht(guarded.url, JOIN_TOKEN)
        assert "fastest" not in [r.public_name for r in read_stage(reader, "tiny", 0)]
        assert read_stage(reader, "tiny", 0)  # the real peer's record is there to read
        shutdown_dht(reader)
        trainer = child(
            ["train", "--coordinator", guarded.url, "--steps", "2", "--join-token", JOIN_TOKEN],
            tmp_path / "trainer.log",
        )
        try:
            assert trainer.popen.wait(180) == 0, trainer.output()[-3000:]
        finally:
            trainer.stop()
        state = httpx.get(f"{guarded.url}/api/v1/state", timeout=5).json()
        assert "fastest" not in [p["public_name"] for s in state["stages"] for p in s["peers"]]
    finally:
        shutdown_dht(node)
        intruder.server.stop(0)
    assert intruder.calls == []


def test_a_node_with_a_members_dht_token_but_not_its_key_reads_and_writes_nothing(guarded, tmp_path):
    """Every DHT request carries its sender's access token, so anyone on the path can copy one. A
    hostile node joins the run's DHT with a member's copied token and a key of its own (its session
    key certified by that key, not the token's): it reads no record of the run, and the record it
    stores for itself reaches no member."""
    insider = {"Authorization": f"Bearer {JOIN_TOKEN}"}
    peers = httpx.get(f"{guarded.url}/api/v1/join", headers=insider, timeout=5).json()["initial_peers"]
    victim = join_run(guarded.url, RSAPrivateKey(), "trainer", guarded.run.run_id, JOIN_TOKEN)
    key = RSAPrivateKey()
    validator = RSASignatureValidator(key)
    thief = RunAuthorizer(key, victim.issued.dht_token, victim.issued.ca, guarded.run.run_id)
    node = started_dht(
        initial_peers=peers,
        identity_path=str(_write_identity(key, tmp_path / "thief.key")),
        record_validators=[validator],
        authorizer=thief,
        ensure_bootstrap_success=False,
    )
    node.record_owner = validator.local_public_key.decode()
    reader = member_dht(guarded.url, JOIN_TOKEN)
    try:
        assert read_stage(reader, guarded.run.run_id, 0), "a member reads the live peer's record"
        assert read_stage(node, guarded.run.run_id, 0) == [], "the thief read the run's records"
        fake = PeerRecord(
            peer_id=node.peer_id.to_base58(),
            stage=0,
            address="127.0.0.1:9",
            public_name="thief",
            state="online",
            throughput=1e6,
            capacity=1e6,
        )
        announce_peer(node, guarded.run.run_id, fake, ttl=600, timeout=10)
        assert "thief" not in [r.public_name for r in read_stage(reader, guarded.run.run_id, 0)]
    finally:
        shutdown_dht(reader)
        shutdown_dht(node)


def test_a_run_with_a_join_token_trains(guarded):
    records = guarded.records()
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["loss"] > 0 for r in records)
    # Other tests of the module may train further steps on this run: the peers follow the run's step.
    state = wait_for_state(
        guarded.url, lambda s: all(peer_record(s, n)["optimizer_steps"] == s["global_step"] for n in ("p0", "p1"))
    )
    assert state["global_step"] >= STEPS
    assert [t["steps"] for t in guarded.trainers] == [STEPS]


def test_tokens_never_show_in_logs_api_or_dashboard(guarded):
    url = guarded.url
    operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    assert httpx.post(f"{url}/api/v1/control/pause", headers=operator, timeout=5).status_code == 200
    assert httpx.post(f"{url}/api/v1/control/resume", headers=operator, timeout=5).status_code == 200
    pages = {
        path: httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {JOIN_TOKEN}"}, timeout=5).text
        for path in ["/api/v1/join", "/api/v1/state", "/api/v1/history", "/api/v1/events", "/openapi.json", "/metrics"]
    }
    pages["/"] = httpx.get(url, timeout=5).text
    pages.update({p: httpx.get(f"{url}/static/{p}", timeout=5).text for p in ("app.js", "index.html")})
    logs = {p.log_path.name: p.output() for p in [guarded.coordinator, guarded.trainer, *guarded.peers.values()]}
    assert len(pages) == 9 and all(pages.values()) and all(logs.values())
    for token in (JOIN_TOKEN, OPERATOR_TOKEN):
        assert not [where for where, text in {**pages, **logs}.items() if token in text], token


# -- signed records ----------------------------------------------------------------------------


class ForeignSignature(RSASignatureValidator):
    """A forger's validator: signs every record with its own key, whoever the subkey names."""

    def sign_value(self, record):
        signature = self._private_key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)


def test_a_forging_node_cannot_overwrite_invent_or_impersonate_records(processes, tmp_path):
    swarm = Swarm(tmp_path)
    forgers: list[hivemind.DHT] = []
    dhts: list[hivemind.DHT] = []
    try:
        swarm.add_peer("victim", 0)
        genuine = peer_record(swarm.wait_online(["victim"]), "victim")
        peers = httpx.get(f"{swarm.url}/api/v1/join", timeout=5).json()["initial_peers"]
        key = stage_key("tiny", 0)
        dhts.append(member_dht(swarm.url))
        subkey = next(s for s in dhts[0].get(key, latest=True).value if s.startswith(genuine["peer_id"]))
        victim_key = subkey[len(genuine["peer_id"]) :]  # `[owner:ssh-rsa ...]`
        forged = dict(genuine, address="203.0.113.66:666", public_name="forged", updated=get_dht_time())
        fake = dict(forged, peer_id="fake-peer", public_name="fake")
        expires = get_dht_time() + 600
        # A node that signs nothing, and one that signs everything with its own key.
        # Members of the run (the DHT answers no one else), with certificates of their own.
        certified = [join_run(swarm.url, RSAPrivateKey(), "trainer", "tiny").authorizer() for _ in range(2)]
        forgers.append(started_dht(initial_peers=peers, authorizer=certified[0]))
        forgers.append(
            started_dht(
                initial_peers=peers, record_validators=[ForeignSignature(RSAPrivateKey())], authorizer=certified[1]
            )
        )
        for forger in forgers:
            forger.store(key, forged, expires, subkey=subkey)  # over the victim's record
            forger.store(key, fake, expires, subkey="fake-peer" + victim_key)  # a new one in the victim's name
            forger.store(key, fake, expires, subkey="fake-peer")  # one that names no owner
        # Its own records it can sign, but a stage record counts only from the peer it names, and
        # the operator's word only from the coordinator.
        impostor = PeerRecord.model_validate(dict(forged, public_name="impostor"))
        assert announce_peer(dhts[0], "tiny", impostor, ttl=600, timeout=10)  # the victim's id, under its own key
        assert announce_removed(dhts[0], "tiny", genuine["peer_id"], timeout=10)
        assert announce_control(dhts[0], "tiny", ControlState(paused=True), timeout=10)
        dhts.append(member_dht(swarm.url))  # a reader that joins after the forgery
        expected = [(genuine["peer_id"], genuine["address"], "victim")]
        deadline = time.monotonic() + 8  # several refreshes of the victim's record, and reads of the coordinator
        while time.monotonic() < deadline:
            for dht in dhts:
                assert [(r.peer_id, r.address, r.public_name) for r in read_stage(dht, "tiny", 0)] == expected
            listed = httpx.get(f"{swarm.url}/api/v1/state", timeout=5).json()["stages"][0]["peers"]
            assert [(r["peer_id"], r["address"], r["public_name"]) for r in listed] == expected
            assert not read_control(dhts[1], "tiny", maddr_peer_ids(peers)).paused
            assert not httpx.get(f"{swarm.url}/api/v1/state", timeout=5).json()["paused"]
            time.sleep(0.5)
        assert swarm.peers["victim"].popen.poll() is None, "the victim left on a forged removal"
        assert genuine["peer_id"] in read_removed(dhts[1], "tiny")  # the forgeries are there, and ignored
        assert owned_subkey(dhts[0], genuine["peer_id"]) in dhts[1].get(key, latest=True).value
    finally:
        for dht in [*forgers, *dhts]:
            shutdown_dht(dht)
        swarm.close()


def test_a_nodes_peer_id_derives_from_the_key_it_signs_with(processes):
    dhts = [make_dht()]
    try:
        dhts.append(make_dht(visible_maddrs(dhts[0]), client_mode=True))  # a second node of this process
        dhts.append(make_dht(visible_maddrs(dhts[0]), client_mode=True, record_key=RSAPrivateKey()))
        for dht in dhts:
            assert signer_peer_id(OWNER_MARKER.search(dht.record_owner).group(1)) == dht.peer_id.to_base58()
        assert len({dht.peer_id for dht in dhts}) == len(dhts)
    finally:
        for dht in dhts:
            shutdown_dht(dht)


def test_the_join_token_comes_from_the_environment_unless_flagged(monkeypatch):
    monkeypatch.setenv("SWARM_JOIN_TOKEN", "from-the-environment")
    commands = [
        ["coordinator", "--config", "run.toml"],
        ["peer", "--coordinator", "http://127.0.0.1:8000"],
        ["train", "--coordinator", "http://127.0.0.1:8000"],
        ["export", "--coordinator", "http://127.0.0.1:8000", "--out", "model"],
    ]
    for command in commands:
        assert build_parser().parse_args(command).join_token == "from-the-environment"
        assert build_parser().parse_args([*command, "--join-token", "flagged"]).join_token == "flagged"


def test_a_stage_served_by_hand_asks_for_the_token_given_to_it(processes, tmp_path):
    from tests.conftest import run_cli
    from tests.harness import TINY
    from tests.processes import start_peer

    workers = [start_peer(TINY, k, tmp_path, "--join-token", "by-hand-secret") for k in (0, 1)]
    try:
        peers = ",".join(address for _, address in workers)
        refused = run_cli("train", "--config", str(TINY), "--peers", peers, "--steps", "2", timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert "refused the call: give the run's join token" in refused.stderr
        log = tmp_path / "train.jsonl"
        args = ["--peers", peers, "--steps", "2", "--log-json", str(log), "--join-token", "by-hand-secret"]
        done = run_cli("train", "--config", str(TINY), *args, timeout=120)
        assert done.returncode == 0, done.stderr
        assert len(log.read_text().splitlines()) == 2
        assert all("by-hand-secret" not in proc.output() for proc, _ in workers)
    finally:
        for proc, _ in workers:
            proc.stop()


def test_a_revoked_member_is_refused_within_10_s(guarded):
    """A volunteer joins with an invite and calls a stage worker; the operator revokes the invite.
    Within 10 s the worker refuses that member's calls, on the connection it already has, and the
    coordinator refuses to renew its certificate."""
    url, operator = guarded.url, {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    minted = httpx.post(f"{url}/api/v1/invites", json={"name": "eve"}, headers=operator, timeout=10)
    assert minted.status_code == 201, minted.text
    token = minted.json()["token"]
    run, _, dht, member = join_dht(url, "trainer", token, client_mode=True)
    p0 = peer_record(wait_for_state(url, lambda s: peer_record(s, "p0")), "p0")
    client = StageClient(p0["address"], run, member=member, peer_id=p0["peer_id"])
    try:
        assert client.info().stage == 0
        revoked = httpx.post(f"{url}/api/v1/invites/eve/revoke", headers=operator, timeout=10)
        assert revoked.status_code == 200 and revoked.json()["revoked"], revoked.text
        started = time.monotonic()
        while True:
            try:
                client.info()
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
                assert "revoked" in err.details()
                break
            assert time.monotonic() - started < 10.0, "a revoked member's calls were still answered after 10 s"
            time.sleep(0.2)
        with pytest.raises(ConfigError, match="403"):
            request_certificate(url, member.key, "trainer", token)
    finally:
        client.close()
        member.stop()
        shutdown_dht(dht)
