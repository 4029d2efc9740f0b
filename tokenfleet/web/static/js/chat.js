// The chat page: sign in (when the gateway has keys), conversations (new, rename, delete), a model picker, an
// optional system prompt, and replies streamed through the conversations API with Stop, Regenerate and Continue.
// A reload mid-reply shows the text so far and follows the rest; a dropped connection resumes (reply.js).
import { Api, ApiError } from "./api.js";
import { byId, el, formatNumber, formatSeconds, show, showSignInPanel } from "./dom.js";
import { explain, explainReplyError } from "./errors.js";
import { ReplyStream } from "./reply.js";

const KEY_STORAGE = "tokenfleet.apiKey";
const SETTINGS_STORAGE = "tokenfleet.chatSettings";
const PAGE_SIZE = 50;
const REVALIDATE_MS = 30000;

const state = {
  key: localStorage.getItem(KEY_STORAGE),
  authRequired: true,
  models: [],
  conversations: [],
  current: null, // the conversation shown; null: a new chat, created by its first message
  views: [], // MessageView per shown message, oldest first
  nextCursor: null, // older messages not shown yet
  reply: null, // {stream, view} while a reply streams
  countdown: null, // the timer of a refused message waiting to be sent again
};

const api = new Api({
  key: () => state.key,
  onUnauthorized: () => signOut("Your API key was not accepted: it may have been revoked. Sign in again."),
});

// --- messages ------------------------------------------------------------------------------------------------

// first `count` characters of `text`, counted as the server counts them (code points, not UTF-16 units)
function leadingCodePoints(text, count) {
  return Array.from(text).slice(0, count).join("");
}

class MessageView {
  constructor(message) {
    this.message = { ...message };
    this.textNode = document.createTextNode("");
    this.note = el("p", { class: "note", hidden: true });
    this.stats = el("p", { class: "stats" });
    this.actions = el("div", { class: "actions" });
    this.node = el(
      "li",
      { class: `message ${message.role}` },
      el("div", { class: "role", text: message.role === "user" ? "You" : "Assistant" }),
      el("div", { class: "text" }, this.textNode),
      this.note,
      this.stats,
      this.actions,
    );
    this.ttftMs = null;
    this.setText(message.content || "");
    this.render();
  }

  get id() {
    return this.message.id || null;
  }

  get content() {
    return this.textNode.data;
  }

  setText(text) {
    this.textNode.data = text;
  }

  append(text) {
    this.textNode.appendData(text);
  }

  setId(id) {
    this.message.id = id;
    this.render();
  }

  showNote(text) {
    this.note.textContent = text;
    show(this.note, Boolean(text));
  }

  // the stream's `done` event (tokens: those before this generation plus its own)
  finish(done, priorTokens) {
    Object.assign(this.message, {
      status: done.status,
      finish_reason: done.finishReason,
      tokens: priorTokens + ((done.usage && done.usage.output) || 0),
      error: done.error || null,
    });
    this.render();
  }

  // the message as saved (its text too when `withText`)
  update(saved, withText = false) {
    Object.assign(this.message, saved);
    if (withText) this.setText(saved.content || "");
    this.render();
  }

  render() {
    const m = this.message;
    this.node.dataset.id = m.id || "";
    this.node.dataset.status = m.status || "";
    this.node.classList.toggle("streaming", m.status === "streaming");
    if (m.role !== "assistant") return;
    if (m.status === "failed") this.showNote(explainReplyError(m.error));
    else if (m.status === "stopped") this.showNote("Stopped.");
    else if (m.status === "complete" && m.finish_reason === "length") this.showNote("Cut off at the token limit.");
    else if (m.status !== "streaming") this.showNote("");
    const parts = [];
    if (m.status !== "streaming" || m.tokens) parts.push(`${formatNumber(m.tokens || 0)} tokens`);
    if (this.ttftMs !== null) parts.push(`first token ${formatSeconds(this.ttftMs / 1000)}`);
    this.stats.textContent = parts.join(" · ");
  }

  setActions(buttons) {
    this.actions.replaceChildren(...buttons);
  }
}

function messageList() {
  return byId("messages");
}

