"""Who is calling: edge identities from bearer tokens, checked on every call and hashed at rest.

The token file (`--auth-tokens FILE`) holds one `name:sha256-hex-of-token` per
line; `#` comments and blank lines are allowed. `specedge-server make-token
NAME` prints a fresh token and its line. A name may have several lines, each
token valid on its own: that is how a token is rotated without downtime (add
the new line, move the edge over, delete the old line). The server re-reads
the file when it changes (checked at most once a second), so adding and
revoking tokens need no restart; a file that fails to parse is logged and the
last good one stays in force.

Tokens carry 256 random bits, so a plain sha256 suffices at rest: there is no
dictionary to guess from, hence no need for salt or a slow hash. A lookup
compares the presented token's hash with every entry through
`hmac.compare_digest`, so timing does not tell which entry, or how much of
one, matched.

Without a token file the identity of a caller is its connection, as before
tokens existed: sessions are then bound to the connection that opened them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable

from specedge.server import errors

log = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")
TOKEN_PREFIX = "se_"  # makes a leaked token easy to recognise in logs and secret scanners
RELOAD_CHECK_S = 1.0


@dataclasses.dataclass(frozen=True)
class Caller:
    identity: str  # the token's name; without a token file, the connection
    connection: str  # the peer address of the call's connection: what an Attach lease is held by


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def make_token(name: str) -> tuple[str, str]:
    """A fresh token for `name`, and the line to add to the token file."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"invalid identity name {name!r}: use 1-64 letters, digits, '_', '.', '@' or '-', "
            "starting with a letter or digit"
        )
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, f"{name}:{hash_token(token)}"


def parse_token_file(lines: Iterable[str], source: str) -> list[tuple[str, bytes]]:
    """(name, sha256 digest) per entry; ValueError naming the file and line of the first bad one."""
    entries: list[tuple[str, bytes]] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, digest = line.partition(":")
        where = f"{source}:{number}"
        if not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"{where}: invalid identity name {name!r}; lines are NAME:SHA256HEX")
        if not _DIGEST_PATTERN.fullmatch(digest):
            raise ValueError(
                f"{where}: expected 64 lowercase hex digits (the token's sha256) after '{name}:'; "
                "use the line `specedge-server make-token NAME` prints"
            )
        if digest in seen:
            raise ValueError(f"{where}: this token hash is listed twice; each token belongs to one identity")
        seen.add(digest)
        entries.append((name, bytes.fromhex(digest)))
    return entries


class Authenticator:
    """Maps a call's metadata to its Caller, or raises Unauthenticated."""

    def __init__(self, token_file: str | None, clock: Callable[[], float] = time.monotonic):
        self.token_file = token_file
        self._clock = clock
        self._entries: list[tuple[str, bytes]] = []
        self._stamp: tuple | None = None  # the file's (inode, size, mtime) when last read
        self._checked_at = clock()
        if token_file is not None:
            self._stamp = _file_stamp(token_file)
            self._entries = _read(token_file)
            if os.stat(token_file).st_mode & 0o022:
                log.warning("%s is writable by others: anyone who can write it can add an identity", token_file)
            if not self._entries:
                log.warning("%s lists no tokens: every call will be refused until one is added", token_file)

    @property
    def enabled(self) -> bool:
        return self.token_file is not None

    @property
    def identities(self) -> frozenset[str]:
        return frozenset(name for name, _ in self._entries)

    def caller(self, metadata: Iterable[tuple[str, str | bytes]], peer: str) -> Caller:
        if self.token_file is None:
            return Caller(identity=peer, connection=peer)
        self._reload_if_changed(self.token_file)
        token = _bearer_token(metadata)
        presented = hashlib.sha256(token.encode()).digest()
        identity = None
        for name, digest in self._entries:  # every entry, matched or not: constant time in the match
            if hmac.compare_digest(digest, presented) and identity is None:
                identity = name
        if identity is None:
            raise errors.Unauthenticated("unknown or revoked token; ask the server's operator for a current one")
        return Caller(identity=identity, connection=peer)

    def _reload_if_changed(self, token_file: str) -> None:
        now = self._clock()
        if now - self._checked_at < RELOAD_CHECK_S:
            return
        self._checked_at = now
        try:
            stamp = _file_stamp(token_file)
            if stamp == self._stamp:
                return
            entries = _read(token_file)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.error("could not re-read the token file; the last good one stays in force: %s", exc)
            return
        self._stamp, self._entries = stamp, entries
        log.info("token file %s re-read: %d tokens, %d identities", token_file, len(entries), len(self.identities))


def _file_stamp(token_file: str) -> tuple:
    stat = os.stat(token_file)
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _read(token_file: str) -> list[tuple[str, bytes]]:
    with open(token_file, encoding="utf-8") as lines:
        return parse_token_file(lines, token_file)


def _bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    values = [value for key, value in metadata if key == "authorization"]
    if not values:
        raise errors.Unauthenticated(
            "this server requires a token: pass --token (or set SPECEDGE_TOKEN) with one the operator made "
            "with `specedge-server make-token NAME`"
        )
    scheme, _, token = (values[0] if isinstance(values[0], str) else "").partition(" ")
    if len(values) > 1 or scheme.lower() != "bearer" or not token:
        raise errors.Unauthenticated("send exactly one `authorization: Bearer TOKEN` metadata entry")
    return token
