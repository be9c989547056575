"""The operator's side of a running coordinator's API, for `swarm coordinator invite|revoke`: mint an
invite, revoke one, remove a peer. A refusal or an unreachable coordinator is a ConfigError whose
message is one line naming what was wrong."""

from __future__ import annotations

import logging
import urllib.parse

import httpx

from swarm.config import ConfigError
from swarm.net import cleartext_warning

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0


def _detail(response: httpx.Response) -> str:
    """What the coordinator said was wrong: FastAPI's `detail`, a text or a list of field errors."""
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase
    if not isinstance(detail, list):
        return str(detail)
    fields = []  # a validation error: per field, where (body, name) and why
    for e in (e for e in detail if isinstance(e, dict)):
        where = ".".join(str(part) for part in e.get("loc", [])[1:])
        fields.append(f"{where}: {str(e.get('msg', '')).removeprefix('Value error, ')}")
    return "; ".join(fields)


class OperatorClient:
    """Calls the operator's endpoints of the coordinator at `url` with the operator `token`."""

    def __init__(self, url: str, token: str | None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        if token and (warning := cleartext_warning(url, "the operator token")):
            log.warning(warning)

    def _post(self, path: str, body: dict | None = None) -> dict:
        try:
            response = httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=TIMEOUT_S)
        except httpx.HTTPError as err:
            raise ConfigError(f"--coordinator: cannot reach {self.url}: {err}") from None
        if response.status_code == 401:
            raise ConfigError(
                f"{self.url} refused the operator token: give the one the coordinator was started with "
                "(--token, or $SWARM_TOKEN)"
            )
        if not response.is_success:
            raise ConfigError(f"{self.url} refused ({response.status_code}): {_detail(response)}")
        return response.json()

    def mint(self, name: str, max_peers: int | None, expires_s: float | None) -> dict:
        """The minted invite: name, token (shown this once), max_peers, expires, guarded."""
        body = {"name": name, "max_peers": max_peers, "expires_s": expires_s}
        return self._post("/api/v1/invites", {k: v for k, v in body.items() if v is not None})

    def revoke_invite(self, name: str) -> dict:
        """The revoked invite's listing (name, identities, max_peers, expires, revoked)."""
        return self._post(f"/api/v1/invites/{urllib.parse.quote(name, safe='')}/revoke")

    def remove_peer(self, peer_id: str) -> dict:
        return self._post(f"/api/v1/peers/{urllib.parse.quote(peer_id, safe='')}/remove")
