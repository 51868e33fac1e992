"""Stored responses of ``/v1/responses`` (``store: true``): in the API server's memory,
bounded in number and in bytes, least recently used first out.

Each entry keeps its own input items and its response (whose ``output`` holds the output
items) and the id of the response before it: a ``previous_response_id`` chain is walked
back to its first response (``chain``), and walking it counts as a use of every response
on it, so the chain an agent is extending stays while idle ones are evicted. A chain
whose earlier response was evicted or deleted cannot be continued (the caller's 400).

``ResponseStore`` lives in one process. With several API server processes (``vllm serve
--api-server-count N``) a request may land on another process than the one that stored
its previous response: ``SharedResponseStore`` keeps the same LRU in one SQLite file that
every process opens, with the same interface and semantics.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESPONSES = 1_000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass
class StoredResponse:
    """``response``: the response object as returned; ``input_items``: its normalized
    input (instructions excluded, as OpenAI: they do not carry over); ``job_id``: the
    Continuum job of its chain; ``nbytes``: its JSON size, what the byte bound counts."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    job_id: str
    nbytes: int = 0

    @property
    def id(self) -> str:
        return self.response["id"]

    @property
    def previous_id(self) -> str | None:
        return self.response.get("previous_response_id")


class ResponseStore:
    """An LRU of ``StoredResponse`` by id. Invariants: ``len(self) <= max_responses`` and
    ``self.nbytes == sum of the entries' nbytes <= max_bytes``. Not thread-safe: used
    from the event loop only."""

    def __init__(
        self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        _check_bounds(max_responses, max_bytes)
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Store ``entry`` (most recent), evicting the least recently used ones past the
        bounds; False (nothing stored) if it alone is over ``max_bytes``."""
        if _serialize(entry, self.max_bytes) is None:
            return False
        self.delete(entry.id)
        self._entries[entry.id] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.max_responses or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry is not None

    def chain(self, response_id: str) -> list[StoredResponse] | None:
        """The responses from the first of ``response_id``'s chain to it, each marked as
        used; None if it or any response before it is not stored."""
        return _walk_chain(self.get, response_id)


BUSY_TIMEOUT_S = 10.0
"""How long a process waits for another's write transaction on the shared store before
failing (``sqlite3.OperationalError``). Transactions here take milliseconds: only a
stuck process makes one wait this long."""


class SharedResponseStore:
    """``ResponseStore``'s LRU in one SQLite file, shared by the processes that open it.

    Same interface, semantics and invariants, over the whole file: at most
    ``max_responses`` rows, whose ``nbytes`` sum to at most ``max_bytes`` (the bounds of
    the process that wrote last, if they differ). Recency is a stamp per row, one more
    than the largest when a process puts or uses the row, so "least recently used" counts
    every process's uses. Each process opens its own instance after it starts (a
    connection must not cross a fork); ``get`` returns a copy, so changing it does not
    change what is stored. Not thread-safe: used from the event loop only. The file must
    be on a local disk (WAL needs shared memory between the processes)."""

    def __init__(
        self,
        path: str,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        _check_bounds(max_responses, max_bytes)
        self.path = path
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._conn = open_sqlite(path, self._init_file)

    def _init_file(self, conn: sqlite3.Connection) -> None:
        """The table and its index; idempotent."""
        with immediate_transaction(conn) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS responses ("
                " id TEXT PRIMARY KEY,"
                " response TEXT NOT NULL,"  # JSON
                " input_items TEXT NOT NULL,"  # JSON
                " job_id TEXT NOT NULL,"
                " nbytes INTEGER NOT NULL,"
                " used INTEGER NOT NULL)"  # recency stamp: the largest is the most recent
            )
            conn.execute("CREATE INDEX IF NOT EXISTS responses_used ON responses (used)")

    def __len__(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    @property
    def nbytes(self) -> int:
        return self._conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM responses").fetchone()[0]

    def put(self, entry: StoredResponse) -> bool:
        """Store ``entry`` (most recent), evicting the least recently used ones past the
        bounds; False (nothing stored) if it alone is over ``max_bytes``."""
        serialized = _serialize(entry, self.max_bytes)
        if serialized is None:
            return False
        response, input_items = serialized
        with self._transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO responses"
                " (id, response, input_items, job_id, nbytes, used)"
                " VALUES (?, ?, ?, ?, ?, (SELECT COALESCE(MAX(used), 0) + 1 FROM responses))",
                (entry.id, response, input_items, entry.job_id, entry.nbytes),
            )
            self._evict(conn)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        with self._transaction() as conn:
            return self._get(conn, response_id)

    def delete(self, response_id: str) -> bool:
        cursor = self._conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cursor.rowcount > 0

    def chain(self, response_id: str) -> list[StoredResponse] | None:
        """The responses from the first of ``response_id``'s chain to it, each marked as
        used; None if it or any response before it is not stored. One transaction: no
        other process evicts or deletes a response of the chain halfway through."""
        with self._transaction() as conn:
            return _walk_chain(lambda next_id: self._get(conn, next_id), response_id)

    def close(self) -> None:
        self._conn.close()

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        return immediate_transaction(self._conn)

    @staticmethod
    def _get(conn: sqlite3.Connection, response_id: str) -> StoredResponse | None:
        row = conn.execute(
            "SELECT response, input_items, job_id, nbytes FROM responses WHERE id = ?",
            (response_id,),
        ).fetchone()
        if row is None:
            return None
        conn.execute(
            "UPDATE responses SET used = (SELECT MAX(used) + 1 FROM responses) WHERE id = ?",
            (response_id,),
        )
        response, input_items, job_id, nbytes = row
        return StoredResponse(json.loads(response), json.loads(input_items), job_id, nbytes)

    def _evict(self, conn: sqlite3.Connection) -> None:
        count, nbytes = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM responses"
        ).fetchone()
        while count > self.max_responses or nbytes > self.max_bytes:
            oldest, size = conn.execute(
                "SELECT id, nbytes FROM responses ORDER BY used LIMIT 1"
            ).fetchone()
            conn.execute("DELETE FROM responses WHERE id = ?", (oldest,))
            count -= 1
            nbytes -= size


def open_sqlite(path: str, init: Callable[[sqlite3.Connection], None]) -> sqlite3.Connection:
    """A connection to the SQLite database ``path`` (a file shared by processes, or
    ":memory:"), ``init`` run on it (tables, idempotent). isolation_level=None: no
    transaction is opened on its own; each read-modify-write is an explicit
    ``immediate_transaction``. A file is switched to WAL (readers neither wait for the
    writer nor block it) with synchronous NORMAL (no fsync per commit: a power loss may
    lose the last writes, as a restart loses an in-memory store's all)."""
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            if path != ":memory:":
                if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            init(conn)
            return conn
        except sqlite3.OperationalError as e:
            # Switching a new file to WAL takes an exclusive lock without the busy
            # timeout's wait: processes that open a new file at once retry.
            if "locked" not in str(e) or time.monotonic() > deadline:
                conn.close()
                raise
            time.sleep(0.02)


@contextmanager
def immediate_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """IMMEDIATE: take the write lock before the first read, so no other process writes
    between this one's read and its write (a deferred transaction would instead fail at
    its first write, without waiting)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        if conn.in_transaction:  # some errors have rolled it back already
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _check_bounds(max_responses: int, max_bytes: int) -> None:
    if max_responses < 1 or max_bytes < 1:
        raise ValueError(f"bounds must be positive, got {max_responses}, {max_bytes}")


def _serialize(entry: StoredResponse, max_bytes: int) -> tuple[str, str] | None:
    """The entry's response and input items as JSON (serialized once: the shared store
    writes them), with ``entry.nbytes`` set to their size as one JSON array, what the
    bounds count; None, with a warning, if that alone is over ``max_bytes``."""
    response = json.dumps(entry.response, ensure_ascii=False)
    input_items = json.dumps(entry.input_items, ensure_ascii=False)
    entry.nbytes = len(response) + len(input_items) + len("[, ]")
    if entry.nbytes > max_bytes:
        logger.warning(
            "Response %s not stored: %d bytes, over the store's %d",
            entry.id,
            entry.nbytes,
            max_bytes,
        )
        return None
    return response, input_items


def _walk_chain(
    get: Callable[[str], StoredResponse | None], response_id: str
) -> list[StoredResponse] | None:
    """``chain`` of either store, ``get`` being its own (which marks each as used)."""
    chain: list[StoredResponse] = []
    seen: set[str] = set()
    next_id: str | None = response_id
    while next_id is not None:
        entry = get(next_id)
        if entry is None or next_id in seen:
            return None
        seen.add(next_id)
        chain.append(entry)
        next_id = entry.previous_id
    # Walked from the tip: the first response is now the most recently used (any
    # eviction on the chain breaks it; the tip is the one a client may re-fetch).
    chain.reverse()
    return chain
