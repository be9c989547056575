"""Joining a run: what the coordinator hands to peers and trainers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import hivemind
import httpx

from swarm.client import bearer
from swarm.config import ConfigError, RunConfig, parse_config
from swarm.net import cleartext_warning
from swarm.records import make_dht

log = logging.getLogger(__name__)

RETRY_MAX_S = 15.0  # the longest pause between two tries of a coordinator that does not answer


def fetch_join(
    url: str, timeout: float = 10.0, join_token: str | None = None, wait_s: float = 0.0
) -> tuple[RunConfig, list[str]]:
    """The run config and the DHT's addresses, from the coordinator's /api/v1/join (with the run's
    join token, when it has one). A coordinator that does not answer, or answers that it is
    unavailable (e.g. while it restarts), is tried again for up to `wait_s` seconds, with a line on
    stderr before each pause; a refusal (a wrong token, a bad URL) ends at once."""
    headers = {"Authorization": bearer(join_token)} if join_token else {}
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
    if response.status_code == 401:
        given = "a wrong join token" if join_token else "no join token"
        raise ConfigError(
            f"--coordinator: {url} refused {given}: give this run's join token with --join-token (or $SWARM_JOIN_TOKEN)"
        )
    if response.status_code != 200:
        raise ConfigError(f"--coordinator: {url} answered {response.status_code}: {response.text[:200]}")
    body = response.json()
    return parse_config(body["config"], f"{url} run config"), list(body["initial_peers"])


def join_dht(
    url: str,
    join_token: str | None = None,
    wait_s: float = 0.0,
    check: Callable[[RunConfig], None] | None = None,
    **dht_options,
) -> tuple[RunConfig, list[str], hivemind.DHT]:
    """Join the run at `url`: its config, the coordinator's DHT addresses and a DHT node of this
    process, started with `dht_options` (see `records.make_dht`); `check(run)` may refuse the run
    (raise ConfigError) before the node starts. The coordinator may die between
    its answer and the node's start (its DHT then refuses the bootstrap): the join is tried again,
    as a coordinator that does not answer is, for up to `wait_s` seconds in all."""
    deadline = time.monotonic() + wait_s
    while True:
        run, initial_peers = fetch_join(url, join_token=join_token, wait_s=max(0.0, deadline - time.monotonic()))
        if check is not None:
            check(run)
        try:
            return run, initial_peers, make_dht(initial_peers, **dht_options)
        except Exception as err:  # hivemind raises its daemon's error as it is (P2PDaemonError, RuntimeError)
            problem = f"the run's DHT at {', '.join(initial_peers)} did not answer ({err})"
            if time.monotonic() + 1 > deadline:
                raise ConfigError(f"--coordinator: {problem}") from None
        log.warning(f"{problem}; trying again in 1 s")
        time.sleep(1)
