"""The run's certificate authority (coordinator/ca.py): kept across restarts, issuing certificates
that name the peer id derived from the joiner's own DHT key, and refusing anything else."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from coordinator.ca import RunCA
from swarm.identity import CertificateError, identity_of, load_public_key, peer_id_of
from tests.conftest import CONFIGS
from tests.processes import start_coordinator


def dht_identity() -> tuple[rsa.RSAPrivateKey, str]:
    """An RSA key as a hivemind DHT identity holds it, and the peer id hivemind derives from it."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    identity = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return key, PeerID.from_identity(identity).to_base58()


def test_the_peer_id_is_derived_from_the_key_as_hivemind_derives_it():
    key, peer_id = dht_identity()
    assert peer_id_of(key.public_key()) == peer_id


def test_the_ca_outlives_a_restart_and_keeps_its_key_private(tmp_path: Path):
    ca = RunCA.load_or_create(tmp_path, "tiny")
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600
    again = RunCA.load_or_create(tmp_path, "tiny")
    assert again.cert_pem == ca.cert_pem
    key, peer_id = dht_identity()
    issued = again.issue(key.public_key(), "peer")
    assert identity_of(issued.certificate, ca.cert, "tiny").peer_id == peer_id
    with pytest.raises(CertificateError, match="another run"):
        RunCA.load_or_create(tmp_path, "other")


def test_a_certificate_names_the_run_role_and_the_keys_own_peer_id(tmp_path: Path):
    ca = RunCA.load_or_create(tmp_path, "tiny")
    key, peer_id = dht_identity()
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    who = identity_of(ca.issue(load_public_key(pem), "trainer").certificate, ca.cert, "tiny")
    assert (who.run_id, who.role, who.peer_id) == ("tiny", "trainer", peer_id)
    left = who.not_after - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(hours=23) < left <= datetime.timedelta(hours=24)


def test_certificates_that_make_no_member_are_refused(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ca, foreign = RunCA.load_or_create(tmp_path / "a", "tiny"), RunCA.load_or_create(tmp_path / "b", "tiny")
    key, _ = dht_identity()
    with pytest.raises(CertificateError, match="not issued by this run's CA"):
        identity_of(foreign.issue(key.public_key(), "peer").certificate, ca.cert, "tiny")
    with pytest.raises(CertificateError, match="names no member of run 'other'"):
        identity_of(ca.issue(key.public_key(), "peer").certificate, ca.cert, "other")
    with pytest.raises(CertificateError, match="not valid now"):
        identity_of(ca.issue(key.public_key(), "peer", ttl=datetime.timedelta(minutes=-1)).certificate, ca.cert, "tiny")
    with pytest.raises(CertificateError, match="role"):
        ca.issue(key.public_key(), "admin")  # type: ignore[arg-type]
    with pytest.raises(CertificateError, match="not a PEM certificate"):
        identity_of("hello", ca.cert, "tiny")


def test_a_key_that_is_no_dht_identity_is_refused():
    not_rsa = ec.generate_private_key(ec.SECP256R1()).public_key()
    pem = not_rsa.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(CertificateError, match="not an RSA key"):
        load_public_key(pem)
    with pytest.raises(CertificateError, match="not a PEM public key"):
        load_public_key(b"-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n")


def test_a_real_coordinator_certifies_a_joiner_with_the_join_token_and_keeps_its_ca(processes, tmp_path: Path):
    config, state = CONFIGS / "tiny.toml", tmp_path / "state"
    key, peer_id = dht_identity()
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    ask = {"public_key": pem.decode(), "role": "peer"}
    roots = []
    for attempt in range(2):  # the second coordinator restarts on the first one's state
        flags = ["--join-token", "invite", "--state-dir", str(state)]
        proc, url = start_coordinator(config, tmp_path / f"c{attempt}.log", *flags)
        try:
            assert httpx.post(f"{url}/api/v1/certificate", json=ask).status_code == 401
            given = httpx.post(f"{url}/api/v1/certificate", json=ask, headers={"Authorization": "Bearer invite"})
            assert given.status_code == 200, given.text
            body = given.json()
            root = x509.load_pem_x509_certificate(body["ca"].encode())
            member = identity_of(body["certificate"], root, "tiny")
            assert (member.peer_id, member.role, body["peer_id"]) == (peer_id, "peer", peer_id)
            roots.append(body["ca"])
            not_rsa = (
                ec.generate_private_key(ec.SECP256R1())
                .public_key()
                .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
            )
            refused = httpx.post(
                f"{url}/api/v1/certificate",
                json={"public_key": not_rsa.decode(), "role": "peer"},
                headers={"Authorization": "Bearer invite"},
            )
            assert refused.status_code == 422 and "not an RSA key" in refused.text
        finally:
            proc.stop()
    assert roots[0] == roots[1]
