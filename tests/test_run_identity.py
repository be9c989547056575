"""This process's side of run membership (swarm/identity.py): certificates renewed before they lapse,
on a real stage server and its callers, and the DHT access tokens its authorizer admits."""

from __future__ import annotations

import asyncio
import datetime
import time

import grpc
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from coordinator.ca import RunCA
from peer.service import start_server
from peer.worker import StageWorker
from swarm.client import StageClient
from swarm.config import load_config
from swarm.identity import RunAuthorizer, SessionKey, sign_token, token_problem
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


def _request(authorizer: RunAuthorizer, keys: list[bytes] = (b"stage-0",)) -> dht_pb2.FindRequest:
    """A real DHT request, signed by `authorizer` as its node would sign it."""
    request = dht_pb2.FindRequest(keys=list(keys))
    asyncio.run(authorizer.sign_request(request, None))
    return request


def _admits(authorizer: RunAuthorizer, request: dht_pb2.FindRequest) -> bool:
    copy = dht_pb2.FindRequest()
    copy.CopyFrom(request)  # a check empties the signature field: each check gets the bytes as sent
    return asyncio.run(authorizer.validate_request(copy))


def test_dht_messages_count_only_when_signed_by_a_session_key_the_tokens_key_certified(tmp_path):
    """Every DHT request and response is signed with a member's Ed25519 session key, which the RSA
    key its token names certified for that token (swarm/identity.py `SessionKey`). A hostile node
    that holds a member's token (every request carries one) but not its key gets nowhere: with a
    session key it certified itself, with the member's certificate and a key of its own, with a
    certificate of the member's earlier token, or with a signature of the member's request replayed
    or edited. A plain RSA signature (hivemind's own scheme) does not count either."""
    ca = RunCA.load_or_create(tmp_path, "tiny")
    alice, bob = ca.member("peer"), ca.member("trainer")
    sender, receiver = alice.authorizer(), bob.authorizer()

    honest = _request(sender)
    assert _admits(receiver, honest)
    assert not _admits(receiver, honest), "a replayed request was admitted"
    edited = _request(sender)
    edited.keys[0] = b"stage-1"
    assert not _admits(receiver, edited), "a request edited after signing was admitted"

    # A thief with alice's token and a key of its own certifies its own session key.
    thief = RunAuthorizer(RSAPrivateKey(), alice.issued.dht_token, alice.issued.ca, "tiny")
    assert not _admits(receiver, _request(thief)), "a stolen token with a self-certified session key was admitted"

    # The thief copies alice's session key and certificate off one of her requests, and signs with its own key.
    stolen = _request(thief)
    theirs = _request(sender).auth.signature
    stolen.auth.signature = b""
    own = SessionKey(RSAPrivateKey())
    own.certify(stolen.auth.client_access_token)
    forged = own.sign(stolen.SerializeToString())
    stolen.auth.signature = theirs[:32] + forged[32:96] + theirs[96:]
    assert not _admits(receiver, stolen), "alice's certificate beside the thief's signature was admitted"

    # The certificate is for one token: alice's session certified for her first token does not sign
    # with the renewed one (a session key that leaked is worth nothing once the token is renewed).
    first = _request(sender)
    renewed = AccessToken.FromString(
        ca.issue(RSAPublicKey.from_bytes(first.auth.client_access_token.public_key)._public_key, "peer").dht_token
    )
    assert (
        renewed.username == first.auth.client_access_token.username
        and renewed.signature != first.auth.client_access_token.signature
    )
    session = sender._local_private_key
    stale = dht_pb2.FindRequest(keys=[b"stage-0"])
    stale.auth.CopyFrom(first.auth)
    stale.auth.client_access_token.CopyFrom(renewed)
    stale.auth.signature = b""
    stale.auth.signature = session._public + session._session.sign(stale.SerializeToString()) + session._certificate
    assert not _admits(receiver, stale), "a session certified for an earlier token was admitted"

    # hivemind's own scheme: alice's token and her RSA key's signature of the whole request.
    plain = dht_pb2.FindRequest(keys=[b"stage-0"])
    asyncio.run(TokenAuthorizerBase.sign_request(_Plain(alice), plain, None))
    assert not _admits(receiver, plain), "a plain RSA signature was admitted"

    # Responses: signed for the request they answer, by the answering member's session.
    request = _request(sender)
    response = dht_pb2.FindResponse()
    asyncio.run(receiver.sign_response(response, request))
    assert asyncio.run(sender.validate_response(_copy(response), request))
    assert not asyncio.run(sender.validate_response(_copy(response), _request(sender))), "an answer to another request"
    forged_response = dht_pb2.FindResponse()
    asyncio.run(
        RunAuthorizer(RSAPrivateKey(), bob.issued.dht_token, bob.issued.ca, "tiny").sign_response(
            forged_response, request
        )
    )
    assert not asyncio.run(sender.validate_response(forged_response, request)), "a response under a stolen token"


def _copy(response: dht_pb2.FindResponse) -> dht_pb2.FindResponse:
    copy = dht_pb2.FindResponse()
    copy.CopyFrom(response)
    return copy


class _Plain(RunAuthorizer):
    """hivemind's own signing (the member's RSA key over the whole request), with a member's token."""

    def __init__(self, member):
        super().__init__(member.key, member.issued.dht_token, member.issued.ca, member.run_id)
        self._local_private_key = member.key

    async def get_token(self) -> AccessToken:
        return self.token
