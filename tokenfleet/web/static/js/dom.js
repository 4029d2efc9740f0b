// Elements built from text only. Nothing here (or anywhere in these pages) hands a string to the HTML parser: text
// from the server, model output included, is set with textContent and can never become markup.

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key === "style") Object.assign(node.style, value); // CSSOM: allowed by the pages' style-src 'self'

    else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export const byId = (id) => document.getElementById(id);

export function show(node, visible = true) {
  node.hidden = !visible;
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

export function formatNumber(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

export function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  return `${seconds.toFixed(seconds < 10 ? 2 : 1)} s`;
}

export function formatDate(unixSeconds) {
  if (!unixSeconds) return "–";
  return new Date(unixSeconds * 1000).toISOString().replace("T", " ").slice(0, 16);
}

// The sign-in panel in place of the page: an optional reason, and an empty key field with the focus.
export function showSignInPanel(message, keyFieldId) {
  show(byId("app"), false);
  show(byId("sign-out"), false);
  show(byId("sign-in"), true);
  byId("sign-in-message").textContent = message;
  show(byId("sign-in-message"), Boolean(message));
  byId(keyFieldId).value = "";
  byId(keyFieldId).focus();
}