function addView(message, { atTop = false } = {}) {
  const view = new MessageView(message);
  if (atTop) {
    state.views.unshift(view);
    messageList().prepend(view.node);
  } else {
    state.views.push(view);
    messageList().append(view.node);
    view.node.scrollIntoView({ block: "end" });
  }
  return view;
}

function removeView(view) {
  state.views = state.views.filter((v) => v !== view);
  view.node.remove();
}

// Regenerate and Continue on the last reply only (the API reopens nothing else), never while one streams
function refreshActions() {
  const busy = state.reply !== null;
  for (const view of state.views) view.setActions([]);
  const last = state.views[state.views.length - 1];
  if (!last || last.message.role !== "assistant" || !last.id || busy) return;
  const buttons = [el("button", { type: "button", class: "secondary", text: "Regenerate", onclick: () => regenerate(last) })];
  const m = last.message;
  if (m.status === "stopped" || (m.status === "complete" && m.finish_reason === "length")) {
    buttons.push(el("button", { type: "button", class: "secondary", text: "Continue", onclick: () => continueReply(last) }));
  }
  last.setActions(buttons);
}

// Send and Stop as the current reply allows (Stop needs the reply's id, which its first event brings)
function updateControls() {
  const busy = state.reply !== null;
  show(byId("stop"), busy);
  byId("stop").disabled = !(busy && state.reply.view.id);
  byId("send").disabled = busy;
  refreshActions();
}

// --- replies -------------------------------------------------------------------------------------------------

function replyOptions() {
  const options = {};
  const model = byId("model").value;
  if (model) options.model = model;
  const maxTokens = byId("max-tokens").value.trim();
  if (maxTokens) options.max_tokens = Number(maxTokens);
  const temperature = byId("temperature").value.trim();
  if (temperature) options.temperature = Number(temperature);
  if (byId("ignore-eos").checked) options.ignore_eos = true;
  return options;
}

// Streams one reply into `view`. begin(stream) starts it (a POST) or follows it (a reload); `base` is the saved text
// the stream's prefix length refers to. Returns whether the reply began; a refusal calls onRefused and shows why.
async function streamReply(view, begin, { base = "", priorTokens = 0, onStart, onRefused, retry, timed = true } = {}) {
  const started = performance.now();
  let firstTokenSeen = false;
  view.ttftMs = null;
  view.update({ status: "streaming" });
  const stream = new ReplyStream(api, {
    onStart: (data) => {
      view.setId(data.messageId);
      onStart?.(data);
      updateControls();
    },
    onReplay: (prefixLength) => view.setText(leadingCodePoints(base, prefixLength)),
    onToken: (text) => {
      if (!firstTokenSeen) {
        firstTokenSeen = true;
        if (timed) view.ttftMs = performance.now() - started;
        view.render();
      }
      view.append(text);
    },
    onRetrying: () => view.showNote("A model server failed; another one is going on with the reply."),
    onError: (text) => view.showNote(explainReplyError(text)),
    onDone: (done) => view.finish(done, priorTokens),
    onSaved: (saved) => view.update(saved, true),
    onConnection: (how) => {
      view.node.classList.toggle("reconnecting", how === "reconnecting");
      view.showNote(how === "reconnecting" ? "Connection lost; reconnecting…" : "");
    },
  });
  state.reply = { stream, view };
  updateControls();
  let began = true;
  try {
    await begin(stream);
  } catch (error) {
    began = Boolean(stream.messageId);
    if (began) {
      view.showNote(explain(error));
    } else {
      onRefused?.();
      showError(error, retry);
    }
  } finally {
    if (state.reply && state.reply.stream === stream) state.reply = null;
    view.node.classList.remove("reconnecting");
    updateControls();
  }
  if (began && view.id && !stream.closed) await syncSaved(view);
  refreshConversations();
  return began;
}

// the saved message's status and token count (its text stays as streamed)
async function syncSaved(view) {
  try {
    const saved = await api.get(`/v1/messages/${encodeURIComponent(view.id)}`);
    const { content, ...rest } = saved;
    view.update(rest);
    if (content !== view.content && saved.status !== "streaming") view.node.dataset.savedDiffers = "true";
  } catch {
    // the next load shows it
  }
  refreshActions();
}

