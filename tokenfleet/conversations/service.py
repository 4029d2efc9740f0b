"""Running replies: build the prompt from the history, generate through the gateway (so quotas, fair queuing,
routing with conversation affinity, cancellation and metering all apply), save the reply about every second
while it streams, and end it complete, stopped or failed.

The gateway admits the request before any row is written, so a refused request (429, 503, a prompt too long)
leaves the conversation as it was."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from tokenfleet.api.errors import not_found
from tokenfleet.conversations.prompt import Prompt, fit
from tokenfleet.conversations.records import STOPPED, STREAMING, Conflict, Conversation, Message
from tokenfleet.conversations.run import Run
from tokenfleet.conversations.settings import ConversationSettings
from tokenfleet.conversations.store import ConversationStore, check_reopenable
from tokenfleet.gateway.auth import Caller
from tokenfleet.gateway.gateway import Gateway, ModelInfo
from tokenfleet.gateway.relay import Relay
from tokenfleet.store.records import Owner

log = logging.getLogger(__name__)
END_GRACE_S = 5.0  # after its relay ends, how long a reply waits for the buffer's last events
SAVE_ATTEMPTS = 3


@dataclass
class ReplyOptions:
    model: str | None = None  # else the conversation's
    max_tokens: int | None = None  # else settings.max_tokens, at most a quarter of the model's window
    sampling: dict = field(default_factory=dict)  # temperature, top_p, seed, ignore_eos, ... as the chat API


def owner_of(caller: Caller) -> Owner:
    return Owner(caller.principal.org_id, caller.principal.user_id)


def _fitted(
    info: ModelInfo, max_tokens: int, conv: Conversation, history: list[dict], tail: list[dict], prefix: str = ""
) -> Prompt:
    """The conversation's system prompt, as much history as the model's window leaves room for, then the tail."""
    return fit(info.tokenizer, info.max_model_len, max_tokens, conv.system_prompt, history, tail, prefix=prefix)


def as_prompt(messages: list[Message]) -> list[dict]:
    """What the model sees of earlier messages: replies with text that are not still streaming."""
    return [
        {"role": m.role, "content": m.content}
        for m in messages
        if m.role == "user" or (m.content and m.status != STREAMING)
    ]


class ConversationService:
    def __init__(self, gateway: Gateway, store: ConversationStore, settings: ConversationSettings) -> None:
        self.gateway, self.store, self.settings = gateway, store, settings
        self.runs: dict[str, Run] = {}  # message id -> its reply generating in this gateway
        self._tasks: set[asyncio.Task] = set()

    # --- models -----------------------------------------------------------------------------------------------

    def model_info(self, name: str) -> ModelInfo:
        """The tokenizer and window of a model, alias or routing alias (its first rule's model)."""
        catalog = self.gateway.router.catalog
        rules = catalog.router_aliases.get(name)
        spec = catalog.lookup(rules[0].model if rules else name)
        if spec is None:
            raise not_found(f"The model `{name}` does not exist", param="model", code="model_not_found")
        return self.gateway.models[spec.name]

    def default_model(self) -> str:
        return self.settings.default_model or next(iter(self.gateway.router.catalog.models))

    def _generation(self, options: ReplyOptions, conv: Conversation) -> tuple[str, ModelInfo, int]:
        """The reply's model (the request's, else the conversation's), its tokenizer and window, and max_tokens: a
        default that leaves room for history, at most a quarter of the window."""
        model = options.model or conv.model
        info = self.model_info(model)
        return model, info, options.max_tokens or max(1, min(self.settings.max_tokens, info.max_model_len // 4))

    # --- starting replies -------------------------------------------------------------------------------------

    async def send(
        self, caller: Caller, conversation_id: str, content: str, options: ReplyOptions
    ) -> tuple[Message, Run]:
        """Adds the user's message and starts the reply; returns the message and the running reply."""
        owner = owner_of(caller)
        conv = await self.store.get(owner, conversation_id)
        history = await self.store.history(owner, conversation_id)
        busy = next((m for m in history if m.status == STREAMING), None)
        if busy is not None:
            raise Conflict(
                f"a reply is still streaming in this conversation (message {busy.id}); wait for it or stop it first"
            )
        model, info, max_tokens = self._generation(options, conv)
        prompt = _fitted(info, max_tokens, conv, as_prompt(history), [{"role": "user", "content": content}])
        relay = await self._admit(caller, conversation_id, model, prompt, max_tokens, options, continuing=False)
        try:
            tokens = len(info.tokenizer.encode(content, add_special_tokens=False))
            user, reply = await self.store.add_turn(
                owner, conversation_id, content, tokens, relay.request_id, relay.route.model
            )
        except BaseException:
            relay.cancel("api")
            raise
        return user, self._start(relay, reply, user_message_id=user.id)

    async def redo(self, caller: Caller, message_id: str, continuing: bool, options: ReplyOptions) -> Run:
        """Regenerates the conversation's last reply, or continues it (a stopped one, or one cut off at
        max_tokens) after its text."""
        owner = owner_of(caller)
        msg = await self.store.message(owner, message_id)
        conv = await self.store.get(owner, msg.conversation_id)
        history = await self.store.history(owner, conv.id)
        check_reopenable(msg, history[-1].seq, continuing)
        earlier = [m for m in history if m.seq < msg.seq]
        tail = earlier[-1:] if earlier and earlier[-1].role == "user" else []  # the message it answers
        model, info, max_tokens = self._generation(options, conv)
        history, prefix = as_prompt(earlier[: len(earlier) - len(tail)]), msg.content if continuing else ""
        prompt = _fitted(info, max_tokens, conv, history, as_prompt(tail), prefix)
        relay = await self._admit(caller, conv.id, model, prompt, max_tokens, options, continuing)
        try:
            reply = await self.store.reopen(owner, message_id, relay.request_id, relay.route.model, continuing)
        except BaseException:
            relay.cancel("api")
            raise
        if continuing:
            return self._start(relay, reply, reply.content, reply.tokens)
        return self._start(relay, reply)

    async def _admit(
        self,
        caller: Caller,
        conversation_id: str,
        model: str,
        prompt: Prompt,
        max_tokens: int,
        options: ReplyOptions,
        continuing: bool,
    ) -> Relay:
        """Through the gateway: a chat request, or for continue a text completion of the prompt's tokens (the
        generation prompt, then the reply's text so far, so the model goes on from there)."""
        body = {
            **options.sampling,
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if continuing:
            body["prompt"] = prompt.token_ids
        else:
            body["messages"] = prompt.messages
        return await self.gateway.admit(
            "text" if continuing else "chat", body, caller, native=True, affinity=conversation_id
        )

    def _start(
        self, relay: Relay, reply: Message, prefix: str = "", prior_tokens: int = 0, user_message_id: str | None = None
    ) -> Run:
        run = Run(reply.id, reply.conversation_id, relay, prefix, prior_tokens)
        run.started(user_message_id)
        self.runs[reply.id] = run
        task = asyncio.create_task(self._follow(run), name=f"reply-{reply.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return run

    # --- following a reply ------------------------------------------------------------------------------------

    async def _follow(self, run: Run) -> None:
        saver = asyncio.create_task(self._keep_saving(run))
        try:
            await self._read(run)
        except Exception as e:  # the resume buffer failed under us: the reply cannot be followed, so stop it
            log.exception("following reply %s (request %s) failed", run.message_id, run.request_id)
            run.error = run.error or f"the reply could not be followed: {e}"
            run.relay.cancel("failed")
        finally:
            saver.cancel()
            await asyncio.gather(saver, return_exceptions=True)
            await self._end(run)

    async def _read(self, run: Run) -> None:
        """The relay's events until its stream closes; never longer than END_GRACE_S after the relay ended."""

        async def read() -> None:
            async for event in self.gateway.buffer.read(run.request_id, 0):
                run.apply(event)

        reading = asyncio.ensure_future(read())
        finished = asyncio.ensure_future(run.relay.finished.wait())
        try:
            await asyncio.wait({reading, finished}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                await asyncio.wait({reading}, timeout=END_GRACE_S)
            if not reading.done():
                log.warning("reply %s: the stream of %s never closed", run.message_id, run.request_id)
                return
            reading.result()
        finally:
            reading.cancel()
            finished.cancel()

    async def _keep_saving(self, run: Run) -> None:
        """Saves the text so far every save_interval_s (also when nothing changed: the save is the heartbeat that
        tells a live reply from one whose gateway died). If the reply was ended elsewhere, stops generating."""
        while True:
            await asyncio.sleep(self.settings.save_interval_s)
            try:
                mine = await self.store.save_progress(
                    run.message_id, run.request_id, run.content, run.prior_tokens + run.usage()[1]
                )
            except Exception as e:  # a slow or failing database must not stop the reply; the final save retries
                log.warning("could not save reply %s: %r", run.message_id, e)
                continue
            if not mine:
                run.relay.cancel("api")
                return

    async def _end(self, run: Run) -> None:
        outcome, saved = run.outcome(), None
        for attempt in range(SAVE_ATTEMPTS):
            try:
                saved = await self.store.finish(run.message_id, run.request_id, outcome)
                break
            except Exception as e:  # left 'streaming', the row turns failed once stale
                log.warning("could not save the end of reply %s (attempt %d): %r", run.message_id, attempt + 1, e)
                await asyncio.sleep(0.5 * (attempt + 1))
        self.runs.pop(run.message_id, None)
        run.end(outcome, saved)

    # --- stopping, deleting, shutting down ----------------------------------------------------------------------

    async def stop(self, caller: Caller, message_id: str) -> Message:
        """Stops a streaming reply: at once when it runs here (its text so far is saved), else through the
        database, where the gateway running it sees the stop at its next save."""
        owner = owner_of(caller)
        found = await self.store.message(owner, message_id)  # 404 for anyone else's
        run = self.runs.get(message_id)
        if run is None or run.done.is_set():
            return await self.store.stop(owner, message_id)
        run.relay.cancel("api")
        await run.done.wait()
        after = run.result or await self.store.message(owner, found.id)
        if after.status != STOPPED:
            raise Conflict(f"message {message_id} ended ({after.status}) before it could be stopped")
        return after

    async def delete(self, caller: Caller, conversation_id: str) -> None:
        for message_id in await self.store.delete(owner_of(caller), conversation_id):
            run = self.runs.get(message_id)
            if run is not None:
                run.relay.cancel("api")

    async def close(self, timeout_s: float = 10.0) -> None:
        """At shutdown: replies still generating end as failed (regenerate offered), saved before the database
        closes."""
        runs = list(self.runs.values())
        for run in runs:
            run.relay.cancel("shutdown")
        if runs:
            await asyncio.wait([asyncio.ensure_future(run.done.wait()) for run in runs], timeout=timeout_s)

    async def sweep_stale(self) -> None:
        """Runs while the gateway serves: replies a dead gateway left 'streaming' become failed."""
        while True:
            try:
                failed = await self.store.fail_stale()
                if failed:
                    log.info("marked %d reply(ies) failed: their gateway stopped while generating", failed)
            except Exception as e:
                log.warning("could not check for stale replies: %r", e)
            await asyncio.sleep(self.settings.stale_after_s / 2)
