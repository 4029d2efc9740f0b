"""The conversations API in process (ASGI) over a stand-in replica, on SQLite and PostgreSQL, with real API keys:
the reply's stream in the design's format, partial text mid-stream, stop, regenerate, continue, and bad input."""

from __future__ import annotations

import asyncio

import pytest

from tests.conversations.helpers import SlowUpstream, conversations_app, parse_sse, reply_text, wait_for
from tokenfleet.model.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio
ERROR_SHAPE = {"message", "type", "param", "code"}


async def new_conversation(client, users, who: str = "ann", **body) -> str:
    response = await client.post("/v1/conversations", json=body, headers=users.auth(who))
    assert response.status_code == 201, response.text
    return response.json()["id"]


async def streaming_reply(client, users, conversation_id: str) -> dict:
    """The reply row once the gateway admitted the request (the POST itself is still streaming)."""

    async def reply():
        page = (await client.get(f"/v1/conversations/{conversation_id}/messages", headers=users.auth("ann"))).json()
        return next((m for m in page["data"] if m["role"] == "assistant"), None)

    return await wait_for(reply)


async def test_a_message_streams_its_reply_in_the_designs_format(demo_model_dir, db):
    upstream = SlowUpstream(count=6)
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, _, users):
        conv = await new_conversation(client, users, system_prompt="You are terse.")
        response = await client.post(
            f"/v1/conversations/{conv}/messages", json={"content": "Hello there"}, headers=users.auth("ann")
        )
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.text)
        names = [name for name, _ in events]
        assert names == ["start"] + ["token"] * 6 + ["done"]
        assert all(data["type"] == name for name, data in events)
        start, done = events[0][1], events[-1][1]
        assert done == {
            "type": "done",
            "messageId": start["messageId"],
            "status": "complete",
            "finishReason": "length",
            "usage": {"input": 7, "output": 6, "cached": 0},
        }
        assert response.headers["x-message-id"] == start["messageId"]
        kind, body = upstream.requests[0]
        assert kind == "chat" and body["messages"] == [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello there"},
        ]
        saved = (await client.get(f"/v1/messages/{start['messageId']}", headers=users.auth("ann"))).json()
        assert saved["content"] == reply_text(events) == "w0 w1 w2 w3 w4 w5 "
        assert (saved["status"], saved["finish_reason"], saved["tokens"]) == ("complete", "length", 6)
        listed = (
            await client.get(f"/v1/conversations/{conv}/messages", params={"order": "asc"}, headers=users.auth("ann"))
        ).json()
        assert [(m["role"], m["id"]) for m in listed["data"]] == [
            ("user", start["userMessageId"]),
            ("assistant", start["messageId"]),
        ]
        assert (await client.get(f"/v1/conversations/{conv}", headers=users.auth("ann"))).json()[
            "title"
        ] == "Hello there"


async def test_the_next_turn_sends_the_history(demo_model_dir, db):
    upstream = SlowUpstream(count=2)
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, _, users):
        conv = await new_conversation(client, users)
        for text in ("first", "second"):
            await client.post(f"/v1/conversations/{conv}/messages", json={"content": text}, headers=users.auth("ann"))
        assert upstream.requests[1][1]["messages"] == [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "w0 w1 "},
            {"role": "user", "content": "second"},
        ]


async def test_a_long_history_is_cut_to_the_window_keeping_the_system_prompt(demo_model_dir, db):
    """The in-process model's window is 512 tokens; max_tokens 100 leaves room for a few turns only."""
    upstream = SlowUpstream(count=30)
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, _, users):
        conv = await new_conversation(client, users, system_prompt="Stay on topic.")
        for i in range(12):
            await client.post(
                f"/v1/conversations/{conv}/messages",
                json={"content": f"question {i} " * 4, "max_tokens": 100},
                headers=users.auth("ann"),
            )
        sent = upstream.requests[-1][1]
        assert sent["messages"][0] == {"role": "system", "content": "Stay on topic."}
        assert sent["messages"][-1] == {"role": "user", "content": "question 11 " * 4}
        assert sent["messages"][-3]["content"] == "question 10 " * 4, "the newest turns stay"
        assert {"role": "user", "content": "question 0 " * 4} not in sent["messages"], "the oldest went"
        tokens = Tokenizer.from_dir(demo_model_dir).encode_chat(sent["messages"], add_generation_prompt=True)
        assert len(tokens) + 100 <= 512
        everything = (
            await client.get(f"/v1/conversations/{conv}/messages", params={"limit": 100}, headers=users.auth("ann"))
        ).json()["data"]
        assert len(everything) == 24, "the history itself is all kept"


