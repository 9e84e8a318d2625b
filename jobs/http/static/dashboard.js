// berth's dashboard: moves the bars and redraws the workers' charts every two seconds. A file of its own
// (the page's Content-Security-Policy runs no inline script); it reads the page's data from the
// <script type="application/json" id="state"> element, and writes every value as text or escaped.
"use strict";
const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
function esc(value) { return String(value).replace(/[&<>"']/g, c => ESCAPES[c]); }
function text(el, value) { if (el) el.textContent = value; }
function renderJobs(data) {
  for (const j of data.jobs) {
    const row = document.getElementById("job-" + j.id);
    if (!row) { location.reload(); return; }  // a new job: the server renders the row
    const bar = row.querySelector(".bar"), ok = 100 * j.completed / (j.total || 1);
    bar.dataset.done = j.done;
    bar.setAttribute("aria-label", `${j.done} of ${j.total} done, ${j.failed} failed`);
    bar.querySelector(".ok").setAttribute("width", ok.toFixed(1));
    bar.querySelector(".bad").setAttribute("x", ok.toFixed(1));
    bar.querySelector(".bad").setAttribute("width", (100 * j.failed / (j.total || 1)).toFixed(1));
    const status = row.querySelector(".status");
    status.textContent = j.status; status.className = "status status-" + j.status;
    text(row.querySelector(".done"), j.done + "/" + j.total); text(row.querySelector(".failed"), j.failed);
    text(row.querySelector(".tokens"), j.completion_tokens); text(row.querySelector(".rate"), j.tokens_per_second);
    text(row.querySelector(".eta"), j.eta);
  }
}
function polyline(points, x, y) { return points.map(p => x(p[0]).toFixed(1) + "," + y(p).toFixed(1)).join(" "); }
function chart(title, points, value, maxValue, color, unit) {
  // x: from the oldest sample (at least a minute back, at most the hour kept) to now; y: 0 to the peak
  const span = Math.min(3600, Math.max(60, ...points.map(p => -p[0])));
  const w = 420, h = 120, left = 44, bottom = 16;
  const x = t => left + (w - left - 4) * (1 + t / span), y = p => h - bottom - (value(p) / (maxValue || 1)) * (h - bottom - 8);
  const ago = span >= 3600 ? "60 min ago" : `${Math.ceil(span / 60)} min ago`;
  const axes = `<line class="axis" x1="${left}" y1="8" x2="${left}" y2="${h - bottom}"/>` +
    `<line class="axis" x1="${left}" y1="${h - bottom}" x2="${w - 4}" y2="${h - bottom}"/>` +
    `<text class="tick" x="${left - 4}" y="12" text-anchor="end">${esc(unit(maxValue))}</text>` +
    `<text class="tick" x="${left - 4}" y="${h - bottom}" text-anchor="end">0</text>` +
    `<text class="tick" x="${left}" y="${h - 3}">${ago}</text>` +
    `<text class="tick" x="${w - 4}" y="${h - 3}" text-anchor="end">now</text>`;
  return `<div class="chart"><div class="legend">${esc(title)}</div><svg viewBox="0 0 ${w} ${h}" ` +
    `data-points="${points.length}">${axes}<polyline fill="none" stroke="${color}" stroke-width="1.5" ` +
    `points="${esc(polyline(points, x, y))}"/></svg></div>`;
}
function workerRow(w, now) {
  return `<tr class="${w.gone ? "gone" : ""}"><td>${esc(w.id)}${w.gone ? " (gone)" : ""}</td><td>${esc(w.model)}</td>` +
    `<td>${esc(w.device)}</td><td>${w.gone ? "-" : esc(w.running)}</td><td>${w.gone ? "-" : esc(w.waiting)}</td>` +
    `<td>${w.gone ? "-" : esc(w.kv_blocks_used) + " of " + esc(w.kv_blocks_used + w.kv_blocks_free)}</td>` +
    `<td>${w.gone ? "-" : esc(w.output_tokens_per_second)}</td><td>${esc(Math.round(now - w.seen_at))}s ago</td></tr>`;
}
function renderWorkers(data) {
  // live workers first, with their figures and charts; gone ones folded into one row, figures dropped
  const live = data.workers.filter(w => !w.gone), gone = data.workers.filter(w => w.gone);
  const body = document.querySelector("#workers tbody");
  body.innerHTML = (live.map(w => workerRow(w, data.now)).join("") ||
    `<tr><td colspan="8">No engine worker is live.</td></tr>`) +
    (gone.length ? `<tr class="gone"><td colspan="8"><details><summary>${gone.length} gone within the hour</summary>` +
      `<table>${gone.map(w => workerRow(w, data.now)).join("")}</table></details></td></tr>` : "");
  const charts = [];
  for (const w of live) {
    const points = data.series[w.id] || [];
    const peak = Math.max(1, ...points.map(p => p[1]));
    charts.push(chart(`${w.id}: output tokens/s`, points, p => p[1], peak, "#0969da", v => `${v.toFixed(0)} tok/s`));
    const kvPeak = Math.max(0.001, ...points.map(p => p[2]));
    charts.push(chart(`${w.id}: KV cache used`, points, p => p[2], kvPeak, "#8250df", v => `${(100 * v).toFixed(1)}%`));
  }
  document.getElementById("charts").innerHTML = charts.join("");
}
function renderInteractive(data) {
  const body = document.querySelector("#interactive tbody");
  if (!body) return;
  const most = n => n ? esc(n) : "no limit";
  body.innerHTML = data.interactive.length ? data.interactive.map(r =>
    `<tr><td>${esc(r.tenant)}</td><td>${esc(r.live)}</td><td>${most(r.live_limit)}</td><td>${esc(r.tokens)}</td>` +
    `<td>${most(r.tokens_per_minute)}</td></tr>`).join("") :
    '<tr><td colspan="5">No chat or completions requests in the last minute.</td></tr>';
}
function render(data) { renderJobs(data); renderInteractive(data); if (data.fleet) renderWorkers(data); }  // the fleet: the operator's
render(JSON.parse(document.getElementById("state").textContent));
setInterval(() => fetch("/dashboard/data.json", {credentials: "same-origin"})
  .then(r => r.ok ? r.json() : null).then(d => d && render(d)).catch(() => {}), 2000);
