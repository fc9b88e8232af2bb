// lpx report: filters, trend charts and drift heatmaps, drawn from JSON inlined in each page.
// No network, no library: the site opens from disk. Every string from the data is set with
// textContent, never parsed as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function svgElement(name, attributes, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes || {})) node.setAttribute(key, value);
  if (parent) parent.appendChild(node);
  return node;
}

function readJson(id) {
  const node = document.getElementById(id);
  return node ? JSON.parse(node.textContent) : null;
}

function formatNumber(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1e15) return String(value);
  return Math.abs(value) >= 1e-3 && Math.abs(value) < 1e4 ? value.toPrecision(4) : value.toExponential(3);
}

// ---- filters: engine and dtype hide rows; metric picks which sparkline/matrix/chart shows
function applyFilters() {
  const wanted = {};
  document.querySelectorAll("select[data-filter]").forEach((select) => {
    wanted[select.dataset.filter] = select.value;
  });
  const matches = (element, name) => {
    const want = wanted[name];
    if (!want || element.dataset[name] === undefined) return true;
    return element.dataset[name].split(" ").includes(want);
  };
  document.querySelectorAll(".filterable tbody tr, .matrix tr").forEach((row) => {
    row.hidden = !(matches(row, "engine") && matches(row, "dtype"));
  });
  document.querySelectorAll(".spark, .matrix, .chart-box").forEach((element) => {
    const metricOk = !wanted.metric || element.dataset.metric === wanted.metric;
    const shown = metricOk && (element.classList.contains("matrix") ? matches(element, "dtype") : true);
    element.classList.toggle("shown", shown);
    if (element.classList.contains("chart-box")) element.hidden = !shown;
  });
}

// ---- tooltip
const tooltip = () => document.getElementById("tooltip");
function showTooltip(event, text) {
  const tip = tooltip();
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = `${event.clientX + 14}px`;
  tip.style.top = `${event.clientY + 10}px`;
}
function hideTooltip() { tooltip().hidden = true; }

// ---- trend charts: points, threshold band, change points, version changes, annotations
function drawChart(container, name, data) {
  const chart = data.charts[name];
  const runs = data.runs;
  const width = 900, height = 180, left = 64, right = 10, top = 8, bottom = 18;
  const finite = (v) => v !== null && v !== undefined && Number.isFinite(v);
  const all = [...chart.values, ...chart.lower, ...chart.upper].filter(finite);
  if (!all.length) { container.textContent = "no finite values"; return; }
  const positive = all.filter((v) => v > 0);
  let low = Math.min(...all), high = Math.max(...all);
  const useLog = low > 0 && high / low > 20;
  const transform = useLog ? (v) => Math.log10(v) : (v) => v;
  if (!useLog && chart.lower.some(finite)) low = Math.min(low, ...chart.values.filter(finite));
  let y0 = transform(useLog ? Math.min(...positive) : low), y1 = transform(high);
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const n = chart.values.length;
  const x = (i) => left + (n === 1 ? (width - left - right) / 2 : (i * (width - left - right)) / (n - 1));
  const y = (v) => top + (height - top - bottom) * (1 - (transform(v) - y0) / (y1 - y0));
  const svg = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img" }, container);
  svg.setAttribute("aria-label", `${name} over ${n} runs`);
  // band: the polygon between lower and upper where detection computed one
  const upper = [], lower = [];
  chart.upper.forEach((u, i) => {
    const l = chart.lower[i];
    if (finite(u) && finite(l)) { upper.push(`${x(i)},${y(u)}`); lower.unshift(`${x(i)},${y(useLog ? Math.max(l, Math.min(...positive)) : l)}`); }
  });
  if (upper.length) svgElement("polygon", { class: "band", points: [...upper, ...lower].join(" ") }, svg);
  const path = chart.values.map((v, i) => (finite(v) ? `${x(i)},${y(v)}` : null)).filter(Boolean);
  if (path.length > 1) svgElement("polyline", { class: "line", points: path.join(" ") }, svg);
  const marker = (index, cls, label) => {
    const line = svgElement("line", { class: cls, x1: x(index), x2: x(index), y1: top, y2: height - bottom }, svg);
    svgElement("title", {}, line).textContent = label;
  };
  chart.changepoints.forEach((i) => marker(i - 0.5, "cp", `change point before run ${runs[i].run}`));
  data.version_changes.forEach((c) => marker(c.index - 0.5, "vc", `version change: ${c.text}`));
  data.annotations.forEach((a) => marker(a.index, "ann", `${a.kind}: ${a.reason}`));
  // axes: min and max labels, first and last date
  const label = (text, attributes) => { svgElement("text", { class: "axis", ...attributes }, svg).textContent = text; };
  label(formatNumber(useLog ? 10 ** y1 : y1), { x: 2, y: top + 8 });
  label(formatNumber(useLog ? 10 ** y0 : y0), { x: 2, y: height - bottom });
  label(runs[0].at.slice(0, 10), { x: left, y: height - 4 });
  label(runs[n - 1].at.slice(0, 10), { x: width - right - 60, y: height - 4 });
  chart.values.forEach((v, i) => {
    if (!finite(v)) return;
    const status = chart.status[i] || "";
    const link = svgElement("a", { href: `../runs/${runs[i].run}.html` }, svg);
    const bad = status === "suspicious" || status === "regression" || status === "beyond_floor";
    const classes = [bad ? "bad" : status === "excluded" ? "excluded" : "", runs[i].verdict === "pass" ? "" : "fail"];
    const dot = svgElement("circle", { cx: x(i), cy: y(v), r: bad ? 4 : 2.6, class: classes.join(" ").trim() }, link);
    dot.dataset.index = i;
    const text = [
      `${name} = ${formatNumber(v)} (${status.replace("_", " ")})`,
      finite(chart.lower[i]) ? `band [${formatNumber(chart.lower[i])}, ${formatNumber(chart.upper[i])}]` : "no band yet",
      `run ${runs[i].run} · ${runs[i].at} · ${runs[i].verdict}`,
      `rollout ${runs[i].rollout}`,
      `replay ${runs[i].replay}`,
    ].join("\n");
    dot.addEventListener("mouseenter", (event) => showTooltip(event, text));
    dot.addEventListener("mousemove", (event) => showTooltip(event, text));
    dot.addEventListener("mouseleave", hideTooltip);
  });
}