async def test_mid_stream_a_refresh_shows_the_text_so_far_and_stop_keeps_it(demo_model_dir, db):
    upstream = SlowUpstream(count=400, delay=0.02)
    async with conversations_app(demo_model_dir, db, [upstream], save_interval_s=0.1) as (client, _, users):
        conv = await new_conversation(client, users)
        posting = asyncio.ensure_future(
            client.post(f"/v1/conversations/{conv}/messages", json={"content": "Go on"}, headers=users.auth("ann"))
        )
        reply = await streaming_reply(client, users, conv)

        async def partial():
            found = (await client.get(f"/v1/messages/{reply['id']}", headers=users.auth("ann"))).json()
            return found if found["content"].count("w") >= 3 else None

        seen = await partial_or_fail(partial)
        assert seen["status"] == "streaming" and seen["content"].startswith("w0 w1 w2 ")
        stopped = await client.post(f"/v1/messages/{reply['id']}/stop", headers=users.auth("ann"))
        assert stopped.status_code == 200, stopped.text
        body = stopped.json()
        assert body["status"] == "stopped" and body["content"].startswith(seen["content"])
        assert 3 <= body["content"].count("w") < 400 and body["finish_reason"] is None
        events = parse_sse((await posting).text)
        assert events[-1][1]["status"] == "stopped" and reply_text(events) == body["content"]
        assert upstream.running == 0, "the replica's stream was closed"
        again = await client.post(f"/v1/messages/{reply['id']}/stop", headers=users.auth("ann"))
        assert again.status_code == 409 and set(again.json()["error"]) == ERROR_SHAPE
        assert "not streaming" in again.json()["error"]["message"]
        saved = (await client.get(f"/v1/messages/{reply['id']}", headers=users.auth("ann"))).json()
        assert saved["content"] == body["content"] and saved["status"] == "stopped"


async def partial_or_fail(predicate):
    found = await wait_for(predicate)
    assert found, "the reply's partial text never showed"
    return found


async def test_stopping_a_finished_reply_or_a_users_message_is_a_409(demo_model_dir, db):
    async with conversations_app(demo_model_dir, db, [SlowUpstream(count=2)]) as (client, _, users):
        conv = await new_conversation(client, users)
        start = parse_sse(
            (
                await client.post(
                    f"/v1/conversations/{conv}/messages", json={"content": "hi"}, headers=users.auth("ann")
                )
            ).text
        )[0][1]
        for message_id, status in ((start["messageId"], "complete"), (start["userMessageId"], "complete")):
            response = await client.post(f"/v1/messages/{message_id}/stop", headers=users.auth("ann"))
            assert response.status_code == 409, response.text
            error = response.json()["error"]
            assert set(error) == ERROR_SHAPE and error["code"] == "conflict"
            assert f"it is {status}" in error["message"]


async def test_a_second_message_while_a_reply_streams_is_a_409(demo_model_dir, db):
    upstream = SlowUpstream(count=200, delay=0.02)
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, _, users):
        conv = await new_conversation(client, users)
        posting = asyncio.ensure_future(
            client.post(f"/v1/conversations/{conv}/messages", json={"content": "a"}, headers=users.auth("ann"))
        )
        reply = await streaming_reply(client, users, conv)
        second = await client.post(
            f"/v1/conversations/{conv}/messages", json={"content": "b"}, headers=users.auth("ann")
        )
        assert second.status_code == 409 and reply["id"] in second.json()["error"]["message"]
        await client.post(f"/v1/messages/{reply['id']}/stop", headers=users.auth("ann"))
        await posting
        assert len(upstream.requests) == 1, "the refused message never reached a replica"