async function send(content) {
  cancelCountdown();
  hideBanner();
  let conversation = state.current;
  if (!conversation) {
    try {
      conversation = await createConversation();
    } catch (error) {
      showError(error);
      return;
    }
  }
  const body = { ...replyOptions(), content };
  const user = addView({ role: "user", content, status: "complete" });
  const reply = addView({ role: "assistant", content: "", status: "streaming", tokens: 0 });
  byId("message").value = "";
  await streamReply(
    reply,
    (stream) =>
      stream.start((signal) =>
        api.request("POST", `/v1/conversations/${encodeURIComponent(conversation.id)}/messages`, { body, signal }),
      ),
    {
      onStart: (data) => user.setId(data.userMessageId),
      onRefused: () => {
        removeView(reply);
        removeView(user);
        if (!byId("message").value) byId("message").value = content;
      },
      retry: () => send(content),
    },
  );
}

async function regenerate(view) {
  cancelCountdown();
  hideBanner();
  const before = { ...view.message, content: view.content };
  view.setText("");
  await streamReply(
    view,
    (stream) =>
      stream.start((signal) =>
        api.request("POST", `/v1/messages/${encodeURIComponent(view.id)}/regenerate`, { body: replyOptions(), signal }),
      ),
    { onRefused: () => view.update(before, true), retry: () => regenerate(view) },
  );
}

async function continueReply(view) {
  cancelCountdown();
  hideBanner();
  const before = { ...view.message, content: view.content };
  await streamReply(
    view,
    (stream) =>
      stream.start((signal) =>
        api.request("POST", `/v1/messages/${encodeURIComponent(view.id)}/continue`, { body: replyOptions(), signal }),
      ),
    {
      base: before.content,
      priorTokens: before.tokens || 0,
      onRefused: () => view.update(before, true),
      retry: () => continueReply(view),
    },
  );
}

// a reply found streaming when the conversation opens (a reload, another tab): the text so far, then the rest
function followReply(view) {
  return streamReply(view, (stream) => stream.resume(view.id), { base: view.content, timed: false });
}

async function stopReply() {
  const reply = state.reply;
  if (!reply || !reply.view.id) return;
  byId("stop").disabled = true;
  try {
    await api.json("POST", `/v1/messages/${encodeURIComponent(reply.view.id)}/stop`);
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 409)) showError(error); // 409: it had just ended
  }
}

function closeReply() {
  if (state.reply) state.reply.stream.close();
  state.reply = null;
}

// --- conversations -------------------------------------------------------------------------------------------

async function createConversation() {
  const body = {};
  const model = byId("model").value;
  if (model) body.model = model;
  const system = byId("system-prompt").value.trim();
  if (system) body.system_prompt = system;
  const conversation = await api.json("POST", "/v1/conversations", body);
  state.current = conversation;
  history.replaceState(null, "", `#c=${encodeURIComponent(conversation.id)}`);
  renderHead();
  return conversation;
}

async function refreshConversations() {
  try {
    const page = await api.get(`/v1/conversations?limit=100`);
    state.conversations = page.data;
    const current = state.current && page.data.find((c) => c.id === state.current.id);
    if (current) {
      state.current = current;
      byId("conversation-title").textContent = titleOf(current);
    }
    renderConversations();
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 401)) console.warn("conversations:", error);
  }
}

function titleOf(conversation) {
  return conversation.title || "New chat";
}

function renderConversations() {
  const list = byId("conversations");
  list.replaceChildren(...state.conversations.map(conversationItem));
  show(byId("no-conversations"), state.conversations.length === 0);
}

function conversationItem(conversation) {
  const current = state.current && state.current.id === conversation.id;
  const title = titleOf(conversation);
  const item = el("li", { class: current ? "current" : "", "data-id": conversation.id });
  const open = el("button", {
    type: "button",
    class: "conversation-title",
    "aria-current": current ? "page" : null,
    text: title,
    onclick: () => openConversation(conversation.id),
  });
  const rename = iconButton("Rename", title, "✎", () => startRename(item, conversation));
  const remove = iconButton("Delete", title, "✕", () => confirmDelete(item, conversation));
  item.append(open, rename, remove);
  return item;
}

