"""Joining a run: what the coordinator hands to peers and trainers."""

from __future__ import annotations

import httpx

from swarm.client import bearer
from swarm.config import ConfigError, RunConfig, parse_config


def fetch_join(url: str, timeout: float = 10.0, join_token: str | None = None) -> tuple[RunConfig, list[str]]:
    """The run config and the DHT's addresses, from the coordinator's /api/v1/join (with the run's
    join token, when it has one)."""
    headers = {"Authorization": bearer(join_token)} if join_token else {}
    try:
        response = httpx.get(url.rstrip("/") + "/api/v1/join", timeout=timeout, headers=headers)
    except httpx.HTTPError as err:
        raise ConfigError(f"--coordinator: cannot reach {url}: {err}") from None
    if response.status_code == 401:
        given = "a wrong join token" if join_token else "no join token"
        raise ConfigError(
            f"--coordinator: {url} refused {given}: give this run's join token with --join-token (or $SWARM_JOIN_TOKEN)"
        )
    if response.status_code != 200:
        raise ConfigError(f"--coordinator: {url} answered {response.status_code}: {response.text[:200]}")
    body = response.json()
    return parse_config(body["config"], f"{url} run config"), list(body["initial_peers"])
