"""Joining a run: what the coordinator hands to peers and trainers."""

from __future__ import annotations

import base64
import functools
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import hivemind
import httpx
from hivemind.utils.crypto import RSAPrivateKey

from swarm.client import bearer
from swarm.config import ConfigError, RunConfig, parse_config, resolve_tokenizer
from swarm.identity import Issued, Member, Role, public_pem
from swarm.net import cleartext_warning
from swarm.ready import write_whole
from swarm.records import maddr_peer_ids, make_dht, node_key, read_removed
from swarm.tokenizer import BYTES, sha256_hex

log = logging.getLogger(__name__)

RETRY_MAX_S = 15.0  # the longest pause between two tries of a coordinator that does not answer
TOKENIZER_MAX_BYTES = 64 * 2**20  # the largest tokenizer.json taken from a coordinator (common ones: 2 to 20 MB)
SHA256 = re.compile(r"[0-9a-f]{64}")


def join_headers(join_token: str | None) -> dict[str, str]:
    return {"Authorization": bearer(join_token)} if join_token else {}


def fetch_join(
    url: str, timeout: float = 10.0, join_token: str | None = None, wait_s: float = 0.0
) -> tuple[RunConfig, list[str]]:
    """The run config and the DHT's addresses, from the coordinator's /api/v1/join (with the run's
    join token, when it has one). A coordinator that does not answer, or answers that it is
    unavailable (e.g. while it restarts), is tried again for up to `wait_s` seconds, with a line on
    stderr before each pause; a refusal (a wrong token, a bad URL) ends at once. The config's
    `data.tokenizer` is this machine's copy of the run's tokenizer (see `run_tokenizer`)."""
    headers = join_headers(join_token)
    if join_token and (warning := cleartext_warning(url, "the join token")):
        log.warning(warning)
    deadline = time.monotonic() + wait_s
    pause = 1.0
    while True:
        try:
            response = httpx.get(url.rstrip("/") + "/api/v1/join", timeout=timeout, headers=headers)
            problem = f"{url} answered {response.status_code}" if response.status_code in (502, 503, 504) else None
        except httpx.HTTPError as err:
            response, problem = None, f"cannot reach {url}: {err}"
        if problem is None:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            waited = f" (tried for {wait_s:.0f} s; --join-wait sets how long)" if wait_s else ""
            raise ConfigError(f"--coordinator: {problem}{waited}")
        pause = min(pause, left)
        log.warning(f"{problem}; trying again in {pause:.0f} s")
        time.sleep(pause)
        pause = min(2 * pause, RETRY_MAX_S)
    body = answer(url, response, join_token)
    run = parse_config(body["config"], f"{url} run config")
    return run_tokenizer(url, run, body.get("tokenizer_sha256"), join_token, timeout), list(body["initial_peers"])


def tokenizer_cache() -> Path:
    """Where joiners keep the tokenizers of the runs they joined, one file per sha256."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarm" / "tokenizers"


def run_tokenizer(url: str, run: RunConfig, digest: str | None, join_token: str | None, timeout: float) -> RunConfig:
    """The run with `data.tokenizer` pointing at this machine's copy of the tokenizer whose sha256
    the coordinator's join answer gave (`digest`): the cached copy when its bytes still have that
    hash, else one downloaded from /api/v1/tokenizer and checked. The path the coordinator's config
    names is never read here: it is a path on the coordinator's machine."""
    source = f"{url} run config"
    if digest is None:
        if run.data.tokenizer != BYTES:
            raise ConfigError(f"--coordinator: {url} names the tokenizer {run.data.tokenizer} but serves none")
        return run
    if not isinstance(digest, str) or not SHA256.fullmatch(digest):
        raise ConfigError(f"--coordinator: {url} gave {str(digest)[:80]!r} as the tokenizer's sha256")
    path = tokenizer_cache() / f"{digest}.json"
    try:
        cached = path.read_bytes()
    except FileNotFoundError:
        cached = None
    except OSError as err:
        raise ConfigError(f"cannot read the cached tokenizer {path}: {err.strerror or err}") from None
    if cached is not None and sha256_hex(cached) != digest:
        log.warning(f"the cached tokenizer {path} is damaged (its sha256 is not its name): downloading it again")
        cached = None
    if cached is None:
        store(path, download_tokenizer(url, digest, join_token, timeout))
    data = run.model_dump()
    data["data"]["tokenizer"] = str(path)
    return resolve_tokenizer(parse_config(data, source), path.parent, source)


def download_tokenizer(url: str, digest: str, join_token: str | None, timeout: float) -> bytes:
    """The run's tokenizer.json from the coordinator, refused unless its sha256 is `digest`."""
    where = url.rstrip("/") + "/api/v1/tokenizer"
    try:
        with httpx.stream("GET", where, headers=join_headers(join_token), timeout=timeout) as response:
            if response.status_code != 200:
                response.read()
                answer(url, response, join_token)
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > TOKENIZER_MAX_BYTES:
                    raise ConfigError(f"--coordinator: {where} sent more than {TOKENIZER_MAX_BYTES} bytes")
                chunks.append(chunk)
    except httpx.HTTPError as err:
        raise ConfigError(f"--coordinator: cannot download the tokenizer from {where}: {err}") from None
    data = b"".join(chunks)
    if sha256_hex(data) != digest:
        raise ConfigError(
            f"--coordinator: the tokenizer from {where} has sha256 {sha256_hex(data)}, not the {digest} of the "
            "join answer: not used"
        )
    return data


