"""The coordinator over HTTPS (`--tls-cert`, `--tls-key`), and a warning wherever a token would
travel in clear to another machine. A real coordinator serves TLS with a certificate made here, a
real peer joins it through HTTPS (trusting that certificate through SSL_CERT_FILE, as a volunteer
would a private CA's), and plain HTTP to the same port gets no join."""

from __future__ import annotations

import datetime
import ipaddress
import re
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarm.net import cleartext_warning, is_loopback
from swarm.ready import CoordinatorReady, PeerReady, wait_ready
from tests.conftest import CONFIGS, run_cli
from tests.processes import ROOT, ForkedProc, wait_for_state

TINY = CONFIGS / "tiny.toml"


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm test coordinator")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_a_peer_joins_a_coordinator_over_https_and_plain_http_gets_nothing(processes, tmp_path: Path, certificate):
    cert, key = certificate
    trust = {"SSL_CERT_FILE": str(cert), "SWARM_CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
    coordinator = ForkedProc(
        ["coordinator", "--config", str(TINY), "--port", "0", "--state-dir", str(tmp_path / "state")]
        + ["--tls-cert", str(cert), "--tls-key", str(key), "--join-token", "invite-only"],
        tmp_path / "coordinator.log",
        ready=True,
        cwd=ROOT,
    )
    peer = None
    try:
        url = wait_ready(coordinator, CoordinatorReady, timeout=60).url
        assert url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(cert))
        join = httpx.get(f"{url}/api/v1/join", verify=trusted, headers={"Authorization": "Bearer invite-only"})
        assert join.status_code == 200 and join.json()["config"]["run_id"] == "tiny"
        with pytest.raises(httpx.HTTPError):  # a TLS server answers no plain HTTP request
            httpx.get(url.replace("https://", "http://") + "/api/v1/join", timeout=5).raise_for_status()
        with pytest.raises(httpx.ConnectError):  # nor does a client that does not trust it go on
            httpx.get(f"{url}/api/v1/join", verify=ssl.create_default_context(), timeout=5)

        peer = ForkedProc(
            ["peer", "--coordinator", url, "--join-token", "invite-only", "--port", "0", "--threads", "1"],
            tmp_path / "peer.log",
            ready=True,
            cwd=ROOT,
            env=trust,
        )
        joined = wait_ready(peer, PeerReady, timeout=120)
        wait_for_state(
            url,
            lambda s: any(p["peer_id"] == joined.peer_id for st in s["stages"] for p in st["peers"]),
            timeout=60,
            verify=trusted,
        )
        assert "travels in clear" not in coordinator.output() + peer.output()  # TLS, and loopback anyway
        assert re.search(r"link \d+ Mbit/s up, \d+ down", peer.output()), "the link test, over TLS with the token"
    finally:
        for proc in (peer, coordinator):
            if proc is not None:
                proc.stop()


def test_a_token_bound_for_another_machine_over_plain_http_is_warned_about(processes, tmp_path: Path):
    # A name under .invalid never resolves (RFC 2606): another machine, and the join fails at once.
    tried = run_cli(
        "peer", "--coordinator", "http://coordinator.invalid:8000", "--join-token", "secret", "--join-wait", "0"
    )
    assert tried.returncode == 2
    assert "the join token travels in clear to http://coordinator.invalid:8000" in tried.stderr, tried.stderr
    assert "secret" not in tried.stderr  # the warning names the token, never shows it

    coordinator = ForkedProc(
        ["coordinator", "--config", str(TINY), "--host", "0.0.0.0", "--port", "0", "--join-token", "secret"]
        + ["--state-dir", str(tmp_path / "state")],
        tmp_path / "coordinator.log",
        ready=True,
        cwd=ROOT,
    )
    try:
        wait_ready(coordinator, CoordinatorReady, timeout=60)
        assert "the join token travels in clear to http://0.0.0.0:" in coordinator.output()
    finally:
        coordinator.stop()


@pytest.mark.parametrize(
    ("url", "warned"),
    [
        ("http://127.0.0.1:8000", False),
        ("http://localhost:8000", False),
        ("http://[::1]:8000", False),
        ("https://203.0.113.5:8000", False),
        ("http://203.0.113.5:8000", True),
        ("http://coordinator.example.org", True),
    ],
)
def test_which_urls_carry_a_token_in_clear_off_the_machine(url: str, warned: bool):
    assert (cleartext_warning(url, "the join token") is not None) is warned
    assert is_loopback("127.8.9.10") and not is_loopback("10.0.0.1")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "cert.pem", "--tls-key", "cert.pem"], "cannot use them"),
        (["--tls-cert", "nowhere.pem", "--tls-key", "key.pem"], "cannot use them"),
    ],
)
def test_bad_tls_files_are_refused_naming_them(processes, tmp_path: Path, certificate, flags: list[str], named: str):
    paths = [str(tmp_path / f) if f.endswith(".pem") else f for f in flags]
    refused = run_cli("coordinator", "--config", str(TINY), "--state-dir", str(tmp_path / "s"), *paths, timeout=60)
    assert refused.returncode == 2 and named in refused.stderr, refused.stderr
