"""The control plane's messages: dataclasses, their JSON, and a parser that trusts nothing.

Anyone who can publish on the broker can send anything, so every payload is
checked before it is used: size first, then UTF-8 JSON, then every field's
type and range. A payload that fails raises BadMessage; the callers log it
and carry on (a bad message never stops a server, an edge or the table).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import TypeGuard

from specedge.fleet.topics import is_id
from specedge.tokens import TokenizerFingerprint

SCHEMA = 1
MAX_PAYLOAD_BYTES = 16 * 1024  # a real status is ~600 bytes; anything near this is not ours
MAX_COUNT = 10**9
MAX_REASON_CHARS = 200

SERVING, DRAINING, OFFLINE = "serving", "draining", "offline"
DRAIN, UNDRAIN = "drain", "undrain"

_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BadMessage(ValueError):
    """A payload that is not a valid control-plane message; the text says which field is wrong."""


@dataclasses.dataclass(frozen=True)
class ServerLoad:
    max_sessions: int  # KV slots the server has
    active_sessions: int
    free_kv_slots: int
    queue_wait_ms: float  # recent mean wait of a verify round before its forward
    advised_draft_tokens: int  # what a new session would be advised at the current load (0: drafting off)


@dataclasses.dataclass(frozen=True)
class ServerStatus:
    server_id: str
    health: str  # serving | draining | offline
    address: str  # HOST:PORT edges connect to over gRPC
    model: str
    tokenizer: TokenizerFingerprint
    version: str
    load: ServerLoad
    period_s: float  # the status is re-sent at least this often while the server lives
    reason: str = ""  # why it is draining, as the operator said

    def to_json(self) -> bytes:
        return json.dumps({"schema": SCHEMA, **dataclasses.asdict(self)}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> ServerStatus:
        data = _load(payload)
        load = _object(data, "load")
        return cls(
            server_id=_id(data, "server_id"),
            health=_choice(data, "health", (SERVING, DRAINING, OFFLINE)),
            address=_address(data, "address"),
            model=_text(data, "model", 256),
            tokenizer=_fingerprint(_object(data, "tokenizer")),
            version=_text(data, "version", 64),
            load=ServerLoad(
                max_sessions=_int(load, "max_sessions"),
                active_sessions=_int(load, "active_sessions"),
                free_kv_slots=_int(load, "free_kv_slots"),
                queue_wait_ms=_float(load, "queue_wait_ms", 1e9),
                advised_draft_tokens=_int(load, "advised_draft_tokens", 4096),
            ),
            period_s=_float(data, "period_s", 86400.0),
            reason=_text(data, "reason", MAX_REASON_CHARS, default=""),
        )


@dataclasses.dataclass(frozen=True)
class EdgeStats:
    """One edge's totals since it started. Numbers and ids only: never prompt or answer text."""

    edge_id: str
    server_id: str  # the server it uses now; "" when it uses its --server fallback
    answers: int = 0
    tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0  # accepted / draft tokens
    draft_tokens_per_s: float = 0.0  # draft tokens per second of drafting
    rtt_ms: float = 0.0  # mean verify round trip: network plus the server's queue and forward
    proactive_hit_rate: float = 0.0
    fallbacks: int = 0  # answers finished server-only (draft model failed or too slow)
    resumes: int = 0  # sessions re-opened after a lost connection or a move

    def to_json(self) -> bytes:
        return json.dumps({"schema": SCHEMA, **dataclasses.asdict(self)}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> EdgeStats:
        data = _load(payload)
        server_id = data.get("server_id")
        return cls(
            edge_id=_id(data, "edge_id"),
            server_id="" if server_id == "" else _id(data, "server_id"),
            **{name: _int(data, name) for name in ("answers", "tokens", "rounds", "draft_tokens", "accepted_tokens")},
            acceptance_rate=_float(data, "acceptance_rate", 1.0),
            draft_tokens_per_s=_float(data, "draft_tokens_per_s", 1e9),
            rtt_ms=_float(data, "rtt_ms", 1e9),
            proactive_hit_rate=_float(data, "proactive_hit_rate", 1.0),
            fallbacks=_int(data, "fallbacks"),
            resumes=_int(data, "resumes"),
        )


@dataclasses.dataclass(frozen=True)
class Command:
    command: str  # drain | undrain
    reason: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"schema": SCHEMA, **dataclasses.asdict(self)}).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> Command:
        data = _load(payload)
        return cls(_choice(data, "command", (DRAIN, UNDRAIN)), _text(data, "reason", MAX_REASON_CHARS, default=""))


