// The operator console: the fleet (models, replicas, the overload ladder, queues per tier, the autoscaler), usage
// and cost, and API keys. It polls the admin API (/admin/v1/...), which reads state the gateway keeps in memory, so
// a console left open costs the gateway next to nothing and never waits on a request's path.
import { Api, ApiError } from "./api.js";
import { barList, stackedColumns } from "./charts.js";
import { byId, el, formatDate, formatNumber, formatSeconds, show, showSignInPanel } from "./dom.js";

const KEY_STORAGE = "tokenfleet.adminKey"; // this tab only: the admin key opens everything
const FLEET_EVERY_MS = 2000;
const SLOW_EVERY_MS = 30000;
const DEFAULT_TIERS = ["enterprise", "paid", "free", "batch"];

const state = {
  key: sessionStorage.getItem(KEY_STORAGE),
  timers: [],
  keys: [],
  orgs: new Map(), // id -> organisation
  revoking: null, // id of the key whose revoke waits for confirmation
};

const api = new Api({
  key: () => state.key,
  onUnauthorized: () => signOut("That admin key was not accepted."),
});

// --- polling -------------------------------------------------------------------------------------------------

function every(ms, task) {
  const run = async () => {
    if (!document.hidden) {
      try {
        await task();
        show(byId("console-error"), false);
      } catch (error) {
        reportError(error);
      }
    }
    state.timers.push(setTimeout(run, ms));
  };
  run();
}

function stopPolling() {
  for (const timer of state.timers) clearTimeout(timer);
  state.timers = [];
}

function reportError(error) {
  if (error instanceof ApiError && error.status === 401) return; // signed out already
  if (error instanceof ApiError && error.code === "admin_disabled") {
    signOut("The admin API is off on this gateway: set admin_key in the fleet file (or TOKENFLEET_ADMIN_KEY).");
    return;
  }
  const box = byId("console-error");
  box.textContent = `Could not refresh: ${error.message}`;
  show(box, true);
}

// --- the fleet -------------------------------------------------------------------------------------------------

