"""This process's side of run membership (swarm/identity.py): certificates renewed before they lapse,
on a real stage server and its callers, and the DHT access tokens its authorizer admits."""

from __future__ import annotations

import datetime
import time

import grpc
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPublicKey

from coordinator.ca import RunCA
from peer.service import start_server
from peer.worker import StageWorker
from swarm.client import StageClient
from swarm.config import load_config
from swarm.identity import sign_token, token_problem
from swarm.rpc import method_path, pb
from tests.conftest import CONFIGS

TTL_S = 8.0


def test_certificates_are_renewed_before_they_lapse_on_both_ends_of_a_call(tmp_path):
    """Certificates valid for TTL_S: the server's and the caller's are renewed halfway, so a caller
    that connects after the first certificates expired still gets an answer, from a server that
    presents its renewed certificate. A caller still holding the first certificate is refused."""
    run = load_config(CONFIGS / "tiny.toml")
    ca = RunCA.load_or_create(tmp_path, run.run_id, ttl=datetime.timedelta(seconds=TTL_S))
    peer, trainer = ca.member("peer"), ca.member("trainer")
    stale = trainer.channel_credentials()  # what the trainer held before any renewal
    worker = StageWorker(run, 1, torch.device("cpu"))
    server, _, port = start_server(worker, "127.0.0.1", 0, member=peer)
    for m in (peer, trainer):
        m.start(None, set)
    address = f"127.0.0.1:{port}"
    try:
        first = StageClient(address, run, member=trainer, peer_id=peer.peer_id)
        assert first.info().stage == 1
        first.close()
        time.sleep(TTL_S * 1.5)  # the first certificates have expired
        assert peer.generation >= 1 and trainer.generation >= 1
        fresh = StageClient(address, run, member=trainer, peer_id=peer.peer_id)
        assert fresh.info().stage == 1
        fresh.close()
        channel = grpc.secure_channel(address, stale, options=trainer.target_options(peer.peer_id))
        call = channel.unary_unary(method_path("Info"), request_serializer=lambda m: m.SerializeToString())
        with pytest.raises(grpc.RpcError) as refused:
            call(pb.InfoRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    finally:
        for m in (peer, trainer):
            m.stop()
        server.stop(0)
        worker.close()


def test_the_dht_admits_tokens_of_the_run_ca_only(tmp_path):
    """What `RunAuthorizer` checks on every DHT request and response: a token signed by this run's CA,
    for the key it names, not expired, not revoked. Forged, foreign, stale and revoked ones fail."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ca, foreign = RunCA.load_or_create(tmp_path / "a", "tiny"), RunCA.load_or_create(tmp_path / "b", "tiny")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    soon = time.time() + 60

    def token(signer: RunCA = ca, expires: float = soon, run_id: str = "tiny") -> AccessToken:
        return AccessToken.FromString(sign_token(signer.key, run_id, key, expires))

    good = token()
    assert token_problem(good, ca.cert, "tiny", frozenset()) is None
    assert token_problem(good, ca.cert, "tiny", frozenset({good.username})) == "revoked"
    assert token_problem(token(foreign), ca.cert, "tiny", frozenset()) == "not signed by the run's CA"
    assert token_problem(token(run_id="other"), ca.cert, "tiny", frozenset()) == "not signed by the run's CA"
    assert token_problem(token(expires=time.time() - 1), ca.cert, "tiny", frozenset()) == "expired"
    for field, value in (
        ("username", "QmSomeoneElse"),
        ("expiration_time", repr(soon + 3600)),
        ("public_key", RSAPublicKey(rsa.generate_private_key(65537, 2048).public_key()).to_bytes()),
    ):
        tampered = AccessToken()
        tampered.CopyFrom(good)
        setattr(tampered, field, value)
        assert token_problem(tampered, ca.cert, "tiny", frozenset()) == "not signed by the run's CA", field
