"""Topic names of the fleet control plane, and the one check every id passes.

    specedge/v1/servers/<server-id>          retained ServerStatus (last will: the same, marked offline)
    specedge/v1/servers/<server-id>/command  an operator's Command (drain, undrain)
    specedge/v1/edges/<edge-id>/stats        retained EdgeStats, opt-in (cleared when the edge leaves)

Ids are 1-64 characters of [A-Za-z0-9_-]: no '/', '+', '#' or NUL can reach a
topic name, so a hostile id can never widen a subscription or address
another server's topics.
"""

from __future__ import annotations

import re
from typing import TypeGuard

PREFIX = "specedge/v1"
SERVERS = f"{PREFIX}/servers/+"  # every server's status (one level: commands do not match)
COMMANDS = f"{PREFIX}/servers/+/command"
EDGE_STATS = f"{PREFIX}/edges/+/stats"

_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_id(value: str, what: str = "id") -> str:
    """`value` if it is a valid server or edge id; ValueError naming the rule otherwise."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}: use 1 to 64 characters from A-Z a-z 0-9 _ -")
    return value


def is_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def server_topic(server_id: str) -> str:
    return f"{PREFIX}/servers/{check_id(server_id, 'server id')}"


def command_topic(server_id: str) -> str:
    return f"{server_topic(server_id)}/command"


def edge_stats_topic(edge_id: str) -> str:
    return f"{PREFIX}/edges/{check_id(edge_id, 'edge id')}/stats"


def _match(topic: str, *pattern: str) -> str | None:
    """The id in `topic` where `pattern` has None, if the topic has exactly that shape and a valid id."""
    parts = topic.split("/")
    expected = [*PREFIX.split("/"), *pattern]
    if len(parts) != len(expected):
        return None
    found = None
    for part, want in zip(parts, expected):
        if want == "*":
            found = part
        elif part != want:
            return None
    return found if is_id(found) else None


def server_id_of(topic: str) -> str | None:
    """The server id of a status topic; None for anything else (commands, malformed ids)."""
    return _match(topic, "servers", "*")


def command_target(topic: str) -> str | None:
    return _match(topic, "servers", "*", "command")


def edge_id_of(topic: str) -> str | None:
    return _match(topic, "edges", "*", "stats")
