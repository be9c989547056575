"""Who may join a run: per-volunteer invites, each with its own token, identity limit and expiry,
and the peers the operator revoked.

The coordinator keeps them in `state_dir/invites.json` (readable by its owner only, written whole
by a rename, so a restart keeps them). An invite's token is shown once, when it is minted: the file
keeps only its SHA-256, so a copy of the file lets no one in. Each peer id the run CA certifies
under an invite is counted against the invite's `max_peers` (the same peer id again, a renewal,
counts once). Revoking an invite revokes every peer id certified under it; with the peers the
operator removed, they make the revoked set, which gets no certificate and which the coordinator
publishes in the DHT (coordinator.control) for members to refuse.

The run's `--join-token`, when it has one, is the invite named "shared": no limit, no expiry, not
kept in the file (its token comes from the command line at each start), and revoked only by
restarting the coordinator without it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from swarm.config import ConfigError, format_validation_error

M = TypeVar("M", bound=BaseModel)

SHARED = "shared"  # the name of the invite that --join-token is
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
TOKEN_BYTES = 32


class InviteError(ValueError):
    """A request about invites that cannot be done; the message says why."""


class UnknownInvite(InviteError):
    """No invite has that name, or that token."""


class InviteConflict(InviteError):
    """The name is taken, or the invite cannot be changed that way."""


class InviteRefused(InviteError):
    """An invite that admits no one now (revoked, expired), or no new identity (its limit is reached),
    or a peer id that has been revoked."""


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise InviteError(f"invite name {name!r}: 1 to 64 letters, digits and ._- only")
    return name


InviteName = Annotated[str, AfterValidator(check_name)]


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Invite(BaseModel):
    """An invite as the coordinator keeps it."""

    model_config = ConfigDict(extra="forbid")

    name: InviteName
    token_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    max_peers: int | None = Field(default=None, ge=1)
    expires: float | None = None
    revoked: bool = False
    identities: list[str] = Field(default_factory=list, description="the peer ids certified under it, in order")

    def refusal(self, now: float) -> str | None:
        """Why this invite admits no one at `now`; None when it does."""
        if self.revoked:
            return f"invite {self.name!r} has been revoked by the run's operator"
        if self.expires is not None and now >= self.expires:
            return f"invite {self.name!r} expired at {_when(self.expires)}"
        return None


class InviteInfo(BaseModel):
    """What anyone may see of an invite: never its token, nor the token's hash."""

    name: str
    identities: int = Field(description="peer ids certified under it")
    max_peers: int | None = Field(description="the most peer ids it may certify (null: no limit)")
    expires: float | None = Field(description="unix time after which it admits no one (null: never)")
    revoked: bool


class InviteFile(BaseModel):
    """`invites.json`."""

    model_config = ConfigDict(extra="forbid")

    invites: list[Invite] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list, description="peer ids the operator removed from the run")

    @model_validator(mode="after")
    def _names_unique(self) -> InviteFile:
        names = [i.name for i in self.invites]
        if SHARED in names:
            raise ValueError(f"an invite named {SHARED!r}: that name is the coordinator's --join-token's")
        if len(set(names)) != len(names):
            raise ValueError("two invites with the same name")
        return self