async def test_regenerate_replaces_the_last_reply(demo_model_dir, db):
    upstream = SlowUpstream(count=3)
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, _, users):
        conv = await new_conversation(client, users)
        first = parse_sse(
            (
                await client.post(
                    f"/v1/conversations/{conv}/messages", json={"content": "one"}, headers=users.auth("ann")
                )
            ).text
        )[0][1]["messageId"]
        last = parse_sse(
            (
                await client.post(
                    f"/v1/conversations/{conv}/messages", json={"content": "two"}, headers=users.auth("ann")
                )
            ).text
        )[0][1]["messageId"]
        upstream.count = 5
        response = await client.post(
            f"/v1/messages/{last}/regenerate", json={"temperature": 0.5}, headers=users.auth("ann")
        )
        events = parse_sse(response.text)
        assert events[0][1]["messageId"] == last and "userMessageId" not in events[0][1]
        assert events[-1][1]["status"] == "complete" and reply_text(events) == "w0 w1 w2 w3 w4 "
        kind, body = upstream.requests[-1]
        assert kind == "chat" and body["temperature"] == 0.5
        assert body["messages"] == [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "w0 w1 w2 "},
            {"role": "user", "content": "two"},
        ], "the old reply is not in the prompt"
        history = (await client.get(f"/v1/conversations/{conv}/messages", headers=users.auth("ann"))).json()["data"]
        assert len(history) == 4 and history[0]["id"] == last and history[0]["content"] == "w0 w1 w2 w3 w4 "
        refused = await client.post(f"/v1/messages/{first}/regenerate", headers=users.auth("ann"))
        assert refused.status_code == 409 and "last reply" in refused.json()["error"]["message"]


async def test_continue_extends_a_reply_cut_off_at_max_tokens(demo_model_dir, db):
    upstream = SlowUpstream(count=3, finish="length")
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, _, users):
        conv = await new_conversation(client, users, system_prompt="S")
        reply = parse_sse(
            (
                await client.post(
                    f"/v1/conversations/{conv}/messages", json={"content": "story"}, headers=users.auth("ann")
                )
            ).text
        )[0][1]["messageId"]
        upstream.finish = "stop"
        events = parse_sse((await client.post(f"/v1/messages/{reply}/continue", headers=users.auth("ann"))).text)
        assert reply_text(events) == "w0 w1 w2 ", "the stream carries only the new text"
        assert events[-1][1] == {
            "type": "done",
            "messageId": reply,
            "status": "complete",
            "finishReason": "stop",
            "usage": {"input": 7, "output": 3, "cached": 0},
        }
        saved = (await client.get(f"/v1/messages/{reply}", headers=users.auth("ann"))).json()
        assert saved["content"] == "w0 w1 w2 w0 w1 w2 " and saved["tokens"] == 6
        kind, body = upstream.requests[-1]
        tokenizer = Tokenizer.from_dir(demo_model_dir)
        head = tokenizer.encode_chat(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "story"}], add_generation_prompt=True
        )
        assert kind == "text" and body["prompt"][: len(head)] == head
        assert tokenizer.decode(body["prompt"][len(head) :]) == "w0 w1 w2 "
        refused = await client.post(f"/v1/messages/{reply}/continue", headers=users.auth("ann"))
        assert refused.status_code == 409 and "only a stopped reply" in refused.json()["error"]["message"]


async def test_a_replica_failing_mid_reply_leaves_it_failed_and_regenerate_recovers(demo_model_dir, db):
    class Breaking(SlowUpstream):
        async def stream(self, kind, body):
            async for chunk in super().stream(kind, body):
                yield chunk
                if self.count == 4 and chunk["choices"] and "w1" in str(chunk):
                    raise ConnectionResetError("replica died")

    upstream = Breaking(count=4)  # the only replica: the router has nowhere to retry
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, _, users):
        conv = await new_conversation(client, users)
        events = parse_sse(
            (
                await client.post(
                    f"/v1/conversations/{conv}/messages", json={"content": "hi"}, headers=users.auth("ann")
                )
            ).text
        )
        done = events[-1][1]
        assert done["status"] == "failed" and done["error"], events
        saved = (await client.get(f"/v1/messages/{done['messageId']}", headers=users.auth("ann"))).json()
        assert saved["status"] == "failed" and saved["error"]
        upstream.count = 2
        again = parse_sse(
            (await client.post(f"/v1/messages/{done['messageId']}/regenerate", headers=users.auth("ann"))).text
        )
        assert again[-1][1]["status"] == "complete" and reply_text(again) == "w0 w1 "