async function refreshFleet() {
  const fleet = await api.get("/admin/v1/fleet");
  renderCards(fleet);
  renderModels(fleet.models);
  renderQueues(fleet.models);
  renderAutoscale(fleet.autoscale);
  byId("updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
}

function stat(label, value, detail, extraClass = "") {
  return el(
    "div",
    { class: `stat ${extraClass}` },
    el("div", { class: "label", text: label }),
    el("div", { class: "value", text: value }),
    el("div", { class: "detail", text: detail }),
  );
}

function renderCards(fleet) {
  const replicas = fleet.models.flatMap((m) => m.replicas);
  const healthy = replicas.filter((r) => r.healthy).length;
  const queued = fleet.models.reduce((sum, m) => sum + m.queued, 0);
  const o = fleet.overload;
  byId("cards").replaceChildren(
    stat("Overload level", `Level ${o.level}`, o.meaning, `level-${o.level}`),
    stat(
      "Projected time to first token",
      o.projected_ttft_s === null ? "∞" : formatSeconds(o.projected_ttft_s),
      `target ${formatSeconds(o.ttft_target_s)}`,
    ),
    stat("Healthy replicas", `${healthy} / ${replicas.length}`, healthy < replicas.length ? "some need attention" : "all serving"),
    stat("Streams now", formatNumber(fleet.active_streams), `${formatNumber(queued)} request(s) queued`),
  );
}

const cell = (text, numeric = false) => el("td", { class: numeric ? "num" : "", text });

// A table from its columns, each header written once beside what its cells show. A column has a label, `numeric`
// (right-aligned), and one of: `text` (the cell's text for an item), `content` (a node inside the cell: a badge, a
// button) or `td` (the whole cell). `empty`: the text of the one row shown when there are no items.
function dataTable(columns, items, { rowProps = () => ({}), empty = null } = {}) {
  const td = (column, item) => {
    if (column.td) return column.td(item);
    if (column.content) return el("td", {}, column.content(item));
    return cell(column.text(item), column.numeric);
  };
  const rows = items.map((item) => el("tr", rowProps(item), columns.map((column) => td(column, item))));
  if (!rows.length && empty !== null) {
    rows.push(el("tr", {}, el("td", { colspan: columns.length, class: "muted", text: empty })));
  }
  const header = ({ label, numeric }) => el("th", { class: numeric ? "num" : "", scope: "col", text: label });
  return el("table", {}, el("thead", {}, el("tr", {}, columns.map(header))), el("tbody", {}, rows));
}

const countColumn = (label, value) => ({ label, numeric: true, text: (item) => formatNumber(value(item)) });

function badge(text, kind, title = null) {
  return el("span", { class: `badge ${kind}`, text, title });
}

function meter(fraction) {
  const percent = Math.round(Math.min(Math.max(fraction, 0), 1) * 100);
  return el(
    "span",
    {},
    el("span", { class: "meter", role: "img", "aria-label": `${percent}%` }, el("span", { style: { width: `${percent}%` } })),
    `${percent}%`,
  );
}

function renderModels(models) {
  const blocks = models.map((model) => {
    const aliases = model.aliases.length ? ` (also ${model.aliases.join(", ")})` : "";
    return el(
      "div",
      { class: "model", "data-model": model.name },
      el("h3", { text: `${model.name}${aliases}` }),
      el(
        "p",
        { class: "muted" },
        `Pools: ${model.pools.join(", ") || "–"} · context ${formatNumber(model.max_model_len)} tokens · ` +
          `slots ${model.in_use} / ${model.slots} in use` +
          (model.deprecated_on ? ` · retired from ${model.deprecated_on}` : ""),
      ),
      el(
        "div",
        { class: "table-wrap" },
        dataTable(REPLICA_COLUMNS, model.replicas, {
          rowProps: (r) => ({ "data-replica": r.name, "data-healthy": String(r.healthy) }),
          empty: "No replicas.",
        }),
      ),
    );
  });
  byId("models").replaceChildren(...blocks);
}

function health(r) {
  return r.healthy
    ? badge("healthy", "good")
    : badge("unhealthy", "bad", r.last_failure || `${r.consecutive_failures} failure(s) in a row`);
}

function breakerBadge(r) {
  const [text, kind] = { closed: ["closed", "good"], open: ["open (ejected)", "bad"], half_open: ["half-open", "warn"] }[
    r.breaker
  ] || [r.breaker, "warn"];
  return badge(text, kind);
}

function drainButton(r) {
  return el("button", {
    type: "button",
    class: "secondary",
    text: r.draining ? "Undrain" : "Drain",
    "aria-label": `${r.draining ? "Undrain" : "Drain"} ${r.name}`,
    onclick: () => setDraining(r.name, !r.draining),
  });
}

const REPLICA_COLUMNS = [
  { label: "Replica", td: (r) => el("td", { title: r.url || "", text: r.name }) },
  { label: "Pool", text: (r) => r.pool },
  { label: "Health", content: health },
  { label: "Breaker", content: breakerBadge },
  { label: "Draining", content: (r) => (r.draining ? badge("draining", "warn") : "no") },
  { label: "KV cache", content: (r) => meter(r.kv_usage) },
  countColumn("Running", (r) => r.running),
  countColumn("Waiting", (r) => r.waiting),
  countColumn("In flight", (r) => r.in_flight),
  { label: "TTFT p50", numeric: true, text: (r) => formatSeconds(r.ttft_p50_s) },
  { label: "", content: drainButton },
];

async function setDraining(replica, draining) {
  try {
    await api.json("POST", "/admin/v1/replicas/drain", { replica, draining });
    await refreshFleet();
  } catch (error) {
    reportError(error);
  }
}

function refusedCell({ t }) {
  const refused = Object.values(t.refused).reduce((a, b) => a + b, 0);
  const reasons = Object.entries(t.refused)
    .map(([reason, n]) => `${reason.replaceAll("_", " ")}: ${n}`)
    .join(", ");
  return el("td", { class: "num", title: reasons || "none", text: formatNumber(refused) });
}

const QUEUE_COLUMNS = [
  { label: "Model", text: ({ model }) => model.name },
  { label: "Tier", text: ({ t }) => t.tier },
  countColumn("Queued", ({ t }) => t.queued),
  countColumn("Queued tokens", ({ t }) => t.queued_tokens),
  countColumn("Slots in use", ({ t }) => t.in_use),
  { label: "Oldest wait", numeric: true, text: ({ t }) => formatSeconds(t.oldest_wait_s) },
  { label: "Paused", content: ({ t }) => (t.paused ? badge("paused", "warn") : "no") },
  countColumn("Dispatched", ({ t }) => t.dispatched),
  countColumn("Shed", ({ t }) => t.shed),
  { label: "Refused (quota)", numeric: true, td: refusedCell },
];

function renderQueues(models) {
  const tiers = models.flatMap((model) => model.tiers.map((t) => ({ model, t })));
  byId("queues").replaceChildren(dataTable(QUEUE_COLUMNS, tiers, { rowProps: ({ t }) => ({ "data-tier": t.tier }) }));
}

const POOL_COLUMNS = [
  { label: "Model", text: (p) => p.model },
  { label: "Pool", text: (p) => p.pool },
  countColumn("Desired", (p) => p.desired),
  countColumn("Ready", (p) => p.ready),
  countColumn("Starting", (p) => p.starting),
  countColumn("Draining", (p) => p.draining),
];

function renderAutoscale(pools) {
  const box = byId("autoscale");
  if (!pools.length) {
    box.replaceChildren(el("p", { class: "muted", text: "Autoscaling is off (autoscale.enabled in the fleet file)." }));
    return;
  }
  const bars = pools.flatMap((p) => [
    { label: `${p.model}/${p.pool} desired`, value: p.desired || 0 },
    { label: `${p.model}/${p.pool} ready`, value: p.ready || 0 },
  ]);
  box.replaceChildren(
    el(
      "div",
      { class: "table-wrap" },
      dataTable(POOL_COLUMNS, pools),
    ),
    barList({ title: "Desired vs ready replicas", items: bars, format: (v) => formatNumber(v) }),
  );
}

// --- usage -------------------------------------------------------------------------------------------------------

function isoDay(date) {
  return date.toISOString().slice(0, 10);
}

async function refreshUsage() {
  const days = Number(byId("usage-days").value);
  const since = new Date(Date.now() - (days - 1) * 86400000);
  const query = `since=${isoDay(since)}`;
  let byDay;
  let byModel;
  try {
    [byDay, byModel] = await Promise.all([
      api.get(`/admin/v1/usage?group_by=day,org&${query}`),
      api.get(`/admin/v1/usage?group_by=model&${query}`),
    ]);
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) {
      byId("usage").replaceChildren(el("p", { class: "muted", text: "Usage needs the gateway's database." }));
      return;
    }
    throw error;
  }
  await refreshOrgs();
  const orgName = (id) => (state.orgs.get(id) || { name: id }).name;
  const orgs = [...new Set(byDay.data.map((line) => orgName(line.org)))].sort();
  const columns = [];
  for (let i = 0; i < days; i += 1) {
    const day = isoDay(new Date(since.getTime() + i * 86400000));
    columns.push({ label: day.slice(5), day, parts: {} });
  }
  const byDate = new Map(columns.map((c) => [c.day, c]));
  const totals = new Map();
  for (const line of byDay.data) {
    const column = byDate.get(line.day);
    const name = orgName(line.org);
    if (column) column.parts[name] = (column.parts[name] || 0) + line.cost_usd;
    const total = totals.get(name) || { requests: 0, input: 0, output: 0, cost: 0 };
    total.requests += line.requests;
    total.input += line.input_tokens;
    total.output += line.output_tokens;
    total.cost += line.cost_usd;
    totals.set(name, total);
  }
  const usd = (v) => `$${v === 0 ? "0" : v < 0.01 ? v.toFixed(6) : v < 1 ? v.toFixed(4) : v.toFixed(2)}`;
  const orgColumns = [
    { label: "Organisation", text: ([name]) => name },
    countColumn("Requests", ([, t]) => t.requests),
    countColumn("Input tokens", ([, t]) => t.input),
    countColumn("Output tokens", ([, t]) => t.output),
    { label: "Cost", numeric: true, text: ([, t]) => usd(t.cost) },
  ];
  byId("usage").replaceChildren(
    el(
      "div",
      { class: "charts" },
      stackedColumns({
        title: `Cost per day by organisation (USD, total ${usd(byDay.total_cost_usd)})`,
        columns,
        series: orgs,
        format: usd,
        axisFormat: (v) => `$${v === 0 ? "0" : Number(v.toPrecision(2))}`,
      }),
      barList({
        title: "Tokens by model (input + output)",
        items: byModel.data.map((line) => ({ label: line.model, value: line.input_tokens + line.output_tokens })),
        format: (v) => formatNumber(v),
      }),
    ),
    el(
      "div",
      { class: "table-wrap" },
      dataTable(orgColumns, [...totals.entries()], { empty: "No usage yet." }),
    ),
  );
}

