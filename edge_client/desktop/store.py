"""Conversations on disk: one SQLite file in the user's data directory.

Every write commits at once (autocommit, WAL), so a crash loses at most the
last fraction of a second of a streaming answer. A message is written when it
starts (an empty assistant row with status "streaming") and updated as it
grows; rows still "streaming" when the app opens again belong to a run that
died, and are marked "interrupted" rather than dropped.

The file holds the user's conversations and the server's access token
(settings.py), so it is readable by its owner only (mode 0600; SQLite gives
its -wal and -shm files the same mode).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sqlite3
import time

# What an answer's status means; the transcript marks every one but "done".
DONE, STREAMING, STOPPED, INTERRUPTED = "done", "streaming", "stopped", "interrupted"
STATUSES = (DONE, STREAMING, STOPPED, INTERRUPTED)
DEFAULT_TITLE = "New chat"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    status TEXT NOT NULL,
    stats TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages (conversation_id, id);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclasses.dataclass(frozen=True)
class Message:
    id: int
    role: str  # "user" or "assistant"
    content: str
    status: str  # one of STATUSES
    stats: dict | None = None  # an answer's figures (see stats.py), once it ended


@dataclasses.dataclass(frozen=True)
class ConversationInfo:
    id: int
    title: str
    updated: float


class StoreError(Exception):
    """The conversation file cannot be opened or written; the message says which file and why."""


class ChatStore:
    def __init__(self, path: pathlib.Path):
        self.path = pathlib.Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _owner_only(self.path)
            self._db = sqlite3.connect(self.path, isolation_level=None)  # autocommit: every write is durable
            self._db.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: a commit survives the app crashing (only a power cut may lose the
            # last ones), and no fsync per streamed update stalls the window.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the conversation file {self.path}: {exc}") from exc

    def close(self) -> None:
        self._db.close()

    def recover(self) -> int:
        """Mark answers left "streaming" by a run that ended abruptly; returns how many."""
        cursor = self._db.execute("UPDATE messages SET status = ? WHERE status = ?", (INTERRUPTED, STREAMING))
        return cursor.rowcount

    # -- conversations -------------------------------------------------------

    def conversations(self) -> list[ConversationInfo]:
        """Newest first."""
        rows = self._db.execute("SELECT id, title, updated FROM conversations ORDER BY updated DESC, id DESC")
        return [ConversationInfo(*row) for row in rows]

    def new_conversation(self, title: str = DEFAULT_TITLE) -> int:
        now = time.time()
        cursor = self._db.execute(
            "INSERT INTO conversations (title, created, updated) VALUES (?, ?, ?)", (title, now, now)
        )
        return _new_row_id(cursor)

    def title(self, conversation_id: int) -> str:
        row = self._db.execute("SELECT title FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return row[0] if row else ""

    def rename(self, conversation_id: int, title: str) -> None:
        self._db.execute(
            "UPDATE conversations SET title = ? WHERE id = ?", (title.strip() or DEFAULT_TITLE, conversation_id)
        )

    def delete_conversation(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _touch(self, conversation_id: int) -> None:
        self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conversation_id))

    # -- messages ------------------------------------------------------------

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT id, role, content, status, stats FROM messages WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        )
        return [
            Message(id, role, content, status, json.loads(stats) if stats else None)
            for id, role, content, status, stats in rows
        ]

    def add_message(self, conversation_id: int, role: str, content: str, status: str = DONE) -> int:
        if status not in STATUSES:
            raise ValueError(f"unknown message status {status!r}")
        cursor = self._db.execute(
            "INSERT INTO messages (conversation_id, role, content, status, created) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, role, content, status, time.time()),
        )
        self._touch(conversation_id)
        return _new_row_id(cursor)

    def write_answer(self, message_id: int, content: str, status: str = STREAMING, stats: dict | None = None) -> None:
        """The answer so far (while streaming), or as it ended with its figures."""
        if status not in STATUSES:
            raise ValueError(f"unknown message status {status!r}")
        self._db.execute(
            "UPDATE messages SET content = ?, status = ?, stats = COALESCE(?, stats) WHERE id = ?",
            (content, status, json.dumps(stats) if stats is not None else None, message_id),
        )

    def delete_message(self, message_id: int) -> None:
        self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def all_answer_stats(self) -> list[dict]:
        """Every answer's figures, all conversations: the overall numbers are computed from these."""
        rows = self._db.execute("SELECT stats FROM messages WHERE role = 'assistant' AND stats IS NOT NULL")
        return [json.loads(stats) for (stats,) in rows]

    # -- settings ------------------------------------------------------------

    def get_setting(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )


def history(messages: list[Message]) -> list[dict[str, str]]:
    """The chat messages a prompt is built from: every non-empty message, partial answers as they were kept."""
    return [{"role": m.role, "content": m.content} for m in messages if m.content and m.status != STREAMING]


def _owner_only(path: pathlib.Path) -> None:
    """Create `path` readable by its owner only, or make it so (a file from before tokens were kept)."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if name.exists():
            os.chmod(name, 0o600)


def _new_row_id(cursor: sqlite3.Cursor) -> int:
    """The id of the row an INSERT on `cursor` made (sqlite3's lastrowid is None only before any INSERT)."""
    if cursor.lastrowid is None:
        raise sqlite3.DatabaseError("the INSERT made no row")
    return cursor.lastrowid