def store(path: Path, data: bytes) -> None:
    """Write `path` whole: another joiner on this machine may be reading or writing it too."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, data)
    except OSError as err:
        raise ConfigError(f"cannot store the run's tokenizer in {path.parent}: {err.strerror or err}") from None


def answer(url: str, response: httpx.Response, join_token: str | None) -> dict:
    """The coordinator's JSON answer, or a ConfigError that says why there is none."""
    if response.status_code == 401:
        given = "a wrong join token" if join_token else "no join token"
        raise ConfigError(
            f"--coordinator: {url} refused {given}: give this run's join token with --join-token (or $SWARM_JOIN_TOKEN)"
        )
    if response.status_code != 200:
        try:
            detail = response.json()["detail"]
        except (ValueError, KeyError, TypeError):
            detail = response.text[:200]
        raise ConfigError(f"--coordinator: {url} answered {response.status_code}: {detail}")
    return response.json()


class Unreachable(ConfigError):
    """The coordinator did not answer (down, restarting): worth asking again, unlike a refusal."""


def request_certificate(
    url: str, key: RSAPrivateKey, role: Role, join_token: str | None = None, timeout: float = 10.0
) -> Issued:
    """A certificate of the run at `url` for this DHT identity `key` in `role`, from the run CA."""
    headers = join_headers(join_token)
    try:
        response = httpx.post(
            url.rstrip("/") + "/api/v1/certificate",
            json={"public_key": public_pem(key), "role": role},
            headers=headers,
            timeout=timeout,
        )
    except httpx.HTTPError as err:
        raise Unreachable(f"--coordinator: cannot reach {url} for a certificate: {err}") from None
    body = answer(url, response, join_token)
    return Issued(
        certificate=body["certificate"],
        ca=body["ca"],
        expires=float(body["expires"]),
        dht_token=base64.b64decode(body["dht_token"]),
    )


def join_run(url: str, key: RSAPrivateKey, role: Role, run_id: str, join_token: str | None = None) -> Member:
    """This process's membership of the run at `url` with the DHT identity `key`, renewed from there."""
    renew = functools.partial(request_certificate, url, key, role, join_token)
    return Member(run_id, role, key, renew(), renew)


def join_dht(
    url: str,
    role: Role,
    join_token: str | None = None,
    wait_s: float = 0.0,
    check: Callable[[RunConfig], None] | None = None,
    **dht_options,
) -> tuple[RunConfig, list[str], hivemind.DHT, Member]:
    """Join the run at `url` in `role`: its config, the coordinator's DHT addresses, a DHT node of this
    process started with `dht_options` (see `records.make_dht`), and this process's membership (a
    certificate for the node's key, kept current in the background). `check(run)` may refuse the
    run (raise ConfigError) before anything starts. The coordinator may die between its answer and
    the certificate's request, or the node's start (its DHT then refuses the bootstrap): the join is
    tried again, as a coordinator that does not answer is, for up to `wait_s` seconds in all."""
    deadline = time.monotonic() + wait_s
    key = dht_options.pop("record_key", None) or node_key()
    while True:
        run, initial_peers = fetch_join(url, join_token=join_token, wait_s=max(0.0, deadline - time.monotonic()))
        if check is not None:
            check(run)
        try:
            member = join_run(url, key, role, run.run_id, join_token)
        except Unreachable as err:
            if time.monotonic() + 1 > deadline:
                raise
            problem = str(err).removeprefix("--coordinator: ")
        else:
            try:
                dht = make_dht(initial_peers, record_key=key, authorizer=member.authorizer(), **dht_options)
            except Exception as err:  # hivemind raises its daemon's error as it is (P2PDaemonError, RuntimeError)
                problem = f"the run's DHT at {', '.join(initial_peers)} did not answer ({err})"
                if time.monotonic() + 1 > deadline:
                    raise ConfigError(f"--coordinator: {problem}") from None
            else:
                coordinators = maddr_peer_ids(initial_peers)
                member.start(dht, functools.partial(read_removed, dht, run.run_id, coordinators))
                return run, initial_peers, dht, member
        log.warning(f"{problem}; trying again in 1 s")
        time.sleep(1)


def dial_back(url: str, join_token: str | None, address: str, dht_addrs: list[str], timeout: float = 30.0) -> dict:
    """Ask the coordinator to dial this peer back at its stage `address` and DHT multiaddrs
    (coordinator/api_reachability.py); its answer (`reach`: direct or unreachable, and each dial)."""
    try:
        response = httpx.post(
            url.rstrip("/") + "/api/v1/reachability",
            json={"address": address, "dht_addrs": dht_addrs},
            headers=join_headers(join_token),
            timeout=timeout,
        )
    except httpx.HTTPError as err:
        raise ConfigError(f"--coordinator: cannot reach {url}: {err}") from None
    return answer(url, response, join_token)