function startRename(item, conversation) {
  const input = el("input", { type: "text", value: conversation.title || "", "aria-label": "New title", maxlength: 255 });
  const form = el("form", { class: "rename" }, input, el("button", { type: "submit", text: "Save" }));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const renamed = await api.json("PATCH", `/v1/conversations/${encodeURIComponent(conversation.id)}`, {
        title: input.value.trim() || null,
      });
      if (state.current && state.current.id === renamed.id) {
        state.current = renamed;
        renderHead();
      }
    } catch (error) {
      showError(error);
    }
    refreshConversations();
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Escape") renderConversations();
  });
  item.replaceChildren(form);
  input.focus();
  input.select();
}

function confirmDelete(item, conversation) {
  const yes = el("button", {
    type: "button",
    class: "danger",
    text: "Delete",
    onclick: async () => {
      try {
        await api.json("DELETE", `/v1/conversations/${encodeURIComponent(conversation.id)}`);
        if (state.current && state.current.id === conversation.id) newChat();
      } catch (error) {
        showError(error);
      }
      refreshConversations();
    },
  });
  const no = el("button", { type: "button", class: "secondary", text: "Keep", onclick: renderConversations });
  item.replaceChildren(el("span", { class: "confirm", text: `Delete “${titleOf(conversation)}”?` }), yes, no);
  no.focus();
}

function renderHead() {
  const conversation = state.current;
  byId("conversation-title").textContent = conversation ? titleOf(conversation) : "New chat";
  show(byId("new-chat-panel"), !conversation);
  const system = conversation && conversation.system_prompt;
  show(byId("system-prompt-view"), Boolean(system));
  byId("system-prompt-text").textContent = system || "";
  if (conversation && state.models.includes(conversation.model)) byId("model").value = conversation.model;
  renderConversations();
}

function newChat() {
  closeReply();
  cancelCountdown();
  hideBanner();
  state.current = null;
  state.views = [];
  state.nextCursor = null;
  messageList().replaceChildren();
  show(byId("load-earlier"), false);
  history.replaceState(null, "", location.pathname);
  renderHead();
  updateControls();
  byId("message").focus();
}

async function openConversation(id) {
  closeReply();
  cancelCountdown();
  hideBanner();
  let conversation;
  try {
    conversation = await api.get(`/v1/conversations/${encodeURIComponent(id)}`);
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) {
      newChat();
      return;
    }
    showError(error);
    return;
  }
  state.current = conversation;
  state.views = [];
  messageList().replaceChildren();
  history.replaceState(null, "", `#c=${encodeURIComponent(conversation.id)}`);
  renderHead();
  await loadMessages();
  updateControls();
  const last = state.views[state.views.length - 1];
  if (last && last.message.role === "assistant" && last.message.status === "streaming") await followReply(last);
}

// a page of messages, newest first from the API, shown oldest first above what is already shown
async function loadMessages(cursor = null) {
  const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if (cursor) query.set("cursor", cursor);
  const page = await api.get(`/v1/conversations/${encodeURIComponent(state.current.id)}/messages?${query}`);
  for (const message of page.data) addView(message, { atTop: true });
  state.nextCursor = page.next_cursor;
  show(byId("load-earlier"), page.has_more);
  if (!cursor && state.views.length) state.views[state.views.length - 1].node.scrollIntoView({ block: "end" });
}

// --- errors and the retry countdown ------------------------------------------------------------------------

function showBanner(text, action = null) {
  byId("banner-text").textContent = text;
  const button = byId("banner-action");
  show(button, Boolean(action));
  if (action) {
    button.textContent = action.label;
    button.onclick = action.run;
  }
  show(byId("banner"), true);
}

function hideBanner() {
  show(byId("banner"), false);
}

// A 429 with a retry time counts down and sends again by itself (the person already pressed Send).
function showError(error, retry = null) {
  if (error instanceof ApiError && error.status === 401) return; // signed out already, with the reason
  const text = explain(error);
  const wait = error instanceof ApiError && error.status === 429 ? error.retryAfterS : null;
  if (wait && retry) {
    startCountdown(text, wait, retry);
    return;
  }
  showBanner(text);
}