async def test_another_users_ids_are_404_everywhere(demo_model_dir, db):
    async with conversations_app(demo_model_dir, db, [SlowUpstream(count=2)]) as (client, _, users):
        conv = await new_conversation(client, users)
        start = parse_sse(
            (
                await client.post(
                    f"/v1/conversations/{conv}/messages", json={"content": "private"}, headers=users.auth("ann")
                )
            ).text
        )[0][1]
        reply = start["messageId"]
        for who in ("bob", "eve"):  # same organisation, and another one
            for method, path, body in (
                ("GET", f"/v1/conversations/{conv}", None),
                ("PATCH", f"/v1/conversations/{conv}", {"title": "x"}),
                ("DELETE", f"/v1/conversations/{conv}", None),
                ("GET", f"/v1/conversations/{conv}/messages", None),
                ("POST", f"/v1/conversations/{conv}/messages", {"content": "let me in"}),
                ("GET", f"/v1/messages/{reply}", None),
                ("POST", f"/v1/messages/{reply}/stop", None),
                ("POST", f"/v1/messages/{reply}/regenerate", None),
                ("POST", f"/v1/messages/{reply}/continue", None),
            ):
                response = await client.request(method, path, json=body, headers=users.auth(who))
                assert response.status_code == 404, (who, method, path, response.text)
                assert set(response.json()["error"]) == ERROR_SHAPE
            assert (await client.get("/v1/conversations", headers=users.auth(who))).json()["data"] == []
        mine = (await client.get("/v1/conversations", headers=users.auth("ann"))).json()["data"]
        assert [c["id"] for c in mine] == [conv] and mine[0]["title"] == "private"
        assert (
            len((await client.get(f"/v1/conversations/{conv}/messages", headers=users.auth("ann"))).json()["data"]) == 2
        ), "nothing was changed by the strangers"


async def test_unknown_ids_are_404(demo_model_dir, db):
    async with conversations_app(demo_model_dir, db, [SlowUpstream()]) as (client, _, users):
        for method, path in (
            ("GET", "/v1/conversations/conv_nope"),
            ("DELETE", "/v1/conversations/conv_nope"),
            ("GET", "/v1/conversations/conv_nope/messages"),
            ("POST", "/v1/conversations/conv_nope/messages"),
            ("GET", "/v1/messages/msg_nope"),
            ("POST", "/v1/messages/msg_nope/stop"),
            ("POST", "/v1/messages/msg_nope/regenerate"),
            ("POST", "/v1/messages/msg_nope/continue"),
        ):
            body = {"content": "hi"} if path.endswith("/messages") and method == "POST" else None
            response = await client.request(method, path, json=body, headers=users.auth("ann"))
            assert response.status_code == 404, (path, response.text)
            assert set(response.json()["error"]) == ERROR_SHAPE and "nope" in response.json()["error"]["message"]
        bare = await client.post("/v1/conversations", headers=users.auth("ann"))  # no body: every field is optional
        assert bare.status_code == 201 and bare.json()["model"] == "tiny"
        unknown_model = await client.post("/v1/conversations", json={"model": "gpt-9"}, headers=users.auth("ann"))
        assert unknown_model.status_code == 404 and unknown_model.json()["error"]["code"] == "model_not_found"


async def test_bad_input_is_a_4xx_in_the_openai_shape(demo_model_dir, db):
    upstream = SlowUpstream()
    async with conversations_app(demo_model_dir, db, [upstream], max_message_chars=1000) as (client, _, users):
        conv = await new_conversation(client, users)
        send = f"/v1/conversations/{conv}/messages"
        cases = [
            (send, {"content": "x" * 1001}, 413, "content"),
            (send, {"content": "   "}, 400, "content"),
            (send, {}, 400, "content"),
            (send, {"content": 5}, 400, "content"),
            (send, {"content": "hi", "colour": "red"}, 400, "colour"),
            (send, {"content": "hi", "temperature": 7}, 400, "temperature"),
            (send, {"content": "hi", "max_tokens": 0}, 400, "max_tokens"),
            (send, {"content": "word " * 190, "max_tokens": 400}, 400, "content"),  # past the 512-token window
            ("/v1/conversations", {"system_prompt": "s" * 1001}, 413, "system_prompt"),
            ("/v1/conversations", {"title": "t" * 201}, 400, "title"),
            ("/v1/conversations", {"tools": []}, 400, "tools"),
        ]
        for path, body, status, param in cases:
            response = await client.post(path, json=body, headers=users.auth("ann"))
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == ERROR_SHAPE and error["param"] == param, (body, error)
        for path, raw, param in (
            (send, '{"content": "a\\u0000b"}', "content"),
            (send, '{"content": "a\\ud800b"}', "content"),
            ("/v1/conversations", '{"title": "\\u0000"}', "title"),
            ("/v1/conversations", '{"system_prompt": "\\udfff"}', "system_prompt"),
        ):
            response = await client.post(
                path, content=raw, headers={**users.auth("ann"), "content-type": "application/json"}
            )
            assert response.status_code == 400 and response.json()["error"]["param"] == param, raw
        for path in (
            "/v1/conversations/a%00b",
            f"/v1/conversations/{'c' * 300}/messages",
            "/v1/messages/m%00",
            "/v1/messages/%E2%82%AC",
        ):
            response = await client.get(path, headers=users.auth("ann"))
            assert response.status_code == 404 and set(response.json()["error"]) == ERROR_SHAPE, path
        for query in (
            {"limit": "0"},
            {"limit": "many"},
            {"limit": "\u00b2"},
            {"cursor": "garbage"},
            {"cursor": "WyJtZCIsIDEwMDAwMDAwMDAwMDAwMDAwMDAwMDAw"},
            {"order": "sideways"},
        ):
            response = await client.get(f"/v1/conversations/{conv}/messages", params=query, headers=users.auth("ann"))
            assert response.status_code == 400 and set(response.json()["error"]) == ERROR_SHAPE, query
        assert (
            await client.get("/v1/conversations", params={"cursor": "x"}, headers=users.auth("ann"))
        ).status_code == 400
        assert upstream.requests == [] and (await client.get(send, headers=users.auth("ann"))).json()["data"] == []
        assert (await client.get(f"/v1/conversations/{conv}", headers=users.auth("ann"))).json()["title"] is None