function drawCharts() {
  const data = readJson("chart-data");
  if (!data) return;
  document.querySelectorAll(".chart[data-chart]").forEach((container) => drawChart(container, container.dataset.chart, data));
}

// ---- heatmaps: |d| per position for the most drifting sequences
function drawHeatmap(container, map) {
  const rowHeight = 12, labelWidth = 90;
  const columns = Math.max(...map.rows.map((r) => r.cells.length));
  const cell = Math.max(5, Math.min(18, Math.floor(900 / columns)));
  const width = labelWidth + columns * cell, height = map.rows.length * rowHeight + 4;
  const svg = svgElement("svg", { width, height, viewBox: `0 0 ${width} ${height}` }, container);
  // The colour scale is anchored at tau: white at tau/1000, full at 10 x tau, so fp32 noise
  // stays pale and a fault stands out the same way on every page.
  const tau = map.tau || 1e-4;
  const lo = Math.log10(tau / 1000), hi = Math.log10(tau * 10);
  map.rows.forEach((row, r) => {
    const text = svgElement("text", { x: 0, y: r * rowHeight + 10 }, svg);
    text.textContent = row.sequence_id.length > 14 ? `${row.sequence_id.slice(0, 13)}…` : row.sequence_id;
    row.cells.forEach((v, c) => {
      if (v === null) return;
      const value = v === "inf" ? Infinity : v;
      const t = value === Infinity ? 1 : (Math.log10(Math.max(value, 1e-12)) - lo) / (hi - lo);
      const light = Math.round(97 - 67 * Math.max(0, Math.min(1, t)));
      const over = map.tau !== null && value > map.tau;
      const rect = svgElement("rect", {
        x: labelWidth + c * cell, y: r * rowHeight + 1, width: cell - 1, height: rowHeight - 2,
        fill: `hsl(4, 80%, ${light}%)`, class: over ? "over" : "",
      }, svg);
      const start = c * map.bin;
      const where = map.bin > 1 ? `positions ${start}-${start + map.bin - 1}` : `position ${start}`;
      svgElement("title", {}, rect).textContent = `${row.sequence_id} ${where}: |d| ${v === "inf" ? "inf" : formatNumber(value)}`;
    });
  });
}

