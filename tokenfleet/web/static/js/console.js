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

function table(headers, rows) {
  return el(
    "table",
    {},
    el("thead", {}, el("tr", {}, headers.map(([label, numeric]) => el("th", { class: numeric ? "num" : "", scope: "col", text: label })))),
    el("tbody", {}, rows),
  );
}

const cell = (text, numeric = false) => el("td", { class: numeric ? "num" : "", text });

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
    const rows = model.replicas.map(replicaRow);
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
        table(
          [
            ["Replica"],
            ["Pool"],
            ["Health"],
            ["Breaker"],
            ["Draining"],
            ["KV cache"],
            ["Running", true],
            ["Waiting", true],
            ["In flight", true],
            ["TTFT p50", true],
            [""],
          ],
          rows.length ? rows : [el("tr", {}, el("td", { colspan: 11, class: "muted", text: "No replicas." }))],
        ),
      ),
    );
  });
  byId("models").replaceChildren(...blocks);
}

function replicaRow(r) {
  const health = r.healthy
    ? badge("healthy", "good")
    : badge("unhealthy", "bad", r.last_failure || `${r.consecutive_failures} failure(s) in a row`);
  const breaker = { closed: ["closed", "good"], open: ["open (ejected)", "bad"], half_open: ["half-open", "warn"] }[r.breaker] || [
    r.breaker,
    "warn",
  ];
  const drain = el("button", {
    type: "button",
    class: "secondary",
    text: r.draining ? "Undrain" : "Drain",
    "aria-label": `${r.draining ? "Undrain" : "Drain"} ${r.name}`,
    onclick: () => setDraining(r.name, !r.draining),
  });
  return el(
    "tr",
    { "data-replica": r.name, "data-healthy": String(r.healthy) },
    el("td", { title: r.url || "", text: r.name }),
    cell(r.pool),
    el("td", {}, health),
    el("td", {}, badge(breaker[0], breaker[1])),
    el("td", {}, r.draining ? badge("draining", "warn") : "no"),
    el("td", {}, meter(r.kv_usage)),
    cell(formatNumber(r.running), true),
    cell(formatNumber(r.waiting), true),
    cell(formatNumber(r.in_flight), true),
    cell(formatSeconds(r.ttft_p50_s), true),
    el("td", {}, drain),
  );
}

async function setDraining(replica, draining) {
  try {
    await api.json("POST", "/admin/v1/replicas/drain", { replica, draining });
    await refreshFleet();
  } catch (error) {
    reportError(error);
  }
}

function renderQueues(models) {
  const rows = models.flatMap((model) =>
    model.tiers.map((t) => {
      const refused = Object.values(t.refused).reduce((a, b) => a + b, 0);
      const reasons = Object.entries(t.refused)
        .map(([reason, n]) => `${reason.replaceAll("_", " ")}: ${n}`)
        .join(", ");
      return el(
        "tr",
        { "data-tier": t.tier },
        cell(model.name),
        cell(t.tier),
        cell(formatNumber(t.queued), true),
        cell(formatNumber(t.queued_tokens), true),
        cell(formatNumber(t.in_use), true),
        cell(formatSeconds(t.oldest_wait_s), true),
        el("td", {}, t.paused ? badge("paused", "warn") : "no"),
        cell(formatNumber(t.dispatched), true),
        cell(formatNumber(t.shed), true),
        el("td", { class: "num", title: reasons || "none", text: formatNumber(refused) }),
      );
    }),
  );
  byId("queues").replaceChildren(
    table(
      [
        ["Model"],
        ["Tier"],
        ["Queued", true],
        ["Queued tokens", true],
        ["Slots in use", true],
        ["Oldest wait", true],
        ["Paused"],
        ["Dispatched", true],
        ["Shed", true],
        ["Refused (quota)", true],
      ],
      rows,
    ),
  );
}

function renderAutoscale(pools) {
  const box = byId("autoscale");
  if (!pools.length) {
    box.replaceChildren(el("p", { class: "muted", text: "Autoscaling is off (autoscale.enabled in the fleet file)." }));
    return;
  }
  const rows = pools.map((p) =>
    el(
      "tr",
      {},
      cell(p.model),
      cell(p.pool),
      cell(formatNumber(p.desired), true),
      cell(formatNumber(p.ready), true),
      cell(formatNumber(p.starting), true),
      cell(formatNumber(p.draining), true),
    ),
  );
  const bars = pools.flatMap((p) => [
    { label: `${p.model}/${p.pool} desired`, value: p.desired || 0 },
    { label: `${p.model}/${p.pool} ready`, value: p.ready || 0 },
  ]);
  box.replaceChildren(
    el(
      "div",
      { class: "table-wrap" },
      table([["Model"], ["Pool"], ["Desired", true], ["Ready", true], ["Starting", true], ["Draining", true]], rows),
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
  const orgRows = [...totals.entries()].map(([name, t]) =>
    el(
      "tr",
      {},
      cell(name),
      cell(formatNumber(t.requests), true),
      cell(formatNumber(t.input), true),
      cell(formatNumber(t.output), true),
      cell(usd(t.cost), true),
    ),
  );
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
      table(
        [["Organisation"], ["Requests", true], ["Input tokens", true], ["Output tokens", true], ["Cost", true]],
        orgRows.length ? orgRows : [el("tr", {}, el("td", { colspan: 5, class: "muted", text: "No usage yet." }))],
      ),
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

function renderKeys() {
  const filter = byId("key-filter").value.trim().toLowerCase();
  const withRevoked = byId("show-revoked").checked;
  const shown = state.keys.filter(
    (k) =>
      (withRevoked || !k.revoked_at) &&
      (!filter || [k.name, k.org, k.user].some((text) => (text || "").toLowerCase().includes(filter))),
  );
  shown.sort((a, b) => (a.name || "").localeCompare(b.name || "") || b.created_at - a.created_at);
  const rows = shown.map((k) =>
    el(
      "tr",
      { "data-key-id": k.id },
      cell(k.name),
      el("td", {}, el("code", { text: `${k.prefix}…` })),
      cell(k.org),
      cell(k.user),
      cell(formatDate(k.created_at)),
      cell(formatDate(k.last_used_at)),
      el("td", {}, k.revoked_at ? badge("revoked", "bad") : badge("active", "good")),
      el("td", {}, k.revoked_at ? "" : revokeButton(k)),
    ),
  );
  byId("keys").replaceChildren(
    table(
      [["Name"], ["Key"], ["Organisation"], ["User"], ["Created (UTC)"], ["Last used"], ["Status"], [""]],
      rows.length ? rows : [el("tr", {}, el("td", { colspan: 8, class: "muted", text: "No keys." }))],
    ),
  );
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