function startCountdown(text, seconds, retry) {
  cancelCountdown();
  const until = performance.now() + seconds * 1000;
  const tick = () => {
    const left = Math.ceil((until - performance.now()) / 1000);
    if (left <= 0) {
      cancelCountdown();
      hideBanner();
      retry();
      return;
    }
    showBanner(`${text} Sending again in ${left} s.`, { label: "Cancel", run: () => (cancelCountdown(), hideBanner()) });
    byId("banner").dataset.retryIn = String(left);
  };
  state.countdown = setInterval(tick, 250);
  tick();
}

function cancelCountdown() {
  if (state.countdown !== null) clearInterval(state.countdown);
  state.countdown = null;
  delete byId("banner").dataset.retryIn;
}

function iconButton(action, title, symbol, onclick) {
  return el("button", { type: "button", class: "icon", "aria-label": `${action} ${title}`, title: action, text: symbol, onclick });
}

// --- signing in ------------------------------------------------------------------------------------------------

function showSignIn(message = "") {
  showSignInPanel(message, "api-key");
}

function signOut(message = "") {
  closeReply();
  cancelCountdown();
  state.key = null;
  localStorage.removeItem(KEY_STORAGE);
  showSignIn(message);
}

async function signIn(event) {
  event.preventDefault();
  const key = byId("api-key").value.trim();
  if (!key) return;
  state.key = key;
  try {
    await api.get("/v1/models");
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 401)) showSignIn(explain(error));
    return; // a 401 has signed out with its message
  }
  localStorage.setItem(KEY_STORAGE, key);
  await enter();
}

// whether the gateway wants a key: /v1/models answers anyone when it runs open (embedded, without --auth)
async function needsKey() {
  for (let delay = 1000; ; delay = Math.min(delay * 2, 10000)) {
    try {
      await api.request("GET", "/v1/models", { anonymous: true });
      return false;
    } catch (error) {
      if (error instanceof ApiError) return error.status === 401;
      showSignIn(explain(error));
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }
}

async function enter() {
  let listing;
  try {
    listing = await api.get("/v1/models");
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 401)) showSignIn(explain(error));
    return;
  }
  state.models = listing.data.filter((m) => !m.deprecated_on).map((m) => m.id);
  const picker = byId("model");
  picker.replaceChildren(...state.models.map((id) => el("option", { value: id, text: id })));
  picker.disabled = state.models.length === 0;
  show(byId("sign-in"), false);
  show(byId("app"), true);
  show(byId("sign-out"), state.authRequired);
  await refreshConversations();
  const wanted = new URLSearchParams(location.hash.slice(1)).get("c");
  if (wanted) await openConversation(wanted);
  else newChat();
}

// --- settings --------------------------------------------------------------------------------------------------

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
  } catch {
    saved = {};
  }
  byId("max-tokens").value = saved.maxTokens || "";
  byId("temperature").value = saved.temperature ?? "";
  byId("ignore-eos").checked = Boolean(saved.ignoreEos);
}

function saveSettings() {
  const settings = {
    maxTokens: byId("max-tokens").value,
    temperature: byId("temperature").value,
    ignoreEos: byId("ignore-eos").checked,
  };
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(settings));
}

// --- wiring ----------------------------------------------------------------------------------------------------

function wire() {
  byId("sign-in-form").addEventListener("submit", signIn);
  byId("sign-out").addEventListener("click", () => signOut());
  byId("new-chat").addEventListener("click", newChat);
  byId("stop").addEventListener("click", stopReply);
  byId("banner-close").addEventListener("click", () => (cancelCountdown(), hideBanner()));
  byId("load-earlier").addEventListener("click", () => loadMessages(state.nextCursor));
  byId("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const content = byId("message").value;
    if (content.trim() && !state.reply) send(content);
  });
  byId("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      byId("composer").requestSubmit();
    }
  });
  for (const id of ["max-tokens", "temperature", "ignore-eos"]) byId(id).addEventListener("change", saveSettings);
  // a revoked key signs the page out when the person comes back to it, or within REVALIDATE_MS
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !byId("app").hidden) refreshConversations();
  });
  setInterval(() => {
    if (!document.hidden && !byId("app").hidden) refreshConversations();
  }, REVALIDATE_MS);
}

async function boot() {
  wire();
  loadSettings();
  state.authRequired = await needsKey();
  if (state.authRequired && !state.key) {
    showSignIn();
    return;
  }
  await enter();
}

boot();