async def test_no_key_no_conversations(demo_model_dir, db):
    async with conversations_app(demo_model_dir, db, [SlowUpstream()]) as (client, _, _users):
        for method, path in (
            ("GET", "/v1/conversations"),
            ("POST", "/v1/conversations"),
            ("POST", "/v1/messages/msg_x/stop"),
        ):
            assert (await client.request(method, path, json={})).status_code == 401


async def test_deleting_a_conversation_stops_its_reply(demo_model_dir, db):
    upstream = SlowUpstream(count=400, delay=0.02)
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, _, users):
        conv = await new_conversation(client, users)
        posting = asyncio.ensure_future(
            client.post(f"/v1/conversations/{conv}/messages", json={"content": "a"}, headers=users.auth("ann"))
        )
        await streaming_reply(client, users, conv)
        deleted = await client.delete(f"/v1/conversations/{conv}", headers=users.auth("ann"))
        assert deleted.json() == {"id": conv, "object": "conversation.deleted", "deleted": True}
        events = parse_sse((await asyncio.wait_for(posting, 10)).text)
        assert events[-1][0] == "done" and upstream.running == 0
        assert (await client.get(f"/v1/conversations/{conv}", headers=users.auth("ann"))).status_code == 404


async def test_a_shutdown_saves_replies_still_streaming_as_failed(demo_model_dir, db):
    upstream = SlowUpstream(count=400, delay=0.02)
    async with conversations_app(demo_model_dir, db, [upstream]) as (client, service, users):
        conv = await new_conversation(client, users)
        posting = asyncio.ensure_future(
            client.post(f"/v1/conversations/{conv}/messages", json={"content": "a"}, headers=users.auth("ann"))
        )
        reply = await streaming_reply(client, users, conv)
        await asyncio.sleep(0.2)
        await service.close()
        saved = (await client.get(f"/v1/messages/{reply['id']}", headers=users.auth("ann"))).json()
        assert saved["status"] == "failed" and "regenerate" in saved["error"] and saved["content"].startswith("w0")
        assert parse_sse((await posting).text)[-1][1]["status"] == "failed" and upstream.running == 0


async def test_cursors_page_through_the_api_both_ways(demo_model_dir, db):
    async with conversations_app(demo_model_dir, db, [SlowUpstream(count=1)]) as (client, _, users):
        conv = await new_conversation(client, users)
        for i in range(11):
            await client.post(
                f"/v1/conversations/{conv}/messages", json={"content": f"m{i}"}, headers=users.auth("ann")
            )
        for order in ("asc", "desc"):
            seen, params = [], {"limit": "5", "order": order}
            while True:
                page = (
                    await client.get(f"/v1/conversations/{conv}/messages", params=params, headers=users.auth("ann"))
                ).json()
                seen += [m["content"] for m in page["data"]]
                assert page["has_more"] == (page["next_cursor"] is not None)
                if not page["has_more"]:
                    break
                params["cursor"] = page["next_cursor"]
            oldest_first = [text for i in range(11) for text in (f"m{i}", "w0 ")]
            assert seen == (oldest_first if order == "asc" else oldest_first[::-1])
