"""ConversationStore: conversations and messages in the tenants' SQL database (SQLite embedded, PostgreSQL in a
fleet). Every query is scoped by the owner, so another user's ids are simply not found.

Writes to one conversation take turns: a transaction that adds or reopens a reply first updates the
conversation's row, which holds PostgreSQL's row lock (SQLite's write lock) until it commits, so two replies can
never stream in one conversation at once and sequence numbers never collide."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tokenfleet.conversations import cursors
from tokenfleet.conversations.records import (
    COMPLETE,
    FAILED,
    STOPPED,
    STREAMING,
    Conflict,
    Conversation,
    Message,
    Outcome,
    Page,
)
from tokenfleet.store.api_keys import new_id
from tokenfleet.store.db import Database
from tokenfleet.store.models import ConversationRow, MessageRow, utcnow
from tokenfleet.store.records import NotFound, Owner

TITLE_CHARS = 60  # a title made from the first message
LOST = "the gateway generating this reply stopped (restart or crash); regenerate it"
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_SEQ = 2**63 - 1


def known(ref: str, what: str) -> str:
    """An id as our ids look; anything else (too long, a NUL byte PostgreSQL would refuse) is simply not found."""
    if not ID_PATTERN.fullmatch(ref):
        raise NotFound(f"no {what} {ref[:80]!r}")
    return ref


def storable(text: str) -> str:
    """Generated text as the database takes it: PostgreSQL refuses NUL characters, which a byte-level tokenizer
    can produce; they become U+FFFD, as undecodable bytes do."""
    return text.replace("\x00", "\ufffd")


def owned_by(owner: Owner) -> ColumnElement[bool]:
    """The scope of every query: the conversations of this user of this organisation (see `owner_columns`)."""
    return and_(ConversationRow.org_id == owner.org_id, ConversationRow.user_id == owner.user_id)


def owner_columns(owner: Owner) -> dict[str, str]:
    """What makes a new conversation the owner's, for `owned_by` to find."""
    return {"org_id": owner.org_id, "user_id": owner.user_id}


def conversation(row: ConversationRow) -> Conversation:
    return Conversation(row.id, row.title, row.system_prompt, row.model, row.created_at, row.updated_at)


def message(row: MessageRow) -> Message:
    return Message(
        row.id,
        row.conversation_id,
        row.seq,
        row.role,
        row.content,
        row.status,
        row.finish_reason,
        row.model,
        row.request_id,
        row.tokens,
        row.prompt_tokens,
        row.cached_tokens,
        row.error,
        row.created_at,
        row.updated_at,
    )


def title_of(content: str) -> str:
    line = next((line.strip() for line in content.splitlines() if line.strip()), "")
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def check_reopenable(msg: Message, last_seq: int, continuing: bool) -> None:
    """Regenerate and continue work on the conversation's last reply, once it has stopped streaming; continue only
    on a reply that was stopped or cut off at max_tokens."""
    verb = "continued" if continuing else "regenerated"
    if msg.role != "assistant":
        raise Conflict(f"message {msg.id} is the user's; only a reply can be {verb}")
    if msg.status == STREAMING:
        raise Conflict(f"message {msg.id} is still streaming; stop it first")
    if msg.seq != last_seq:
        raise Conflict(f"message {msg.id} is not the conversation's last reply; only that one can be {verb}")
    if continuing and not (msg.status == STOPPED or (msg.status == COMPLETE and msg.finish_reason == "length")):
        raise Conflict(
            f"message {msg.id} is {msg.status}"
            + (f" ({msg.finish_reason})" if msg.finish_reason else "")
            + "; only a stopped reply or one cut off at max_tokens can be continued"
        )


