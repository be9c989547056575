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
import functools
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from hivemind.utils.crypto import RSAPrivateKey

from swarm.identity import (
    ROLES,
    CertificateError,
    Issued,
    Member,
    Role,
    load_public_key,
    member_uri,
    now_utc,
    peer_id_of,
    public_pem,
    sign_token,
)

CERT_TTL = datetime.timedelta(hours=24)
CA_TTL = datetime.timedelta(days=3650)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates start this early: members' clocks differ


class RunCA:
    """Issues and checks the run's member certificates."""

    def __init__(
        self, run_id: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, ttl: datetime.timedelta = CERT_TTL
    ):
        """`ttl`: how long the member certificates it issues are valid (members renew them halfway)."""
        self.run_id, self.key, self.cert, self.ttl = run_id, key, cert, ttl

    @classmethod
    def load_or_create(cls, state_dir: Path, run_id: str, ttl: datetime.timedelta = CERT_TTL) -> RunCA:
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
            return cls(run_id, key, cert, ttl)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, run_id),
                x509.NameAttribute(NameOID.COMMON_NAME, f"swarm run {run_id} CA"),
            ]
        )
        now = now_utc()
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
        return cls(run_id, key, cert, ttl)

    @property
    def cert_pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def issue(self, public_key: rsa.RSAPublicKey, role: Role, ttl: datetime.timedelta | None = None) -> Issued:
        """A member certificate for the DHT identity `public_key`, in `role`, valid for `ttl` (default:
        the CA's), with the DHT access token for the same key and lifetime."""
        if role not in ROLES:
            raise CertificateError(f"role: {role!r} is not one of {', '.join(ROLES)}")
        peer_id = peer_id_of(public_key)
        now = now_utc()
        expires = now + (self.ttl if ttl is None else ttl)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(expires)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                # The DNS name is the peer id, so that a caller's TLS handshake checks the id it routed
                # to (gRPC's target name override); the URI says the run and the role.
                x509.SubjectAlternativeName(
                    [x509.DNSName(peer_id), x509.UniformResourceIdentifier(member_uri(self.run_id, role, peer_id))]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return Issued(
            certificate=cert.public_bytes(serialization.Encoding.PEM).decode(),
            ca=self.cert_pem,
            expires=expires.timestamp(),
            dht_token=sign_token(self.key, self.run_id, public_key, expires.timestamp()),
        )

    def member(self, role: Role, key: RSAPrivateKey | None = None) -> Member:
        """A member of this run certified here directly, renewed here: the coordinator's own DHT node
        (with its identity `key`), or a stand-alone one (a fresh key) for a test or a benchmark."""
        key = key if key is not None else RSAPrivateKey()
        renew = functools.partial(self.issue, load_public_key(public_pem(key)), role)
        return Member(self.run_id, role, key, renew(), renew)