# -- field readers: each raises BadMessage naming the field ------------------


def _load(payload: bytes) -> dict:
    if not isinstance(payload, (bytes, bytearray)):
        raise BadMessage(f"payload is {type(payload).__name__}, not bytes")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise BadMessage(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        data = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadMessage(f"not UTF-8 JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise BadMessage(f"a JSON {type(data).__name__}, not an object")
    if data.get("schema") != SCHEMA:
        raise BadMessage(f"schema {data.get('schema')!r}; this version reads schema {SCHEMA}")
    return data


def _object(data: dict, key: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise BadMessage(f"{key} must be an object")
    return value


def _int(data: dict, key: str, high: int = MAX_COUNT, *, low: int = 0) -> int:
    value = data.get(key)
    if type(value) is not int or not low <= value <= high:  # bool is an int subclass: refused too
        raise BadMessage(f"{key} must be an integer in [{low}, {high}], got {_show(value)}")
    return value


def _float(data: dict, key: str, high: float) -> float:
    value = data.get(key)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)  # bool is an int subclass: refused too
        or not math.isfinite(value)
        or not 0.0 <= value <= high
    ):
        raise BadMessage(f"{key} must be a number in [0, {high:g}], got {_show(value)}")
    return float(value)


def _text(data: dict, key: str, max_chars: int, *, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or len(value) > max_chars or not value.isprintable():
        raise BadMessage(f"{key} must be printable text of at most {max_chars} characters, got {_show(value)}")
    return value


def _id(data: dict, key: str) -> str:
    value = data.get(key)
    if not is_id(value):
        raise BadMessage(f"{key} must be 1-64 characters of A-Z a-z 0-9 _ -, got {_show(value)}")
    return value


def _choice(data: dict, key: str, choices: tuple[str, ...]) -> str:
    value = data.get(key)
    if not isinstance(value, str) or value not in choices:
        raise BadMessage(f"{key} must be one of {', '.join(choices)}, got {_show(value)}")
    return value


def is_address(value: object) -> TypeGuard[str]:
    """HOST:PORT with a plausible host name, IPv4 or [IPv6] address, and a port in 1..65535."""
    match = _ADDRESS.fullmatch(value) if isinstance(value, str) else None
    return match is not None and 1 <= int(match.group(2)) <= 65535


def _address(data: dict, key: str) -> str:
    value = data.get(key)
    if not is_address(value):
        raise BadMessage(f"{key} must be HOST:PORT, got {_show(value)}")
    return value


def _fingerprint(data: dict) -> TokenizerFingerprint:
    sha = data.get("vocab_sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise BadMessage("tokenizer.vocab_sha256 must be 64 lowercase hex digits")
    bos = data.get("bos_token_id")
    eos = data.get("eos_token_ids")
    if not isinstance(eos, list) or len(eos) > 64:
        raise BadMessage("tokenizer.eos_token_ids must be a list of at most 64 token ids")
    return TokenizerFingerprint(
        vocab_size=_int(data, "vocab_size", 10**7, low=1),
        num_tokens=_int(data, "num_tokens", 10**7, low=1),
        vocab_sha256=sha,
        bos_token_id=None if bos is None else _int(data, "bos_token_id", 10**7),
        eos_token_ids=tuple(_int({"eos": token}, "eos", 10**7) for token in eos),
    )


def _show(value: object) -> str:
    """A short, safe rendering of a hostile value for a log line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
