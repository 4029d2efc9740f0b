"""The conversation store on SQLite and PostgreSQL: owner scoping, cursors through long histories, the reply's
life (streaming -> complete | stopped | failed), stale replies of a dead gateway, one reply at a time."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import update

from tokenfleet.conversations.cursors import BadCursor
from tokenfleet.conversations.records import COMPLETE, FAILED, STOPPED, STREAMING, Conflict, Outcome
from tokenfleet.conversations.store import ConversationStore
from tokenfleet.store.db import Database
from tokenfleet.store.models import MessageRow, utcnow
from tokenfleet.store.records import NotFound, Owner

pytestmark = pytest.mark.anyio
ANN, EVE, ANNS_NAMESAKE = Owner("acme", "ann"), Owner("rival", "eve"), Owner("rival", "ann")


@pytest.fixture
def store(db: Database) -> ConversationStore:
    return ConversationStore(db, stale_after_s=30)


async def finished_turn(store: ConversationStore, owner: Owner, conversation_id: str, text: str) -> str:
    _, reply = await store.add_turn(owner, conversation_id, text, 3, f"req-{text}", "tiny")
    await store.finish(reply.id, reply.request_id, Outcome(f"re: {text}", COMPLETE, "stop", 4, 9, 0, None))
    return reply.id


async def test_cursors_page_through_a_long_history_without_gaps_or_repeats(store):
    conv = await store.create(ANN, "tiny")
    for i in range(37):
        await finished_turn(store, ANN, conv.id, f"m{i}")
    everything = [m.id for m in await store.history(ANN, conv.id)]
    assert len(everything) == 74
    for newest_first in (False, True):
        seen, cursor = [], None
        while True:
            page = await store.messages(ANN, conv.id, 10, cursor, newest_first)
            seen += [m.id for m in page.data]
            cursor = page.next_cursor
            if cursor is None:
                break
        assert seen == (everything[::-1] if newest_first else everything)


async def test_a_cursor_stays_valid_while_messages_are_added(store):
    conv = await store.create(ANN, "tiny")
    for i in range(5):
        await finished_turn(store, ANN, conv.id, f"m{i}")
    first = await store.messages(ANN, conv.id, 4)  # newest first: m4's reply, m4, m3's reply, m3
    await finished_turn(store, ANN, conv.id, "late")
    rest, cursor = [], first.next_cursor
    while cursor:
        page = await store.messages(ANN, conv.id, 4, cursor)
        rest += page.data
        cursor = page.next_cursor
    assert [m.content for m in first.data] == ["re: m4", "m4", "re: m3", "m3"]
    assert [m.content for m in rest] == ["re: m2", "m2", "re: m1", "m1", "re: m0", "m0"], "no repeats, no gaps"


async def test_conversations_are_listed_by_last_activity_and_only_their_owners(store):
    ids = [(await store.create(ANN, "tiny", title=f"c{i}")).id for i in range(7)]
    await store.create(EVE, "tiny", title="eve's")
    await store.create(ANNS_NAMESAKE, "tiny", title="another ann")
    await finished_turn(store, ANN, ids[2], "bump")  # activity moves c2 to the top
    seen, cursor = [], None
    while True:
        page = await store.list_conversations(ANN, 3, cursor)
        seen += [c.title for c in page.data]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == ["c2", "c6", "c5", "c4", "c3", "c1", "c0"]
    assert [c.title for c in (await store.list_conversations(EVE, 10)).data] == ["eve's"]


async def test_nothing_of_another_user_can_be_seen_or_touched(store):
    conv = await store.create(ANN, "tiny")
    reply = await finished_turn(store, ANN, conv.id, "secret")
    for stranger in (EVE, ANNS_NAMESAKE, Owner("acme", "bob")):
        with pytest.raises(NotFound):
            await store.get(stranger, conv.id)
        with pytest.raises(NotFound):
            await store.history(stranger, conv.id)
        with pytest.raises(NotFound):
            await store.messages(stranger, conv.id, 10)
        with pytest.raises(NotFound):
            await store.message(stranger, reply)
        with pytest.raises(NotFound):
            await store.stop(stranger, reply)
        with pytest.raises(NotFound):
            await store.add_turn(stranger, conv.id, "hi", 1, "r", "tiny")
        with pytest.raises(NotFound):
            await store.reopen(stranger, reply, "r", "tiny", continuing=False)
        with pytest.raises(NotFound):
            await store.set_title(stranger, conv.id, "mine now")
        with pytest.raises(NotFound):
            await store.delete(stranger, conv.id)
    assert len(await store.history(ANN, conv.id)) == 2 and (await store.get(ANN, conv.id)).title == "secret"


async def test_a_reply_streams_then_ends_and_only_its_own_generation_writes_it(store):
    conv = await store.create(ANN, "tiny")
    user, reply = await store.add_turn(ANN, conv.id, "hello\nsecond line", 2, "req-1", "tiny")
    assert (user.status, reply.status, reply.content) == (COMPLETE, STREAMING, "")
    assert (await store.get(ANN, conv.id)).title == "hello", "titled after the first message"
    assert await store.save_progress(reply.id, "req-1", "partial", 1)
    assert (await store.message(ANN, reply.id)).content == "partial"
    assert not await store.save_progress(reply.id, "req-other", "intruder", 1)
    done = await store.finish(reply.id, "req-1", Outcome("partial text", COMPLETE, "stop", 2, 5, 1, None))
    assert (done.status, done.content, done.tokens, done.prompt_tokens) == (COMPLETE, "partial text", 2, 5)
    assert not await store.save_progress(reply.id, "req-1", "late", 3), "a finished reply is not written again"


async def test_stopping_through_the_database_then_the_generation_keeps_the_stop(store):
    conv = await store.create(ANN, "tiny")
    _, reply = await store.add_turn(ANN, conv.id, "hi", 1, "req-1", "tiny")
    await store.save_progress(reply.id, "req-1", "so far", 2)
    stopped = await store.stop(ANN, reply.id)
    assert (stopped.status, stopped.content) == (STOPPED, "so far")
    with pytest.raises(Conflict, match="not streaming.*stopped"):
        await store.stop(ANN, reply.id)
    assert not await store.save_progress(reply.id, "req-1", "so far and more", 3), "the generation learns of it"
    final = await store.finish(reply.id, "req-1", Outcome("so far and more", COMPLETE, "stop", 3, 5, 0, None))
    assert (final.status, final.content) == (STOPPED, "so far and more"), "the stop stands, the text is saved"


async def test_a_reply_left_streaming_by_a_dead_gateway_turns_failed(store, db):
    conv = await store.create(ANN, "tiny")
    _, reply = await store.add_turn(ANN, conv.id, "hi", 1, "req-1", "tiny")
    await store.save_progress(reply.id, "req-1", "half a rep", 3)
    assert await store.fail_stale() == 0, "a reply saved recently is alive"
    async with db.sessions.begin() as session:  # its gateway died 31 s ago
        await session.execute(
            update(MessageRow).where(MessageRow.id == reply.id).values(updated_at=utcnow() - timedelta(seconds=31))
        )
    found = await store.message(ANN, reply.id)  # reading it is enough
    assert (found.status, found.content) == (FAILED, "half a rep") and "regenerate" in found.error
    with pytest.raises(Conflict):
        await store.stop(ANN, reply.id)
    reopened = await store.reopen(ANN, reply.id, "req-2", "tiny", continuing=False)
    assert (reopened.status, reopened.content, reopened.request_id) == (STREAMING, "", "req-2")


async def test_the_sweep_fails_stale_replies_everywhere(store, db):
    replies = []
    for owner in (ANN, EVE):
        conv = await store.create(owner, "tiny")
        replies.append((await store.add_turn(owner, conv.id, "hi", 1, f"req-{owner.user_id}", "tiny"))[1])
    async with db.sessions.begin() as session:
        await session.execute(
            update(MessageRow).where(MessageRow.id == replies[0].id).values(updated_at=utcnow() - timedelta(minutes=5))
        )
    assert await store.fail_stale() == 1
    assert (await store.message(ANN, replies[0].id)).status == FAILED
    assert (await store.message(EVE, replies[1].id)).status == STREAMING


async def test_only_one_reply_streams_in_a_conversation_even_when_racing(store):
    conv = await store.create(ANN, "tiny")
    results = await asyncio.gather(
        *(store.add_turn(ANN, conv.id, f"m{i}", 1, f"req-{i}", "tiny") for i in range(4)), return_exceptions=True
    )
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, Conflict) for r in results if isinstance(r, BaseException)), results
    assert [m.seq for m in await store.history(ANN, conv.id)] == [1, 2]


async def test_regenerate_and_continue_only_the_last_reply_in_the_right_state(store):
    conv = await store.create(ANN, "tiny")
    first = await finished_turn(store, ANN, conv.id, "one")
    _, last = await store.add_turn(ANN, conv.id, "two", 1, "req-two", "tiny")
    with pytest.raises(Conflict, match="still streaming"):
        await store.reopen(ANN, last.id, "r", "tiny", continuing=False)
    await store.finish(last.id, "req-two", Outcome("cut", COMPLETE, "length", 5, 4, 0, None))
    with pytest.raises(Conflict, match="not the conversation's last reply"):
        await store.reopen(ANN, first, "r", "tiny", continuing=False)
    user_message = (await store.history(ANN, conv.id))[-2].id
    with pytest.raises(Conflict, match="the user's"):
        await store.reopen(ANN, user_message, "r", "tiny", continuing=False)
    continued = await store.reopen(ANN, last.id, "req-more", "tiny", continuing=True)
    assert (continued.content, continued.tokens, continued.status) == ("cut", 5, STREAMING)
    await store.finish(last.id, "req-more", Outcome("cut and done", COMPLETE, "stop", 8, 4, 0, None))
    with pytest.raises(Conflict, match="only a stopped reply or one cut off"):
        await store.reopen(ANN, last.id, "r", "tiny", continuing=True)


async def test_deleting_a_conversation_removes_its_messages(store):
    conv = await store.create(ANN, "tiny")
    reply = await finished_turn(store, ANN, conv.id, "bye")
    _, streaming = await store.add_turn(ANN, conv.id, "again", 1, "req-x", "tiny")
    assert await store.delete(ANN, conv.id) == [streaming.id]
    with pytest.raises(NotFound):
        await store.get(ANN, conv.id)
    with pytest.raises(NotFound):
        await store.message(ANN, reply)
    assert await store.finish(streaming.id, "req-x", Outcome("x", COMPLETE, "stop", 1, 1, 0, None)) is None


async def test_a_cursor_must_be_one_the_listing_gave_out(store):
    conv = await store.create(ANN, "tiny")
    for bad in ("nonsense", "eyJ4IjoxfQ", "WyJtZCIsInRleHQiXQ"):
        with pytest.raises(BadCursor):
            await store.messages(ANN, conv.id, 10, bad)
    listing_cursor_kind = "WyJjIiwiMjAyNC0wMS0wMVQwMDowMDowMCswMDowMCIsImNvbnZfeCJd"  # a conversations cursor
    with pytest.raises(BadCursor):
        await store.messages(ANN, conv.id, 10, listing_cursor_kind)
    with pytest.raises(BadCursor):
        await store.list_conversations(ANN, 10, "WyJjIiwibm90IGEgdGltZSIsIngiXQ")


async def test_generated_nul_characters_are_stored_as_replacement_characters(store):
    """A byte-level tokenizer can produce "\\x00", which PostgreSQL refuses in text."""
    conv = await store.create(ANN, "tiny")
    _, reply = await store.add_turn(ANN, conv.id, "hi", 1, "req-1", "tiny")
    assert await store.save_progress(reply.id, "req-1", "a\x00b", 2)
    done = await store.finish(reply.id, "req-1", Outcome("a\x00bc", COMPLETE, "stop", 3, 1, 0, None))
    assert done.content == "a\ufffdbc"


async def test_ids_that_cannot_be_ours_are_not_found(store):
    for bad in ("a\x00b", "x" * 65, "", "caf\u00e9"):
        with pytest.raises(NotFound):
            await store.get(ANN, bad)
        with pytest.raises(NotFound):
            await store.message(ANN, bad)
        with pytest.raises(NotFound):
            await store.history(ANN, bad)