def read_state(path: Path, model: type[M], what: str, remedy: str) -> M:
    """The coordinator's state file `path` as `model`; a ConfigError naming the file and what is wrong
    with it, and saying `what` it holds and the `remedy` (remove it to ...)."""
    try:
        return model.model_validate_json(path.read_bytes())
    except OSError as err:
        raise ConfigError(f"{path}: cannot read {what} ({err})") from None
    except ValidationError as err:
        raise ConfigError(f"{format_validation_error(err, str(path))}\n({what}: fix the file, or {remedy})") from None


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` whole (a temporary file, then a rename), readable by its owner only."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Invites:
    """The run's invites and revocations; thread-safe. `path` None keeps them in memory only.

    `shared_token`: the coordinator's --join-token (the "shared" invite). The run is guarded (the
    join and certificate endpoints want a token) when it has one or `invite_only`; an open run
    admits anyone, but still refuses revoked peers."""

    def __init__(
        self,
        path: Path | None,
        shared_token: str | None = None,
        invite_only: bool = False,
        clock: Callable[[], float] = time.time,
    ):
        self.path, self.clock = path, clock
        self.guarded = bool(shared_token) or invite_only
        self._lock = threading.Lock()
        saved = self._load()
        self._invites: dict[str, Invite] = {i.name: i for i in saved.invites}
        self._removed: list[str] = saved.removed
        if shared_token:
            shared = Invite(name=SHARED, token_sha256=token_hash(shared_token))
            self._invites = {SHARED: shared, **self._invites}

    def _load(self) -> InviteFile:
        if self.path is None or not self.path.exists():
            return InviteFile()
        return read_state(self.path, InviteFile, "the run's invites", "remove it to forget every invite and revocation")

    def _save(self, invites: dict[str, Invite], removed: list[str]) -> None:
        """Write the state first, then take it: what the coordinator acts on is what a restart finds."""
        if self.path is not None:
            kept = InviteFile(invites=[i for i in invites.values() if i.name != SHARED], removed=removed)
            write_private(self.path, kept.model_dump_json(indent=1) + "\n")
        self._invites, self._removed = invites, removed

    def _named(self, name: str) -> Invite:
        invite = self._invites.get(name)
        if invite is None:
            raise UnknownInvite(f"no invite named {name!r}")
        return invite

    def mint(self, name: str, max_peers: int | None = None, expires_s: float | None = None) -> tuple[str, InviteInfo]:
        """A new invite, admitting up to `max_peers` identities (None: any number) for `expires_s`
        seconds from now (None: until revoked): its token (to be shown only now) and its listing."""
        check_name(name)
        if max_peers is not None and max_peers < 1:
            raise InviteError(f"max_peers: {max_peers} must be at least 1")
        if expires_s is not None and not 0 < expires_s < float("inf"):
            raise InviteError(f"expires_s: {expires_s} must be a number of seconds above 0")
        token = secrets.token_urlsafe(TOKEN_BYTES)
        expires = None if expires_s is None else self.clock() + expires_s
        invite = Invite(name=name, token_sha256=token_hash(token), max_peers=max_peers, expires=expires)
        with self._lock:
            if name in self._invites:
                taken = "is the coordinator's --join-token" if name == SHARED else "exists already"
                raise InviteConflict(f"an invite named {name!r} {taken}: choose another name")
            self._save({**self._invites, name: invite}, self._removed)
        return token, self._info(invite)

    def admit(self, token: str) -> str:
        """The name of the invite whose token this is, if it admits anyone now."""
        digest = token_hash(token)
        with self._lock:
            found = None
            for invite in self._invites.values():  # every one compared: the time taken tells nothing
                if hmac.compare_digest(invite.token_sha256, digest):
                    found = invite
            if found is None:
                raise UnknownInvite("no invite has this token")
            if why := found.refusal(self.clock()):
                raise InviteRefused(why)
            return found.name

    def count(self, name: str | None, peer_id: str) -> None:
        """Record that `peer_id` is being certified under invite `name` (None: in an open run, under
        none). Refused when the peer id has been revoked, the invite admits no one now, or the peer id
        is new and the invite has certified its `max_peers` already; a peer id it certified before
        (a renewal) is not counted again."""
        with self._lock:
            if peer_id in self._revoked():
                raise InviteRefused(f"peer {peer_id} has been revoked from the run by its operator")
            if name is None:
                return
            invite = self._named(name)
            if why := invite.refusal(self.clock()):
                raise InviteRefused(why)
            if peer_id in invite.identities:
                return
            if invite.max_peers is not None and len(invite.identities) >= invite.max_peers:
                raise InviteRefused(
                    f"invite {name!r} admits at most {invite.max_peers} peer identities, and has certified "
                    f"{len(invite.identities)}: no new identity (an identity it certified may renew)"
                )
            counted = invite.model_copy(update={"identities": [*invite.identities, peer_id]})
            self._save({**self._invites, name: counted}, self._removed)

    def revoke(self, name: str) -> InviteInfo:
        """Revoke the invite `name`: its token admits no one, and every peer id it certified is revoked."""
        with self._lock:
            invite = self._named(name)
            if name == SHARED:
                raise InviteConflict(
                    f"invite {SHARED!r} is the coordinator's --join-token: restart the coordinator without it "
                    "(or with another) to revoke it"
                )
            if not invite.revoked:
                self._save({**self._invites, name: invite.model_copy(update={"revoked": True})}, self._removed)
            return self._info(self._invites[name])

    def remove_peer(self, peer_id: str) -> None:
        """Revoke one peer id (the operator removed it from the run)."""
        with self._lock:
            if peer_id not in self._removed:
                self._save(self._invites, [*self._removed, peer_id])

    def _revoked(self) -> set[str]:
        revoked = set(self._removed)
        for invite in self._invites.values():
            if invite.revoked:
                revoked.update(invite.identities)
        return revoked

    def revoked_peers(self) -> set[str]:
        """Every peer id the operator removed, or certified under a revoked invite."""
        with self._lock:
            return self._revoked()

    @staticmethod
    def _info(invite: Invite) -> InviteInfo:
        return InviteInfo(
            name=invite.name,
            identities=len(invite.identities),
            max_peers=invite.max_peers,
            expires=invite.expires,
            revoked=invite.revoked,
        )

    def listing(self) -> list[InviteInfo]:
        """Every invite, the shared one first, then in the order they were minted; never a token."""
        with self._lock:
            return [self._info(i) for i in self._invites.values()]