async function refreshOrgs() {
  const orgs = await api.get("/admin/v1/orgs");
  state.orgs = new Map(orgs.data.map((org) => [org.id, org]));
  const tiers = [...new Set([...DEFAULT_TIERS, ...orgs.data.map((org) => org.tier)])];
  const select = byId("key-tier");
  const chosen = select.value;
  select.replaceChildren(el("option", { value: "", text: "default (free)" }), ...tiers.map((t) => el("option", { value: t, text: t })));
  select.value = chosen;
}

// --- API keys ----------------------------------------------------------------------------------------------------

async function refreshKeys() {
  const keys = await api.get("/admin/v1/keys");
  state.keys = keys.data;
  renderKeys();
}

const KEY_COLUMNS = [
  { label: "Name", text: (k) => k.name },
  { label: "Key", content: (k) => el("code", { text: `${k.prefix}…` }) },
  { label: "Organisation", text: (k) => k.org },
  { label: "User", text: (k) => k.user },
  { label: "Created (UTC)", text: (k) => formatDate(k.created_at) },
  { label: "Last used", text: (k) => formatDate(k.last_used_at) },
  { label: "Status", content: (k) => (k.revoked_at ? badge("revoked", "bad") : badge("active", "good")) },
  { label: "", content: (k) => (k.revoked_at ? "" : revokeButton(k)) },
];

