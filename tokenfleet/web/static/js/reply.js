// One reply as it streams. It reads the reply's events (start, token, retrying, error, done); if the connection
// drops before `done`, it reconnects to GET /v1/messages/{id}/stream with the last event id it saw, so the text
// goes on with nothing lost or repeated. When the reply is no longer generating on this gateway (it ended
// meanwhile, or runs on another gateway of the fleet), the saved message is read until it is settled.
import { ApiError, NetworkError } from "./api.js";
import { sseEvents } from "./sse.js";
import { sleep } from "./dom.js";

const SAVED_POLL_MS = 1000;
const MAX_BACKOFF_MS = 4000;

function waitForOnline(timeoutMs) {
  if (navigator.onLine) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      window.removeEventListener("online", done);
      clearTimeout(timer);
      resolve();
    };
    const timer = setTimeout(done, timeoutMs);
    window.addEventListener("online", done);
  });
}

export class ReplyStream {
  // handlers: onStart({messageId, userMessageId, requestId}), onToken(text), onRetrying(), onError(text),
  // onDone(data), onReplay(prefixLength) (a follow from the start: the text is the prefix plus what follows),
  // onSaved(message) (the saved message, when the stream could not be followed to its end),
  // onConnection("reconnecting" | "connected")
  constructor(api, handlers) {
    this.api = api;
    this.handlers = handlers;
    this.lastEventId = 0;
    this.messageId = null;
    this.finished = false;
    this.closed = false;
    this.controller = new AbortController();
  }

  // open(): the request that starts the reply (a refusal such as a 429 is thrown from here, before any event)
  async start(open) {
    const response = await open(this.controller.signal);
    await this._follow(response);
  }

  // follows a reply already generating (after a page reload): all its events, from the first
  async resume(messageId) {
    this.messageId = messageId;
    const response = await this._reconnect();
    if (response) await this._follow(response);
  }

  // stops reading (the page moves to another conversation); the reply itself goes on
  close() {
    this.closed = true;
    this.controller.abort();
  }

  async _follow(response) {
    for (;;) {
      try {
        await this._read(response);
      } catch (error) {
        if (this.closed) return;
        if (!(error instanceof TypeError || error instanceof NetworkError || (error && error.name === "AbortError"))) {
          throw error;
        }
      }
      if (this.finished || this.closed) return;
      if (!this.messageId) throw new NetworkError("the connection dropped before the reply started");
      this.handlers.onConnection?.("reconnecting");
      response = await this._reconnect();
      if (!response) return;
      this.handlers.onConnection?.("connected");
    }
  }

  async _read(response) {
    if (this.lastEventId === 0) {
      const prefix = response.headers.get("x-reply-prefix-length");
      if (prefix !== null && /^[0-9]+$/.test(prefix)) this.handlers.onReplay?.(Number(prefix));
    }
    for await (const event of sseEvents(response, { signal: this.controller.signal })) {
      const data = JSON.parse(event.data);
      this._apply(data);
      if (event.id && /^[0-9]+$/.test(event.id)) this.lastEventId = Number(event.id);
      if (this.finished) return;
    }
  }

  _apply(data) {
    const h = this.handlers;
    if (data.type === "start") {
      this.messageId = data.messageId;
      h.onStart?.(data);
    } else if (data.type === "token") {
      h.onToken?.(data.text);
    } else if (data.type === "retrying") {
      h.onRetrying?.(data);
    } else if (data.type === "error") {
      h.onError?.((data.error && data.error.message) || "generation failed");
    } else if (data.type === "done") {
      this.finished = true;
      h.onDone?.(data);
    }
  }

  // a stream of the reply from after the last event seen, or null once it was settled from the saved message
  async _reconnect() {
    let delay = 250;
    for (;;) {
      if (this.closed) return null;
      await waitForOnline(5000);
      try {
        return await this.api.request("GET", `/v1/messages/${encodeURIComponent(this.messageId)}/stream`, {
          headers: { "last-event-id": String(this.lastEventId) },
          signal: this.controller.signal,
        });
      } catch (error) {
        if (this.closed) return null;
        if (error instanceof ApiError && error.status === 409) {
          await this._settleFromSaved();
          return null;
        }
        if (error instanceof ApiError && error.status < 500) throw error;
      }
      await sleep(delay);
      delay = Math.min(delay * 2, MAX_BACKOFF_MS);
    }
  }

  async _settleFromSaved() {
    for (;;) {
      if (this.closed) return;
      let message = null;
      try {
        message = await this.api.get(`/v1/messages/${encodeURIComponent(this.messageId)}`);
      } catch (error) {
        if (!(error instanceof NetworkError)) throw error;
      }
      if (message) {
        this.handlers.onSaved?.(message);
        if (message.status !== "streaming") {
          this.finished = true;
          return;
        }
      }
      await sleep(SAVED_POLL_MS);
    }
  }
}
