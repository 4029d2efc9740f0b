// Small charts without a library: stacked columns in SVG, and horizontal bars in HTML. Labels are text nodes.
import { el } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
export const PALETTE = ["#2456d6", "#d97706", "#059669", "#c026d3", "#dc2626", "#0891b2", "#65a30d", "#7c3aed"];

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

// columns: [{label, parts: {series: value}}]; series: names in legend order
// axisFormat: the scale's labels (short); format: each part's exact value (its tooltip)
export function stackedColumns({ title, columns, series, format, axisFormat = format }) {
  const width = 640;
  const height = 220;
  const pad = { left: 64, right: 8, top: 10, bottom: 34 };
  const totals = columns.map((c) => series.reduce((sum, s) => sum + (c.parts[s] || 0), 0));
  const top = Math.max(...totals, 0) || 1;
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const step = plotW / Math.max(columns.length, 1);
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title });
  for (const fraction of [0, 0.5, 1]) {
    const y = pad.top + plotH * (1 - fraction);
    chart.append(svg("line", { x1: pad.left, x2: width - pad.right, y1: y, y2: y, stroke: "currentColor", "stroke-opacity": 0.15 }));
    chart.append(svg("text", { x: pad.left - 6, y: y + 4, "text-anchor": "end" }, axisFormat(top * fraction)));
  }
  columns.forEach((column, i) => {
    let y = pad.top + plotH;
    const x = pad.left + i * step + step * 0.15;
    series.forEach((name, j) => {
      const value = column.parts[name] || 0;
      if (!value) return;
      const h = (value / top) * plotH;
      y -= h;
      const rect = svg("rect", { x, y, width: step * 0.7, height: Math.max(h, 0.5), fill: PALETTE[j % PALETTE.length] });
      rect.append(svg("title", {}, `${column.label} · ${name}: ${format(value)}`));
      chart.append(rect);
    });
    if (columns.length <= 16 || i % Math.ceil(columns.length / 16) === 0) {
      chart.append(svg("text", { x: x + step * 0.35, y: height - pad.bottom + 16, "text-anchor": "middle" }, column.label));
    }
  });
  const legend = el(
    "ul",
    { class: "legend" },
    series.map((name, j) => el("li", {}, el("span", { class: "swatch", style: { background: PALETTE[j % PALETTE.length] } }), name)),
  );
  return el("figure", { class: "chart" }, el("figcaption", { text: title }), chart, legend);
}

// items: [{label, value}]
export function barList({ title, items, format }) {
  const top = Math.max(...items.map((i) => i.value), 0) || 1;
  const rows = items.map((item) =>
    el(
      "div",
      { class: "bar-row" },
      el("span", { text: item.label }),
      el("span", { class: "track" }, el("span", { class: "fill", style: { width: `${((item.value / top) * 100).toFixed(1)}%` } })),
      el("span", { class: "num", text: format(item.value) }),
    ),
  );
  return el("figure", { class: "chart" }, el("figcaption", { text: title }), el("div", { class: "bars" }, rows));
}