function renderKeys() {
  const filter = byId("key-filter").value.trim().toLowerCase();
  const withRevoked = byId("show-revoked").checked;
  const shown = state.keys.filter(
    (k) =>
      (withRevoked || !k.revoked_at) &&
      (!filter || [k.name, k.org, k.user].some((text) => (text || "").toLowerCase().includes(filter))),
  );
  shown.sort((a, b) => (a.name || "").localeCompare(b.name || "") || b.created_at - a.created_at);
  byId("keys").replaceChildren(dataTable(KEY_COLUMNS, shown, { rowProps: (k) => ({ "data-key-id": k.id }), empty: "No keys." }));
}

function revokeButton(key) {
  if (state.revoking !== key.id) {
    return el("button", {
      type: "button",
      class: "secondary",
      text: "Revoke",
      "aria-label": `Revoke ${key.name} (${key.prefix})`,
      onclick: () => {
        state.revoking = key.id;
        renderKeys();
      },
    });
  }
  return el(
    "span",
    {},
    el("button", {
      type: "button",
      class: "danger",
      text: "Confirm revoke",
      onclick: async () => {
        state.revoking = null;
        try {
          await api.json("DELETE", `/admin/v1/keys/${encodeURIComponent(key.id)}`);
        } catch (error) {
          reportError(error);
        }
        await refreshKeys();
      },
    }),
    " ",
    el("button", {
      type: "button",
      class: "secondary",
      text: "Cancel",
      onclick: () => {
        state.revoking = null;
        renderKeys();
      },
    }),
  );
}

async function createKey(event) {
  event.preventDefault();
  const body = { org: byId("key-org").value.trim(), user: byId("key-user").value.trim(), name: byId("key-name").value.trim() || "default" };
  const tier = byId("key-tier").value;
  if (tier) body.tier = tier;
  try {
    const created = await api.json("POST", "/admin/v1/keys", body);
    byId("created-key-value").textContent = created.key; // the only time it is ever shown
    show(byId("created-key"), true);
    byId("copy-key").focus();
  } catch (error) {
    reportError(error);
    return;
  }
  await refreshKeys();
}

function forgetCreatedKey() {
  byId("created-key-value").textContent = "";
  show(byId("created-key"), false);
}

// --- signing in ------------------------------------------------------------------------------------------------

function showSignIn(message = "") {
  stopPolling();
  showSignInPanel(message, "admin-key");
}

function signOut(message = "") {
  state.key = null;
  sessionStorage.removeItem(KEY_STORAGE);
  forgetCreatedKey();
  showSignIn(message);
}

async function enter() {
  try {
    await api.get("/admin/v1/fleet");
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) return;
    if (error instanceof ApiError && error.code === "admin_disabled") {
      reportError(error);
      return;
    }
    showSignIn(`Could not reach the admin API: ${error.message}`);
    return;
  }
  sessionStorage.setItem(KEY_STORAGE, state.key);
  show(byId("sign-in"), false);
  show(byId("app"), true);
  show(byId("sign-out"), true);
  stopPolling();
  every(FLEET_EVERY_MS, refreshFleet);
  every(SLOW_EVERY_MS, refreshKeys);
  every(SLOW_EVERY_MS, refreshUsage);
}

function wire() {
  byId("sign-in-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = byId("admin-key").value.trim();
    if (state.key) enter();
  });
  byId("sign-out").addEventListener("click", () => signOut());
  byId("new-key").addEventListener("submit", createKey);
  byId("hide-key").addEventListener("click", forgetCreatedKey);
  byId("copy-key").addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(byId("created-key-value").textContent);
      byId("copy-key").textContent = "Copied";
    } catch {
      byId("copy-key").textContent = "Select the key and copy it";
    }
  });
  byId("key-filter").addEventListener("input", renderKeys);
  byId("show-revoked").addEventListener("change", renderKeys);
  byId("usage-days").addEventListener("change", () => refreshUsage().catch(reportError));
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && state.key && !byId("app").hidden) refreshFleet().catch(reportError);
  });
}

wire();
if (state.key) enter();
else showSignIn();