// ---- run pages: each comparison's tables, from the page's run-data JSON
function element(name, attributes, parent, text) {
  const node = document.createElement(name);
  for (const [key, value] of Object.entries(attributes || {})) node.setAttribute(key, value);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (parent) parent.appendChild(node);
  return node;
}

function table(parent, className, headers, rows) {
  const t = element("table", { class: className }, parent);
  const head = element("tr", {}, element("thead", {}, t));
  headers.forEach((h) => element("th", {}, head, h));
  const body = element("tbody", {}, t);
  rows.forEach((cells) => {
    const tr = element("tr", {}, body);
    cells.forEach((cell) => {
      const td = element("td", cell.cls ? { class: cell.cls } : {}, tr);
      if (cell.build) cell.build(td); else td.textContent = cell.text === undefined ? String(cell) : cell.text;
    });
  });
  return t;
}

const num = (v) => ({ text: typeof v === "number" ? formatNumber(v) : v === null || v === undefined ? "–" : String(v), cls: "num" });
const badge = (status) => ({ build: (td) => element("span", { class: `status ${status || "none"}` }, td, (status || "–").replace(/_/g, " ")) });

function drawComparison(container, detail) {
  const columns = element("div", { class: "cols" }, container);
  const left = element("div", {}, columns);
  element("h3", {}, left, "Metrics");
  table(left, "metrics", ["metric", "value", "band", "status"], detail.metrics.map(([name, value, status, lower, upper]) => [
    name, num(value), { text: upper === null || upper === undefined ? "–" : `[${formatNumber(lower)}, ${formatNumber(upper)}]`, cls: "num" }, badge(status),
  ]));
  const right = element("div", {}, columns);
  element("h3", {}, right, "Worst tokens");
  const headers = ["sequence", "position", "region", "token", ...(detail.decoded ? ["text (with left context)"] : []), "rollout", "train", "|d|"];
  table(right, "worst", headers, detail.worst.map((w) => [
    { text: w.sequence_id, cls: "seq" }, num(w.position), w.region, num(w.token_id),
    ...(detail.decoded ? [{ cls: "text", build: (td) => { element("span", { class: "context" }, td, w.context || ""); element("mark", {}, td, w.text || ""); } }] : []),
    num(w.logprob_rollout), num(w.logprob_train), num(w.abs_diff),
  ]));
  const map = detail.heatmap;
  if (map && map.rows.length) {
    element("h3", {}, container, "Drift per position");
    const binned = map.bin > 1 ? ` (max over bins of ${map.bin})` : "";
    element("p", { class: "muted" }, container,
      `|d| per completion position${binned}, the ${map.rows.length} most drifting sequences; darker is larger, outlined cells exceed tau ${formatNumber(map.tau)}.`);
    drawHeatmap(element("div", { class: "heatmap" }, container), map);
  }
  const reproduce = detail.reproduce || {};
  const more = element("details", {}, container);
  element("summary", {}, more, "Reproduce");
  element("pre", {}, more, reproduce.command_line || "");
  const sides = [reproduce.fixture || {}, reproduce.replay || {}];
  const fields = ["path", "engine", "dtype", "model_path", "weights_fingerprint", "tokenizer_fingerprint", "prompt_set_fingerprint",
    "versions", "knobs", "sampling", "layout", "logprob_channels", "injected_faults"];
  const shown = (v) => (v === null || v === undefined ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v));
  table(more, "reproduce", ["", "rollout (fixture)", "replay"], fields.map((f) => [
    { text: f, cls: "field" }, { build: (td) => element("code", {}, td, shown(sides[0][f])) }, { build: (td) => element("code", {}, td, shown(sides[1][f])) },
  ]));
}

function drawRunDetails() {
  const data = readJson("run-data");
  if (!data) return;
  document.querySelectorAll(".comparison-detail[data-detail]").forEach((container) => {
    const detail = data[container.dataset.detail];
    if (detail) drawComparison(container, detail);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("select[data-filter]").forEach((select) => select.addEventListener("change", applyFilters));
  drawCharts();
  drawRunDetails();
  applyFilters();
});