class ConversationStore:
    def __init__(self, db: Database, stale_after_s: float = 30.0) -> None:
        self.db, self.stale_after = db, timedelta(seconds=stale_after_s)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncSession]:
        async with self.db.sessions.begin() as session:
            yield session

    # --- conversations ----------------------------------------------------------------------------------------

    async def create(
        self, owner: Owner, model: str, title: str | None = None, system_prompt: str | None = None
    ) -> Conversation:
        now = utcnow()
        row = ConversationRow(
            id=new_id("conv"),
            **owner_columns(owner),
            title=title,
            system_prompt=system_prompt,
            model=model,
            created_at=now,
            updated_at=now,
        )
        async with self._transaction() as session:
            session.add(row)
        return conversation(row)

    async def get(self, owner: Owner, conversation_id: str) -> Conversation:
        known(conversation_id, "conversation")
        async with self._transaction() as session:
            return conversation(await self._owned(session, owner, conversation_id))

    async def _owned(self, session: AsyncSession, owner: Owner, conversation_id: str) -> ConversationRow:
        row = await session.scalar(
            select(ConversationRow).where(ConversationRow.id == conversation_id, owned_by(owner))
        )
        if row is None:
            raise NotFound(f"no conversation {conversation_id!r}")
        return row

    async def list_conversations(self, owner: Owner, limit: int, cursor: str | None = None) -> Page:
        """The owner's conversations, most recently active first."""
        query = (
            select(ConversationRow)
            .where(owned_by(owner))
            .order_by(ConversationRow.updated_at.desc(), ConversationRow.id.desc())
            .limit(limit + 1)
        )
        if cursor is not None:
            moment, last_id = cursors.decode(cursor, "c", str, str)
            try:
                at = datetime.fromisoformat(moment)
            except ValueError:
                at = None
            if at is None or at.tzinfo is None or not ID_PATTERN.fullmatch(last_id):
                raise cursors.BadCursor(f"cursor {cursor[:40]!r} is not one this listing gave out")
            query = query.where(
                or_(
                    ConversationRow.updated_at < at,
                    and_(ConversationRow.updated_at == at, ConversationRow.id < last_id),
                )
            )
        async with self._transaction() as session:
            rows = list(await session.scalars(query))
        more, rows = len(rows) > limit, rows[:limit]
        last = rows[-1] if rows else None
        return Page(
            [conversation(r) for r in rows], cursors.encode("c", last.updated_at.isoformat(), last.id) if more else None
        )

    async def set_title(self, owner: Owner, conversation_id: str, title: str | None) -> Conversation:
        known(conversation_id, "conversation")
        async with self._transaction() as session:
            row = await self._owned(session, owner, conversation_id)
            row.title = title
            return conversation(row)

    async def delete(self, owner: Owner, conversation_id: str) -> list[str]:
        """Deletes the conversation and its messages; returns the ids of replies that were streaming."""
        known(conversation_id, "conversation")
        async with self._transaction() as session:
            await self._owned(session, owner, conversation_id)
            streaming = list(
                await session.scalars(
                    select(MessageRow.id).where(
                        MessageRow.conversation_id == conversation_id, MessageRow.status == STREAMING
                    )
                )
            )
            await session.execute(delete(MessageRow).where(MessageRow.conversation_id == conversation_id))
            await session.execute(delete(ConversationRow).where(ConversationRow.id == conversation_id))
        return streaming

    # --- reading messages -------------------------------------------------------------------------------------

    async def history(self, owner: Owner, conversation_id: str) -> list[Message]:
        """Every message of the conversation, oldest first (stale replies failed first)."""
        await self.fail_stale(known(conversation_id, "conversation"))
        async with self._transaction() as session:
            await self._owned(session, owner, conversation_id)
            rows = await session.scalars(
                select(MessageRow).where(MessageRow.conversation_id == conversation_id).order_by(MessageRow.seq)
            )
            return [message(r) for r in rows]

    async def messages(
        self, owner: Owner, conversation_id: str, limit: int, cursor: str | None = None, newest_first: bool = True
    ) -> Page:
        await self.fail_stale(known(conversation_id, "conversation"))
        order = MessageRow.seq.desc() if newest_first else MessageRow.seq
        query = select(MessageRow).where(MessageRow.conversation_id == conversation_id).order_by(order).limit(limit + 1)
        if cursor is not None:
            (after,) = cursors.decode(cursor, "m" + ("d" if newest_first else "a"), int)
            if not 0 <= after <= MAX_SEQ:
                raise cursors.BadCursor(f"cursor {cursor[:40]!r} is not one this listing gave out")
            query = query.where(MessageRow.seq < after if newest_first else MessageRow.seq > after)
        async with self._transaction() as session:
            await self._owned(session, owner, conversation_id)
            rows = list(await session.scalars(query))
        more, rows = len(rows) > limit, rows[:limit]
        kind = "m" + ("d" if newest_first else "a")
        return Page([message(r) for r in rows], cursors.encode(kind, rows[-1].seq) if more else None)

    async def message(self, owner: Owner, message_id: str) -> Message:
        found = await self._message(owner, known(message_id, "message"))
        if found.status == STREAMING and found.updated_at < utcnow() - self.stale_after:
            await self.fail_stale(found.conversation_id)
            found = await self._message(owner, message_id)
        return found

    async def _message(self, owner: Owner, message_id: str) -> Message:
        async with self._transaction() as session:
            return message(await self._owned_message(session, owner, message_id))

    async def _owned_message(self, session: AsyncSession, owner: Owner, message_id: str) -> MessageRow:
        row = await session.scalar(
            select(MessageRow)
            .join(ConversationRow, MessageRow.conversation_id == ConversationRow.id)
            .where(MessageRow.id == message_id, owned_by(owner))
        )
        if row is None:
            raise NotFound(f"no message {message_id!r}")
        return row

    # --- writing replies --------------------------------------------------------------------------------------

    async def _take_turn(self, session: AsyncSession, owner: Owner, conversation_id: str) -> ConversationRow:
        """Locks the conversation for this transaction (see the module's docstring)."""
        touched = await session.execute(
            update(ConversationRow)
            .where(ConversationRow.id == conversation_id, owned_by(owner))
            .values(updated_at=utcnow())
        )
        if touched.rowcount == 0:
            raise NotFound(f"no conversation {conversation_id!r}")
        return await self._owned(session, owner, conversation_id)

    async def add_turn(
        self, owner: Owner, conversation_id: str, content: str, tokens: int, request_id: str, model: str
    ) -> tuple[Message, Message]:
        """The user's message and the reply that will stream into it (empty, status streaming)."""
        known(conversation_id, "conversation")
        async with self._transaction() as session:
            conv = await self._take_turn(session, owner, conversation_id)
            busy = await session.scalar(
                select(MessageRow.id)
                .where(MessageRow.conversation_id == conversation_id, MessageRow.status == STREAMING)
                .limit(1)
            )
            if busy is not None:
                raise Conflict(
                    f"a reply is still streaming in this conversation (message {busy}); wait for it or stop it first"
                )
            last = (
                await session.scalar(
                    select(func.max(MessageRow.seq)).where(MessageRow.conversation_id == conversation_id)
                )
                or 0
            )
            if conv.title is None:
                conv.title = title_of(content) or None
            now = utcnow()
            user = MessageRow(
                id=new_id("msg"),
                conversation_id=conversation_id,
                seq=last + 1,
                role="user",
                content=content,
                status=COMPLETE,
                tokens=tokens,
                created_at=now,
                updated_at=now,
            )
            reply = MessageRow(
                id=new_id("msg"),
                conversation_id=conversation_id,
                seq=last + 2,
                role="assistant",
                content="",
                status=STREAMING,
                model=model,
                request_id=request_id,
                tokens=0,
                created_at=now,
                updated_at=now,
            )
            session.add_all([user, reply])
            return message(user), message(reply)

    async def reopen(self, owner: Owner, message_id: str, request_id: str, model: str, continuing: bool) -> Message:
        """The conversation's last reply streams again: from scratch (regenerate) or after its text (continue)."""
        known(message_id, "message")
        async with self._transaction() as session:
            row = await self._owned_message(session, owner, message_id)
            await self._take_turn(session, owner, row.conversation_id)
            await session.refresh(row)
            last = await session.scalar(
                select(func.max(MessageRow.seq)).where(MessageRow.conversation_id == row.conversation_id)
            )
            check_reopenable(message(row), last, continuing)
            if not continuing:
                row.content, row.tokens = "", 0
            row.status, row.request_id, row.model, row.finish_reason, row.error = (
                STREAMING,
                request_id,
                model,
                None,
                None,
            )
            row.updated_at = utcnow()
            return message(row)

    async def save_progress(self, message_id: str, request_id: str, content: str, tokens: int) -> bool:
        """Saves a streaming reply's text so far; False when it is no longer this generation's to write (stopped
        from another gateway, given up as stale, regenerated or deleted)."""
        async with self._transaction() as session:
            saved = await session.execute(
                update(MessageRow)
                .where(MessageRow.id == message_id, MessageRow.request_id == request_id, MessageRow.status == STREAMING)
                .values(content=storable(content), tokens=tokens, updated_at=utcnow())
            )
            return saved.rowcount == 1

    async def finish(self, message_id: str, request_id: str, outcome: Outcome) -> Message | None:
        """The reply's final text and status. If someone else ended it meanwhile (a stop through another gateway),
        their status stands and only the text is saved. None when the message is gone."""
        mine = and_(MessageRow.id == message_id, MessageRow.request_id == request_id)
        counts = dict(
            content=storable(outcome.content),
            tokens=outcome.tokens,
            prompt_tokens=outcome.prompt_tokens,
            cached_tokens=outcome.cached_tokens,
            updated_at=utcnow(),
        )
        async with self._transaction() as session:
            ended = await session.execute(
                update(MessageRow)
                .where(mine, MessageRow.status == STREAMING)
                .values(status=outcome.status, finish_reason=outcome.finish_reason, error=outcome.error, **counts)
            )
            if ended.rowcount == 0:
                await session.execute(update(MessageRow).where(mine).values(**counts))
            row = await session.get(MessageRow, message_id)
            return message(row) if row is not None else None

    async def stop(self, owner: Owner, message_id: str) -> Message:
        """Marks a streaming reply stopped (its generation, wherever it runs, sees that at its next save)."""
        found = await self.message(owner, message_id)
        async with self._transaction() as session:
            stopped = await session.execute(
                update(MessageRow)
                .where(MessageRow.id == message_id, MessageRow.status == STREAMING)
                .values(status=STOPPED, updated_at=utcnow())
            )
        if stopped.rowcount == 0:
            found = await self.message(owner, message_id)
            raise Conflict(
                f"message {message_id} is not streaming (it is {found.status}); only a streaming reply can be stopped"
            )
        return await self.message(owner, found.id)

    async def fail_stale(self, conversation_id: str | None = None) -> int:
        """Replies left 'streaming' by a gateway that died (no save for stale_after_s) become failed, which offers
        regenerate. Of one conversation, or all; returns how many."""
        stale = and_(MessageRow.status == STREAMING, MessageRow.updated_at < utcnow() - self.stale_after)
        if conversation_id is not None:
            stale = and_(stale, MessageRow.conversation_id == conversation_id)
        async with self._transaction() as session:  # look first: most reads find none, and need no write lock
            if await session.scalar(select(MessageRow.id).where(stale).limit(1)) is None:
                return 0
        async with self._transaction() as session:
            failed = await session.execute(
                update(MessageRow).where(stale).values(status=FAILED, error=LOST, updated_at=utcnow())
            )
            return failed.rowcount
