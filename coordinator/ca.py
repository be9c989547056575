"""The run's certificate authority: who is a member of the run, with which DHT identity and role.

The coordinator keeps the CA's key and self-signed certificate in its state directory (`ca.key`,
readable by its owner only, and `ca.pem`), so a restarted coordinator issues under the same root.
A joiner sends the public half of its DHT identity key (RSA, hivemind's); the CA derives the peer id
from that key itself, as libp2p does (a claimed id is never taken on trust), and returns a
certificate for that key naming the run, the role and the peer id, valid for `CERT_TTL`. Whoever
holds the run's root checks a member's certificate with `identity_of`.

All cryptography is the `cryptography` package's (installed with hivemind).
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import multihash
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

Role = Literal["peer", "trainer", "coordinator"]
ROLES: tuple[str, ...] = get_args(Role)
CERT_TTL = datetime.timedelta(hours=24)
CA_TTL = datetime.timedelta(days=3650)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates start this early: members' clocks differ
URI_SCHEME = "swarm"  # a member's certificate names it as swarm://RUN_ID/ROLE/PEER_ID


class CertificateError(ValueError):
    """A certificate or a key that does not make its holder a member of the run; the message says why."""


@dataclass(frozen=True)
class Identity:
    """What a valid member certificate says."""

    run_id: str
    role: Role
    peer_id: str
    not_after: datetime.datetime


def peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key (base58), as hivemind's DHT derives it from the node's
    identity. hivemind only derives one from a private key (`PeerID.from_identity`); this is the same
    rule for the public half: sha2-256 multihash of the key's protobuf `PublicKey` encoding."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def load_public_key(pem: bytes | str) -> rsa.RSAPublicKey:
    """A joiner's DHT public key from PEM; CertificateError when it is not an RSA public key."""
    try:
        key = serialization.load_pem_public_key(pem.encode() if isinstance(pem, str) else pem)
    except ValueError as err:
        raise CertificateError(f"public_key: not a PEM public key ({err})") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise CertificateError("public_key: not an RSA key (a DHT identity is RSA)")
    return key


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class RunCA:
    """Issues and checks the run's member certificates."""

    def __init__(self, run_id: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self.run_id, self.key, self.cert = run_id, key, cert

    @classmethod
    def load_or_create(cls, state_dir: Path, run_id: str) -> RunCA:
        """The CA kept in `state_dir`, made there the first time. A CA of another run is refused."""
        key_path, cert_path = Path(state_dir) / "ca.key", Path(state_dir) / "ca.pem"
        if key_path.exists() and cert_path.exists():
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            named = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
            if not named or named[0].value != run_id:
                raise CertificateError(f"{cert_path}: the CA of another run, not of {run_id!r}")
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise CertificateError(f"{key_path}: not the CA's key")
            return cls(run_id, key, cert)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, run_id),
                x509.NameAttribute(NameOID.COMMON_NAME, f"swarm run {run_id} CA"),
            ]
        )
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + CA_TTL)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        # The key first, readable by the owner only; the certificate last, so that a CA interrupted
        # while being made is made again rather than half loaded.
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(run_id, key, cert)

    @property
    def cert_pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def issue(self, public_key: rsa.RSAPublicKey, role: Role, ttl: datetime.timedelta = CERT_TTL) -> str:
        """A member certificate (PEM) for the DHT identity `public_key`, in `role`, valid for `ttl`."""
        if role not in ROLES:
            raise CertificateError(f"role: {role!r} is not one of {', '.join(ROLES)}")
        peer_id = peer_id_of(public_key)
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + ttl)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(member_uri(self.run_id, role, peer_id))]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM).decode()


def member_uri(run_id: str, role: str, peer_id: str) -> str:
    return f"{URI_SCHEME}://{run_id}/{role}/{peer_id}"


def identity_of(cert_pem: bytes | str, root: x509.Certificate, run_id: str) -> Identity:
    """What a member certificate says, once checked: issued by `root`, for `run_id`, valid now, and
    naming the peer id of the very key it certifies. CertificateError says what failed."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode() if isinstance(cert_pem, str) else cert_pem)
    except ValueError as err:
        raise CertificateError(f"not a PEM certificate ({err})") from None
    try:
        cert.verify_directly_issued_by(root)
    except (ValueError, TypeError, InvalidSignature):
        raise CertificateError("not issued by this run's CA") from None
    now = _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise CertificateError(f"not valid now (valid {cert.not_valid_before_utc} to {cert.not_valid_after_utc})")
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier
        )
    except x509.ExtensionNotFound:
        uris = []
    prefix = f"{URI_SCHEME}://{run_id}/"
    named = [u[len(prefix) :].split("/") for u in uris if u.startswith(prefix)]
    if len(named) != 1 or len(named[0]) != 2 or named[0][0] not in ROLES:
        raise CertificateError(f"names no member of run {run_id!r}")
    role, peer_id = named[0]
    key = cert.public_key()
    if not isinstance(key, rsa.RSAPublicKey) or peer_id_of(key) != peer_id:
        raise CertificateError("names a peer id that is not its key's")
    return Identity(run_id=run_id, role=role, peer_id=peer_id, not_after=cert.not_valid_after_utc)  # type: ignore[arg-type]
