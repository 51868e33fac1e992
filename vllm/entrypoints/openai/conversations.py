"""OpenAI's Conversations API (``/v1/conversations``) and the ``conversation`` of
``/v1/responses``.

A conversation is an ordered list of items (in the normalized form of ``/v1/responses``'
input items: ``protocol_responses.normalize_input``, each with an id unique in its
conversation) and its metadata. A response created with ``conversation`` takes the
conversation's items as the context before its input (as a ``previous_response_id``
chain's), and once it finishes (completed or incomplete, not failed or cancelled) its
input items then its output items are appended to the conversation (OpenAI's semantics),
whatever its ``store``: ``store`` is about the response object, the conversation keeps
its items. The conversation's id names the Continuum job of its turns
(``serving_responses``), so every turn of a conversation is one job.

``ConversationStore`` keeps the conversations in SQLite, bounded in conversations, items
and bytes, least recently used conversation first out (any read or write of a
conversation is a use). By default the database is in memory, private to the API server
process; with several API servers (``--api-server-count``) it is a table pair in the same
SQLite file as ``SharedResponseStore``'s, which every process opens, so a conversation
is the same whichever process serves a request.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from contextlib import AbstractContextManager
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm.entrypoints.openai import openapi
from vllm.entrypoints.openai.protocol import ErrorResponse, _check_nesting, loggable
from vllm.entrypoints.openai.protocol_responses import (
    _check_metadata,
    _normalize_item,
    new_id,
)
from vllm.entrypoints.openai.responses_store import (
    SharedResponseStore,
    immediate_transaction,
    open_sqlite,
)
from vllm.exceptions import VLLMValidationError

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONVERSATIONS = 1_000
DEFAULT_MAX_ITEMS = 100_000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
MAX_ITEMS_PER_ADD = 20  # OpenAI's: "You may add up to 20 items at a time."
MEMORY = ":memory:"


def not_found(conversation_id: str) -> HTTPException:
    """The 404 of an unknown conversation (the shape of an unknown response's)."""
    return HTTPException(404, f"Conversation with id {loggable(conversation_id)} not found.")


def item_not_found(conversation_id: str, item_id: str) -> HTTPException:
    return HTTPException(
        404,
        f"Item with id {loggable(item_id)} not found in conversation {loggable(conversation_id)}.",
    )


def normalize_items(items: list[Any], field: str = "items") -> list[dict[str, Any]]:
    """Items as ``/v1/responses`` normalizes its input items; ``VLLMValidationError``
    naming ``field`` (``items[i]...`` in the message) for one this server cannot take."""
    out = []
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise VLLMValidationError(f"{where} must be an object", field)
        try:
            out.append(_normalize_item(item, where))
        except VLLMValidationError as e:
            raise VLLMValidationError(str(e), field, code=e.code) from e
    return out


class ConversationStore:
    """Conversations and their items in SQLite (``path``; ``":memory:"``: this process's
    own), as ASCII JSON (any string a JSON body holds can be stored). Invariants, over
    the whole database: at most ``max_conversations`` conversations, holding at most
    ``max_items`` items and ``max_bytes`` bytes (their items' and metadata's JSON)
    together; past a bound the least recently used conversations are evicted (never the
    one being written: a write that would put it alone over a bound is refused,
    ``VLLMValidationError`` naming ``items``). Recency is a stamp per conversation, one
    more than the largest at each use, so with a shared file every process's uses count.
    Not thread-safe: used from the event loop only. Each process opens its own instance
    (a connection must not cross a fork)."""

    def __init__(
        self,
        path: str = MEMORY,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
        max_items: int = DEFAULT_MAX_ITEMS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if min(max_conversations, max_items, max_bytes) < 1:
            raise ValueError(
                f"bounds must be positive, got {max_conversations}, {max_items}, {max_bytes}"
            )
        self.path = path
        self.max_conversations = max_conversations
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._conn = open_sqlite(path, self._init_db)

    @classmethod
    def sharing(cls, responses: Any) -> ConversationStore:
        """The store that goes with the Responses store ``responses``: in the same SQLite
        file if it is a ``SharedResponseStore`` (several API servers), else in memory."""
        if isinstance(responses, SharedResponseStore):
            return cls(responses.path)
        return cls()

    def _init_db(self, conn: sqlite3.Connection) -> None:
        with immediate_transaction(conn) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS conversations ("
                " id TEXT PRIMARY KEY,"
                " created_at INTEGER NOT NULL,"
                " metadata TEXT NOT NULL,"  # JSON
                " nitems INTEGER NOT NULL,"
                " nbytes INTEGER NOT NULL,"  # its metadata's and items' JSON
                " used INTEGER NOT NULL)"  # recency stamp: the largest is the most recent
            )
            conn.execute("CREATE INDEX IF NOT EXISTS conversations_used ON conversations (used)")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS conversation_items ("
                " seq INTEGER PRIMARY KEY AUTOINCREMENT,"  # the order of the items
                " conversation_id TEXT NOT NULL,"
                " id TEXT NOT NULL,"
                " item TEXT NOT NULL,"  # JSON
                " nbytes INTEGER NOT NULL,"
                " UNIQUE (conversation_id, id))"
            )
            conn.execute(
                "CREATE INDEX IF NOT EXISTS conversation_items_order"
                " ON conversation_items (conversation_id, seq)"
            )

    # -- conversations --------------------------------------------------------------------
    def __len__(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM conversations").fetchone()[0]

    def totals(self) -> tuple[int, int]:
        """(items, bytes) over all the conversations."""
        return self._conn.execute(
            "SELECT COALESCE(SUM(nitems), 0), COALESCE(SUM(nbytes), 0) FROM conversations"
        ).fetchone()

    def create(
        self, metadata: dict[str, str] | None = None, items: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """A new conversation (most recent) holding ``items`` (normalized); its object."""
        conversation_id = new_id("conv")
        meta = json.dumps(metadata or {}, ensure_ascii=True)
        with self._transaction() as conn:
            self._check_room(len(meta), items or [])
            conn.execute(
                "INSERT INTO conversations (id, created_at, metadata, nitems, nbytes, used)"
                " VALUES (?, ?, ?, 0, ?, (SELECT COALESCE(MAX(used), 0) + 1 FROM conversations))",
                (conversation_id, int(time.time()), meta, len(meta)),
            )
            self._insert(conn, conversation_id, items or [])
            self._evict(conn, conversation_id)
            return self._object(conn, conversation_id)

    def get(self, conversation_id: str) -> dict[str, Any] | None:
        """The conversation's object (now the most recently used), or None."""
        with self._transaction() as conn:
            if not self._touch(conn, conversation_id):
                return None
            return self._object(conn, conversation_id)

    def update(self, conversation_id: str, metadata: dict[str, str] | None) -> dict | None:
        """Replace the conversation's metadata; its object, or None if unknown."""
        meta = json.dumps(metadata or {}, ensure_ascii=True)
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT metadata FROM conversations WHERE id = ?", (conversation_id,)
            ).fetchone()
            if row is None:
                return None
            conn.execute(
                "UPDATE conversations SET metadata = ?, nbytes = nbytes + ? WHERE id = ?",
                (meta, len(meta) - len(row[0]), conversation_id),
            )
            self._touch(conn, conversation_id)
            self._evict(conn, conversation_id)
            return self._object(conn, conversation_id)

    def delete(self, conversation_id: str) -> bool:
        with self._transaction() as conn:
            return self._delete(conn, conversation_id)

    # -- items ----------------------------------------------------------------------------
    def add_items(self, conversation_id: str, items: list[dict[str, Any]]) -> list | None:
        """Append ``items`` (normalized) to the conversation; the items as stored (an id
        the conversation already holds is replaced by a new one), or None if unknown.
        ``VLLMValidationError`` naming ``items`` (nothing added) if they would put the
        conversation alone over a bound."""
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT nitems, nbytes FROM conversations WHERE id = ?", (conversation_id,)
            ).fetchone()
            if row is None:
                return None
            self._check_room(row[1], items, row[0])
            added = self._insert(conn, conversation_id, items)
            self._touch(conn, conversation_id)
            self._evict(conn, conversation_id)
            return added

    def items(self, conversation_id: str) -> list[dict[str, Any]] | None:
        """All the conversation's items, oldest first (a use), or None if unknown."""
        with self._transaction() as conn:
            if not self._touch(conn, conversation_id):
                return None
            rows = conn.execute(
                "SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
            return [json.loads(r[0]) for r in rows]

    def list_items(
        self,
        conversation_id: str,
        after: str | None = None,
        limit: int = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any] | None:
        """OpenAI's list object of the conversation's items: ``limit`` of them in
        ``order`` (by when they were added), from the one after item ``after``; None if
        the conversation is unknown, ``VLLMValidationError`` naming ``after`` if the item
        is."""
        asc = order == "asc"
        with self._transaction() as conn:
            if not self._touch(conn, conversation_id):
                return None
            bound, start = "", ()
            if after is not None:
                row = conn.execute(
                    "SELECT seq FROM conversation_items WHERE conversation_id = ? AND id = ?",
                    (conversation_id, after),
                ).fetchone()
                if row is None:
                    raise VLLMValidationError(
                        f"No item with id {loggable(after)} in this conversation", "after"
                    )
                bound, start = ("AND seq > ?" if asc else "AND seq < ?"), (row[0],)
            rows = conn.execute(
                f"SELECT item FROM conversation_items WHERE conversation_id = ? {bound}"
                f" ORDER BY seq {'ASC' if asc else 'DESC'} LIMIT ?",
                (conversation_id, *start, limit + 1),
            ).fetchall()
        page = [json.loads(r[0]) for r in rows[:limit]]
        return item_list(page, has_more=len(rows) > limit)

    def get_item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        """The item (a use of its conversation), or None."""
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT item FROM conversation_items WHERE conversation_id = ? AND id = ?",
                (conversation_id, item_id),
            ).fetchone()
            if row is not None:
                self._touch(conn, conversation_id)
            return None if row is None else json.loads(row[0])

    def delete_item(self, conversation_id: str, item_id: str) -> bool:
        with self._transaction() as conn:
            row = conn.execute(
                "DELETE FROM conversation_items WHERE conversation_id = ? AND id = ?"
                " RETURNING nbytes",
                (conversation_id, item_id),
            ).fetchone()
            if row is None:
                return False
            conn.execute(
                "UPDATE conversations SET nitems = nitems - 1, nbytes = nbytes - ? WHERE id = ?",
                (row[0], conversation_id),
            )
            self._touch(conn, conversation_id)
            return True

    def close(self) -> None:
        self._conn.close()

    # -- internals ------------------------------------------------------------------------
    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        return immediate_transaction(self._conn)

    def _check_room(self, nbytes: int, items: list[dict[str, Any]], nitems: int = 0) -> None:
        """``VLLMValidationError`` naming ``items`` if a conversation of ``nitems`` items and
        ``nbytes`` bytes cannot take ``items`` within the store's bounds."""
        added = sum(len(json.dumps(i, ensure_ascii=True)) for i in items)
        if nitems + len(items) > self.max_items or nbytes + added > self.max_bytes:
            raise VLLMValidationError(
                f"The conversation would hold {nitems + len(items)} items and "
                f"{nbytes + added} bytes, over the server's bounds ({self.max_items} items, "
                f"{self.max_bytes} bytes)",
                "items",
            )

    @staticmethod
    def _insert(
        conn: sqlite3.Connection, conversation_id: str, items: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        added = []
        for item in items:
            name = item["id"] if _utf8(item["id"]) else ""
            taken = (
                not name
                or conn.execute(
                    "SELECT 1 FROM conversation_items WHERE conversation_id = ? AND id = ?",
                    (conversation_id, name),
                ).fetchone()
            )
            if taken:  # a new id, of the same kind ("msg_", "fc_", ...) if it says
                prefix = name.split("_", 1)[0] if "_" in name else "item"
                item = {**item, "id": new_id(prefix)}
            text = json.dumps(item, ensure_ascii=True)
            conn.execute(
                "INSERT INTO conversation_items (conversation_id, id, item, nbytes)"
                " VALUES (?, ?, ?, ?)",
                (conversation_id, item["id"], text, len(text)),
            )
            conn.execute(
                "UPDATE conversations SET nitems = nitems + 1, nbytes = nbytes + ? WHERE id = ?",
                (len(text), conversation_id),
            )
            added.append(item)
        return added

    @staticmethod
    def _touch(conn: sqlite3.Connection, conversation_id: str) -> bool:
        """Mark the conversation the most recently used; False if unknown."""
        cursor = conn.execute(
            "UPDATE conversations SET used = (SELECT MAX(used) + 1 FROM conversations)"
            " WHERE id = ?",
            (conversation_id,),
        )
        return cursor.rowcount > 0

    @staticmethod
    def _delete(conn: sqlite3.Connection, conversation_id: str) -> bool:
        conn.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
        cursor = conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
        return cursor.rowcount > 0

    def _evict(self, conn: sqlite3.Connection, keep: str) -> None:
        """Evict the least recently used conversations but ``keep`` past the bounds."""
        count, nitems, nbytes = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(nitems), 0), COALESCE(SUM(nbytes), 0) FROM conversations"
        ).fetchone()
        while count > self.max_conversations or nitems > self.max_items or nbytes > self.max_bytes:
            row = conn.execute(
                "SELECT id, nitems, nbytes FROM conversations WHERE id != ? ORDER BY used LIMIT 1",
                (keep,),
            ).fetchone()
            if row is None:
                return
            self._delete(conn, row[0])
            logger.debug("Conversation %s evicted (least recently used)", row[0])
            count, nitems, nbytes = count - 1, nitems - row[1], nbytes - row[2]

    @staticmethod
    def _object(conn: sqlite3.Connection, conversation_id: str) -> dict[str, Any]:
        created_at, metadata = conn.execute(
            "SELECT created_at, metadata FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        return conversation_object(conversation_id, created_at, json.loads(metadata))


def _utf8(text: str) -> bool:
    """Whether ``text`` can be stored (JSON allows lone surrogates; SQLite does not)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def conversation_object(
    conversation_id: str, created_at: int, metadata: dict[str, str]
) -> dict[str, Any]:
    return {
        "id": conversation_id,
        "object": "conversation",
        "created_at": created_at,
        "metadata": metadata,
    }


def item_list(items: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


# -- /v1/responses' conversation ----------------------------------------------------------
def conversation_history(
    store: ConversationStore, conversation: str | None
) -> list[dict[str, Any]]:
    """The items a turn in ``conversation`` comes after (none without one); an unknown
    conversation is a 404 naming ``conversation``."""
    if conversation is None:
        return []
    items = store.items(conversation) if _utf8(conversation) else None
    if items is None:
        raise VLLMValidationError(
            f"Conversation with id {loggable(conversation)} not found.",
            "conversation",
            code="not_found",
        )
    return items


def append_turn(
    store: ConversationStore,
    conversation: str | None,
    status: str,
    input_items: list[dict[str, Any]],
    output: list[dict[str, Any]],
) -> None:
    """After a response in ``conversation`` finished ``status``: its input items then its
    output items are appended, unless it failed or was cancelled. A conversation deleted
    or evicted meanwhile, or one the items would put over the store's bounds, is left as
    it is (logged): the response itself is answered all the same."""
    if conversation is None or status not in ("completed", "incomplete"):
        return
    try:
        added = store.add_items(conversation, [*input_items, *output])
    except VLLMValidationError as e:
        added = None
        logger.warning("Conversation %s not extended: %s", loggable(conversation), e)
    if added is None:
        logger.warning("Conversation %s gone: the turn's items not added", loggable(conversation))


# -- routes -------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _bound(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_nesting(data)
            items = data.get("items")
            if isinstance(items, list) and len(items) > MAX_ITEMS_PER_ADD:
                raise VLLMValidationError(
                    f"items: at most {MAX_ITEMS_PER_ADD} items can be added at a time, "
                    f"got {len(items)}",
                    "items",
                )
        return data

    @model_validator(mode="after")
    def _check(self) -> _Body:
        metadata = getattr(self, "metadata", None)
        if metadata is not None:
            _check_metadata(metadata)
        return self


class ConversationCreateRequest(_Body):
    """``POST /v1/conversations``."""

    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None


class ConversationUpdateRequest(_Body):
    """``POST /v1/conversations/{id}``: the new metadata (null: none)."""

    metadata: dict[str, str] | None


class ItemCreateRequest(_Body):
    """``POST /v1/conversations/{id}/items``."""

    items: list[dict[str, Any]]


class ItemListQuery(BaseModel):
    """``GET /v1/conversations/{id}/items``' query: OpenAI's pagination."""

    after: str | None = None
    limit: int = Field(default=20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"


def _refuse_include(raw: Request) -> None:
    """``include`` asks for data this server does not keep (sources, logprobs, encrypted
    reasoning, ...): any value is a 400 naming it."""
    values = [v for k, v in raw.query_params.multi_items() if k in ("include", "include[]")]
    if any(values):
        raise VLLMValidationError(
            f"include={loggable(values)} is not supported by this server", "include"
        )


def _list_query(raw: Request) -> ItemListQuery:
    """The query as ``ItemListQuery``; a 400 naming the first bad parameter."""
    query = {k: v for k, v in raw.query_params.items() if k not in ("include", "include[]")}
    try:
        return ItemListQuery.model_validate(query)
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else None
        raise VLLMValidationError(f"{param}: {first['msg']}", param) from e


_RESPONSES = {
    **openapi.ERROR_RESPONSES,
    400: {"model": ErrorResponse, "description": "Invalid body or query parameter."},
    404: {"model": ErrorResponse, "description": "No conversation (or item) with this id."},
}


def add_conversation_routes(app: FastAPI, store: ConversationStore) -> None:
    """OpenAI's Conversations API over ``store``: create, retrieve, update and delete a
    conversation; create, list, retrieve and delete its items. Behind --api-key as every
    /v1 route (the server's middleware)."""

    @app.post("/v1/conversations", responses=_RESPONSES)
    async def create_conversation(body: ConversationCreateRequest | None = None):
        body = body or ConversationCreateRequest()
        return store.create(body.metadata, normalize_items(body.items or []))

    @app.get("/v1/conversations/{conversation_id}", responses=_RESPONSES)
    async def retrieve_conversation(conversation_id: str):
        found = store.get(conversation_id)
        if found is None:
            raise not_found(conversation_id)
        return found

    @app.post("/v1/conversations/{conversation_id}", responses=_RESPONSES)
    async def update_conversation(conversation_id: str, body: ConversationUpdateRequest):
        found = store.update(conversation_id, body.metadata)
        if found is None:
            raise not_found(conversation_id)
        return found

    @app.delete("/v1/conversations/{conversation_id}", responses=_RESPONSES)
    async def delete_conversation(conversation_id: str):
        if not store.delete(conversation_id):
            raise not_found(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.post("/v1/conversations/{conversation_id}/items", responses=_RESPONSES)
    async def create_items(conversation_id: str, body: ItemCreateRequest, raw: Request):
        _refuse_include(raw)
        added = store.add_items(conversation_id, normalize_items(body.items))
        if added is None:
            raise not_found(conversation_id)
        return item_list(added)

    @app.get("/v1/conversations/{conversation_id}/items", responses=_RESPONSES)
    async def list_items(conversation_id: str, raw: Request):
        _refuse_include(raw)
        q = _list_query(raw)
        page = store.list_items(conversation_id, q.after, q.limit, q.order)
        if page is None:
            raise not_found(conversation_id)
        return page

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=_RESPONSES)
    async def retrieve_item(conversation_id: str, item_id: str, raw: Request):
        _refuse_include(raw)
        item = store.get_item(conversation_id, item_id)
        if item is None:
            if store.get(conversation_id) is None:
                raise not_found(conversation_id)
            raise item_not_found(conversation_id, item_id)
        return item

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}", responses=_RESPONSES)
    async def delete_item(conversation_id: str, item_id: str):
        if not store.delete_item(conversation_id, item_id):
            if store.get(conversation_id) is None:
                raise not_found(conversation_id)
            raise item_not_found(conversation_id, item_id)
        found = store.get(conversation_id)
        assert found is not None
        return found
