"""Membership of a run: who a member is, and how members prove it to each other.

The coordinator's run CA (coordinator/ca.py) certifies a joiner's DHT identity key: an X.509
certificate naming the run, the member's role and its DHT peer id (derived from the key, as libp2p
does), and a DHT access token (hivemind's `AccessToken`) signed by the same CA. A `Member` is this
process's side of that: its key, its certificate and token, the run's root, renewal before they
lapse, and the peer ids the operator revoked (read from the DHT, the coordinator's `removed` records).

With them:
- the stage service and its callers speak mutual TLS (`server_credentials`, `channel_credentials`):
  the root is the run CA, so a plaintext call or one with another run's certificate gets no answer;
  a caller names the peer id it routed to (`target_options`), and the handshake fails unless the
  server's certificate names that id; a revoked caller is refused (`refusal`) within one poll;
- the DHT admits only members (`RunAuthorizer`, hivemind's authorizer hook): every request and
  response carries a CA-signed token and a signature by a session key that the token's key
  certified for that token (`SessionKey`), so a node without a token can neither read nor store,
  a token copied off the wire is worth nothing without its holder's key, and a revoked member's
  token stops counting.

All cryptography is the `cryptography` package's (installed with hivemind).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import grpc
import hivemind
import multihash
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, TokenAuthorizerBase
from hivemind.utils.crypto import PrivateKey, RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

log = logging.getLogger(__name__)

Role = Literal["peer", "trainer", "coordinator"]
ROLES: tuple[str, ...] = get_args(Role)
URI_SCHEME = "swarm"  # a member's certificate names it as swarm://RUN_ID/ROLE/PEER_ID
TOKEN_DOMAIN = b"swarm dht access token\0"  # what a CA signature over a DHT token is for, and nothing else
SESSION_DOMAIN = b"swarm dht session key\0"  # what a member's signature over a session key is for
REVOCATION_POLL_S = 4.0  # how often a member reads the revoked peer ids (a revoked caller is refused within)
RENEW_AT = 0.5  # a certificate is renewed once this share of its lifetime has passed


class CertificateError(ValueError):
    """A certificate or a key that does not make its holder a member of the run; the message says why."""


@dataclass(frozen=True)
class Identity:
    """What a valid member certificate says."""

    run_id: str
    role: Role
    peer_id: str
    not_after: datetime.datetime


@dataclass(frozen=True)
class Issued:
    """What the run CA hands a member: PEM certificate, the CA's PEM certificate, when they lapse
    (unix time), and the DHT access token (hivemind's AccessToken, serialized)."""

    certificate: str
    ca: str
    expires: float
    dht_token: bytes


def now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


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


def crypto_key(key: RSAPrivateKey) -> rsa.RSAPrivateKey:
    """The `cryptography` key inside a hivemind key (through its public serialization)."""
    loaded = serialization.load_der_private_key(key.to_bytes(), password=None)
    assert isinstance(loaded, rsa.RSAPrivateKey)
    return loaded


def public_pem(key: RSAPrivateKey) -> str:
    """The public half of a hivemind key, PEM (what a joiner sends to be certified)."""
    return (
        crypto_key(key)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


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
    now = now_utc()
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


# -- DHT access tokens ------------------------------------------------------------------------------


def token_payload(run_id: str, token: AccessToken) -> bytes:
    """What the CA signs in a DHT token: the run, the member's peer id, its key, the expiry."""
    fields = (run_id.encode(), token.username.encode(), token.public_key, token.expiration_time.encode())
    return TOKEN_DOMAIN + b"\0".join(hashlib.sha256(f).digest() for f in fields)


def sign_token(ca_key: ec.EllipticCurvePrivateKey, run_id: str, public_key: rsa.RSAPublicKey, expires: float) -> bytes:
    """A DHT access token for the member with `public_key`, valid until `expires`, serialized."""
    token = AccessToken(
        username=peer_id_of(public_key),
        public_key=RSAPublicKey(public_key).to_bytes(),
        expiration_time=repr(float(expires)),
    )
    token.signature = ca_key.sign(token_payload(run_id, token), ec.ECDSA(hashes.SHA256()))
    return token.SerializeToString()


def token_problem(token: AccessToken, root: x509.Certificate, run_id: str, revoked: frozenset[str]) -> str | None:
    """Why `token` does not admit its holder to the run's DHT, or None when it does: signed by the
    run's CA, for the key it names, not expired, not revoked."""
    problem = _lasting_problem(token.SerializeToString(), root, run_id)
    if problem is not None:
        return problem
    if float(token.expiration_time) < time.time():
        return "expired"
    if token.username in revoked:
        return "revoked"
    return None


@functools.lru_cache(maxsize=1024)
def _lasting_problem(token: bytes, root: x509.Certificate, run_id: str) -> str | None:
    """What is wrong with a serialized token whatever the time and the revocations. Cached: a DHT node
    checks the same few tokens at every request and response it gets, and the CA's signature and the
    key's parse took a tenth of its CPU; a forged token costs its check once more when it falls out."""
    parsed = AccessToken.FromString(token)
    ca_key = root.public_key()
    assert isinstance(ca_key, ec.EllipticCurvePublicKey)
    try:
        ca_key.verify(parsed.signature, token_payload(run_id, parsed), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return "not signed by the run's CA"
    try:
        float(parsed.expiration_time)
        key = serialization.load_ssh_public_key(parsed.public_key)
    except ValueError:
        return "malformed"
    if not isinstance(key, rsa.RSAPublicKey) or peer_id_of(key) != parsed.username:
        return "names a peer id that is not its key's"
    return None


# -- DHT session keys -------------------------------------------------------------------------------

SESSION_PUBLIC, SESSION_SIGNATURE = 32, 64  # bytes of an Ed25519 public key and of a signature


def session_statement(token_signature: bytes, session_public: bytes) -> bytes:
    """What a member signs with its token's key to certify a session key: that key, for the token
    with this CA signature only (a renewed token gets a new certificate)."""
    return SESSION_DOMAIN + hashlib.sha256(token_signature).digest() + session_public


class SessionKey(PrivateKey):
    """What a DHT node signs its requests and responses with: a fresh Ed25519 key that the member's
    RSA key (the one its token names) certifies once per token (`certify`).

    Every DHT RPC is signed at both ends. An RSA-2048 signature costs 0.2-1 ms on a volunteer's CPU,
    an Ed25519 one 0.02 ms: with RSA signatures a 2 x 2 DiLoCo swarm's DHT processes took three times
    the CPU of its stage workers on 2 cores. hivemind's `TokenAuthorizerBase` signs with any
    `PrivateKey` but verifies with `RSAPublicKey` only, hence this key and `RunAuthorizer`'s checks.

    A signature is the session's public key, its Ed25519 signature of the data, then the member's
    certificate of the session key (`session_statement`, signed by the RSA key)."""

    def __init__(self, key: RSAPrivateKey):
        self.key = key
        self._session: ed25519.Ed25519PrivateKey | None = None
        self._public = self._certificate = b""
        self._certified: bytes | None = None  # the CA signature of the token the certificate is for

    def __getstate__(self):
        # The session key is made in the process that signs with it (the DHT's), and never leaves it.
        return {"key": self.key}

    def __setstate__(self, state):
        self.__init__(state["key"])

    def certify(self, token: AccessToken) -> None:
        if self._session is None:
            self._session = ed25519.Ed25519PrivateKey.generate()
            self._public = self._session.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        if self._certified != token.signature:
            self._certificate = self.key.sign(session_statement(token.signature, self._public))
            self._certified = token.signature

    def sign(self, data: bytes) -> bytes:
        assert self._session is not None, "certify() the session key for a token first"
        return self._public + self._session.sign(data) + self._certificate

    def get_public_key(self) -> RSAPublicKey:
        return self.key.get_public_key()


def session_signature_valid(token: AccessToken, data: bytes, signature: bytes) -> bool:
    """Whether `signature` (a `SessionKey`'s) signs `data` with a session key that the key of `token`
    certified for `token`. The token itself is checked apart (`token_problem`)."""
    public = signature[:SESSION_PUBLIC]
    signed = signature[SESSION_PUBLIC : SESSION_PUBLIC + SESSION_SIGNATURE]
    certificate = signature[SESSION_PUBLIC + SESSION_SIGNATURE :]
    if len(signed) != SESSION_SIGNATURE or not _certified(token.public_key, token.signature, public, certificate):
        return False
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public).verify(signed, data)
    except InvalidSignature:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def _certified(member_key: bytes, token_signature: bytes, public: bytes, certificate: bytes) -> bool:
    """Whether `certificate` is `member_key`'s signature of session key `public` for the token with
    `token_signature`. Cached: a node meets the same few sessions at every RPC; a forged certificate
    costs its check once more when it falls out."""
    try:
        key = RSAPublicKey.from_bytes(member_key)
    except ValueError:
        return False
    return key.verify(session_statement(token_signature, public), certificate)


class RunAuthorizer(TokenAuthorizerBase):
    """hivemind's DHT authorizer for a run: a request or a response counts only with a token the run
    CA signed (see `token_problem`) and a signature by a session key that the token's key certified
    for that token (`SessionKey`); a request also only once, within a minute of its time (hivemind's
    rule). It lives in the DHT's own process; `Member` sends it renewed tokens and the revoked peer
    ids (`update`)."""

    def __init__(self, key: RSAPrivateKey, token: bytes, ca_pem: str, run_id: str):
        super().__init__(SessionKey(key))  # type: ignore[arg-type]  # hivemind signs with any PrivateKey
        self.token = AccessToken.FromString(token)
        self.root = x509.load_pem_x509_certificate(ca_pem.encode())
        self.run_id = run_id
        self.revoked: frozenset[str] = frozenset()

    def update(self, token: bytes | None, revoked: frozenset[str]) -> None:
        if token is not None:
            self.token = AccessToken.FromString(token)
        self.revoked = revoked

    async def get_token(self) -> AccessToken:
        self._local_private_key.certify(self.token)
        return self.token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        problem = token_problem(access_token, self.root, self.run_id, self.revoked)
        if problem is not None:
            log.debug(f"DHT token of {access_token.username or 'an unnamed node'} refused: {problem}")
        return problem is None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return access_token is not self.token

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        await self.refresh_token_if_needed()
        auth = request.auth
        if not self._signed_by_holder(request, auth.client_access_token):
            return False
        if auth.service_public_key and auth.service_public_key != self._local_public_key.to_bytes():
            log.debug("DHT request refused: made for a node with another key")
            return False
        return self._first_and_timely(auth.time, auth.nonce)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        await self.refresh_token_if_needed()
        if not self._signed_by_holder(response, response.auth.service_access_token):
            return False
        if response.auth.nonce != request.auth.nonce:
            log.debug("DHT response refused: made for another request")
            return False
        return True

    def _signed_by_holder(self, message, token: AccessToken) -> bool:
        """`message` carries a valid token and a session signature of its holder (its signature field
        is emptied to check it, as hivemind's own check does)."""
        if not self.is_token_valid(token):
            return False
        signature = message.auth.signature
        message.auth.signature = b""
        if not session_signature_valid(token, message.SerializeToString(), signature):
            log.debug(f"DHT message of {token.username} refused: not signed by a session key its key certified")
            return False
        return True

    def _first_and_timely(self, sent: float, nonce: bytes) -> bool:
        """hivemind's replay rule: a request's time is within a minute of this node's clock, and its
        nonce was not seen in the last three minutes."""
        window = self._MAX_CLIENT_SERVICER_TIME_DIFF.total_seconds()
        with self._recent_nonces.freeze():
            now = get_dht_time()
            if abs(sent - now) > window or nonce in self._recent_nonces:
                log.debug("DHT request refused: replayed, or sent with a clock a minute off")
                return False
        self._recent_nonces.store(nonce, None, now + window * 3)
        return True


async def _update_authorizer(dht: hivemind.DHT, node, token: bytes | None, revoked: frozenset[str]) -> None:
    # Runs in the DHT's process (hivemind's `DHT.run_coroutine`), where its node's authorizer lives.
    node.protocol.authorizer.update(token, revoked)


# -- this process's membership -----------------------------------------------------------------------


class Member:
    """This process's membership of run `run_id` in `role`: its DHT key, what the CA issued for it,
    renewal (`renew()` asks the CA again; None: never renewed) and the revoked peer ids."""

    def __init__(
        self, run_id: str, role: Role, key: RSAPrivateKey, issued: Issued, renew: Callable[[], Issued] | None = None
    ):
        self.run_id, self.role, self.key, self._renew = run_id, role, key, renew
        self.root = x509.load_pem_x509_certificate(issued.ca.encode())
        self.peer_id = identity_of(issued.certificate, self.root, run_id).peer_id
        self._key_pem = crypto_key(key).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self._lock = threading.Lock()
        self.issued = issued
        self.generation = 0  # goes up at each renewal: callers make new channels with the new certificate
        self.revoked: frozenset[str] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def issued(self) -> Issued:
        with self._lock:
            return self._issued

    @issued.setter
    def issued(self, issued: Issued) -> None:
        with self._lock:
            self._issued = issued
            self._issued_at = time.time()

    # -- TLS -------------------------------------------------------------------------------------

    def channel_credentials(self) -> grpc.ChannelCredentials:
        issued = self.issued
        return grpc.ssl_channel_credentials(
            root_certificates=issued.ca.encode(),
            private_key=self._key_pem,
            certificate_chain=issued.certificate.encode(),
        )

    @staticmethod
    def target_options(peer_id: str) -> list[tuple[str, str]]:
        """Channel options that make the TLS handshake fail unless the server's certificate names
        `peer_id` (the id of the record a call was routed to): certificates carry it as a DNS name."""
        return [("grpc.ssl_target_name_override", peer_id)]

    def _server_config(self) -> grpc.ServerCertificateConfiguration:
        issued = self.issued
        return grpc.ssl_server_certificate_configuration(
            [(self._key_pem, issued.certificate.encode())], root_certificates=issued.ca.encode()
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that ask every caller for a run certificate, and pick up renewals."""
        served = [self.generation]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # Called by gRPC at each new handshake; None keeps the configuration it has.
            if served[0] == self.generation:
                return None
            served[0] = self.generation
            return self._server_config()

        return grpc.dynamic_ssl_server_credentials(self._server_config(), fetch, require_client_authentication=True)

    def refusal(self, context: grpc.ServicerContext) -> str | None:
        """Why the caller of a stage call is refused, or None. The TLS handshake already checked its
        certificate against the run's root; what is left is revocation."""
        names = context.auth_context().get("x509_common_name") or [b""]
        caller = names[0].decode(errors="replace")
        if caller in self.revoked:
            return f"the certificate of {caller} was revoked by the run's operator"
        return None

    # -- the DHT ---------------------------------------------------------------------------------

    def authorizer(self) -> RunAuthorizer:
        return RunAuthorizer(self.key, self.issued.dht_token, self.issued.ca, self.run_id)

    def start(self, dht: hivemind.DHT | None, read_revoked: Callable[[], set[str]]) -> None:
        """Keep the membership current in the background: renew before the certificate lapses, read
        the revoked peer ids every REVOCATION_POLL_S (`read_revoked`), and tell `dht`'s authorizer
        (None: a member with no DHT node). The first reading is taken before this returns: whoever
        reads `revoked` (a peer's removal check, a trainer's routing) reads the DHT's word from the start."""
        self._refresh(dht, read_revoked, None)
        self._thread = threading.Thread(target=self._keep, args=(dht, read_revoked), name="membership", daemon=True)
        self._thread.start()

    def renewal_due(self) -> bool:
        with self._lock:
            lifetime = self._issued.expires - self._issued_at
            return time.time() >= self._issued_at + RENEW_AT * lifetime

    def _keep(self, dht: hivemind.DHT | None, read_revoked: Callable[[], set[str]]) -> None:
        while not self._stop.wait(REVOCATION_POLL_S):
            token = None
            if self._renew is not None and self.renewal_due():
                try:
                    self.issued = self._renew()
                except Exception as err:  # the coordinator may be away for a while: try again next poll
                    log.warning(f"cannot renew this member's certificate yet: {err}")
                else:
                    token = self.issued.dht_token
                    self.generation += 1
                    log.info(f"certificate renewed, valid until {time.ctime(self.issued.expires)}")
            self._refresh(dht, read_revoked, token)

    def _refresh(self, dht: hivemind.DHT | None, read_revoked: Callable[[], set[str]], token: bytes | None) -> None:
        """Read the revoked peer ids; tell `dht`'s authorizer of them, and of a renewed `token`, when
        either changed."""
        try:
            revoked = frozenset(read_revoked())
        except Exception as err:  # a DHT read that failed: keep what was known
            log.debug(f"cannot read the revoked peers: {err}")
            revoked = self.revoked
        if token is not None or revoked != self.revoked:
            self.revoked = revoked
            if dht is not None:
                update = functools.partial(_update_authorizer, token=token, revoked=revoked)
                dht.run_coroutine(update, return_future=True)  # not waited for

    def stop(self) -> None:
        self._stop.set()
