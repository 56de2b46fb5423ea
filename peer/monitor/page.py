"""The monitor's dashboard page: one self-contained HTML document (plain JS and canvas,
nothing fetched from elsewhere) that polls ``/data.json`` and shows, top to bottom: warnings
(a round that split into several groups, a peer alone), a table of the run's peers, the
recent rounds with their group sizes and failures, and a chart per series with a wall-clock
time axis. A series whose newest value is older than its refresh (it was missing from the
last polls: the trainers stopped, say) is greyed and says "stale since HH:MM:SS"; when the
monitor itself stops answering or polling, the status line says so.

For tests and scripts the page says what it shows in data attributes: ``<body
data-updates>`` counts the answers it has drawn; each plot has ``data-series``,
``data-points`` (points drawn), ``data-axis`` (its time labels, JSON) and ``data-stale``
("1" when stale); each ``tr.peer`` has ``data-peer``; each ``tr.round`` ``data-key``,
``data-sizes`` (group sizes, JSON) and ``data-split``; each ``li.alert`` is one warning.
"""

from __future__ import annotations

import html

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarmavg monitor: __RUN__</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1em 2em; color: #222; background: #fafafa; }
h1 { font-size: 1.3em; margin: 0 0 .2em; }
h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
#status { color: #555; }
#status.stale { color: #b00; font-weight: 600; }
#alerts { list-style: none; padding: 0; margin: .6em 0; }
#alerts li { background: #fff1f0; border-left: 4px solid #d93025; padding: .35em .6em;
  margin-bottom: .3em; }
#alerts li.ok { background: #effaf1; border-color: #1e8e3e; }
table { border-collapse: collapse; background: #fff; border: 1px solid #ddd; font-size: 13px; }
th, td { padding: .25em .6em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f3f3f3; font-weight: 600; }
td.text, th.text { text-align: left; }
td.bad { color: #d93025; font-weight: 600; }
td.warn { color: #b06000; }
tr.alone td { background: #fff1f0; }
tr.split td.sizes { color: #d93025; font-weight: 700; }
#plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 1em; }
figure { margin: 0; background: #fff; border: 1px solid #ddd; border-radius: 4px; padding: .5em; }
figure.stale { opacity: .45; }
figcaption { font-weight: 600; display: flex; justify-content: space-between; }
figcaption span { font-weight: 400; color: #555; }
figure.stale figcaption span { color: #b00; }
canvas { width: 100%; height: 170px; display: block; }
.muted { color: #888; }
</style></head>
<body data-updates="0" data-total="0">
<h1>swarmavg monitor: run <code>__RUN__</code></h1>
<div id="status">waiting for the first poll...</div>
<ul id="alerts"></ul>
<h2>Peers</h2>
<table id="peers"><thead><tr>
<th class="text">peer</th><th class="text">address</th><th class="text">reachability</th>
<th>trainers</th><th>epoch</th><th>samples/s</th><th>last seen</th>
<th>rounds done</th><th>partial</th><th>failed</th><th class="text">last round</th>
</tr></thead><tbody></tbody></table>
<h2>Recent rounds</h2>
<table id="rounds"><thead><tr>
<th class="text">ended</th><th class="text">round</th><th class="text">group sizes</th>
<th>done</th><th>partial</th><th>failed</th><th class="text">failures</th>
</tr></thead><tbody></tbody></table>
<h2>Over time</h2>
<div id="plots"></div>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
const TITLES = {
  "peers": "peers", "trainers": "training processes", "epoch": "epoch",
  "samples_per_second": "samples/s (swarm)", "eta": "seconds to next step",
  "rounds_done": "rounds done (all peers)", "rounds_partial": "partial rounds (all peers)",
  "rounds_failed": "failed rounds (all peers)", "ignored_records": "ignored records"
};
const plots = new Map();

function clock(t) { return new Date(t * 1000).toTimeString().slice(0, 8); }

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.append(td);
  return td;
}

function plotFor(name) {
  let plot = plots.get(name);
  if (plot) return plot;
  const figure = document.createElement("figure");
  figure.className = "plot";
  figure.dataset.series = name;
  figure.dataset.points = "0";
  figure.dataset.stale = "0";
  const caption = document.createElement("figcaption");
  const title = document.createElement("b");
  title.textContent = TITLES[name] || name.replace(/^metric\\//, "");
  const last = document.createElement("span");
  caption.append(title, last);
  const canvas = document.createElement("canvas");
  figure.append(caption, canvas);
  document.getElementById("plots").append(figure);
  plot = {figure, canvas, last};
  plots.set(name, plot);
  return plot;
}

function fmt(v) {
  if (v === null || v === undefined) return "-";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(3);
  return Number.isInteger(v) ? String(v) : v.toPrecision(4);
}

function draw(plot, t, ys, stale, updated) {
  const canvas = plot.canvas;
  const ratio = window.devicePixelRatio || 1;
  const w = Math.max(canvas.clientWidth, 200), h = Math.max(canvas.clientHeight, 100);
  canvas.width = w * ratio; canvas.height = h * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const pts = [];
  for (let i = 0; i < ys.length; i++) if (ys[i] !== null) pts.push([t[i], ys[i]]);
  plot.figure.dataset.points = String(pts.length);
  plot.figure.dataset.stale = stale ? "1" : "0";
  plot.figure.classList.toggle("stale", stale);
  const value = pts.length ? fmt(pts[pts.length - 1][1]) : "-";
  plot.last.textContent = stale ? value + " (stale since " + clock(updated) + ")" : value;
  if (!t.length) return;
  const left = 56, bottom = 22, top = 6, right = 12;
  let x0 = t[0], x1 = t[t.length - 1];
  if (x1 <= x0) x1 = x0 + 1;
  let y0 = pts.length ? Math.min(...pts.map(p => p[1])) : 0;
  let y1 = pts.length ? Math.max(...pts.map(p => p[1])) : 1;
  if (y1 <= y0) { y0 -= 1; y1 += 1; }
  const X = x => left + (x - x0) / (x1 - x0) * (w - left - right);
  const Y = y => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);
  ctx.strokeStyle = "#e4e4e4"; ctx.fillStyle = "#666"; ctx.font = "11px sans-serif";
  ctx.beginPath();
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    ctx.moveTo(left, Y(y)); ctx.lineTo(w - right, Y(y));
    ctx.fillText(fmt(y), 2, Y(y) + 4);
  }
  // the time axis: wall-clock labels at evenly spaced instants, one tick each
  const ticks = w < 320 ? 3 : 4, labels = [];
  ctx.textAlign = "center";
  for (let i = 0; i < ticks; i++) {
    const x = x0 + (x1 - x0) * i / (ticks - 1), label = clock(x);
    labels.push(label);
    ctx.moveTo(X(x), top); ctx.lineTo(X(x), h - bottom + 3);
    const at = Math.min(Math.max(X(x), left + 22), w - right - 22);
    ctx.fillText(label, at, h - 6);
  }
  ctx.stroke();
  ctx.textAlign = "start";
  plot.figure.dataset.axis = JSON.stringify(labels);
  if (!pts.length) return;
  ctx.strokeStyle = stale ? "#999" : "#1f6feb"; ctx.lineWidth = 1.5;
  ctx.beginPath();
  pts.forEach((p, i) => i ? ctx.lineTo(X(p[0]), Y(p[1])) : ctx.moveTo(X(p[0]), Y(p[1])));
  ctx.stroke();
  if (pts.length === 1) {
    ctx.fillStyle = ctx.strokeStyle;
    ctx.fillRect(X(pts[0][0]) - 2, Y(pts[0][1]) - 2, 4, 4);
  }
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  return seconds < 90 ? seconds.toFixed(0) + " s ago" : (seconds / 60).toFixed(0) + " min ago";
}

function fillTable(id, items, fillRow, empty, columns) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren();
  for (const item of items) {
    const tr = document.createElement("tr");
    fillRow(tr, item);
    body.append(tr);
  }
  if (!items.length) cell(body.insertRow(), empty, "text muted").colSpan = columns;
}

function peerRow(tr, p) {
  tr.className = "peer" + (p.alone ? " alone" : "");
  tr.dataset.peer = p.peer_id;
  cell(tr, p.peer_id.slice(0, 12), "text");
  cell(tr, p.address || "-", "text");
  cell(tr, p.reachability, "text" + (p.reachability === "public" ? "" : " warn"));
  cell(tr, String(p.trainers));
  cell(tr, p.epoch === null ? "-" : String(p.epoch));
  cell(tr, p.samples_per_second === null ? "-" : fmt(p.samples_per_second));
  cell(tr, ago(p.last_seen));
  cell(tr, p.rounds_done === null ? "-" : String(p.rounds_done));
  cell(tr, p.rounds_partial === null ? "-" : String(p.rounds_partial),
       p.rounds_partial ? "warn" : "");
  const reasons = Object.entries(p.failures).map(([k, n]) => k + " " + n).join(", ");
  const failed = p.rounds_failed === null ? "-" : String(p.rounds_failed);
  cell(tr, reasons ? failed + " (" + reasons + ")" : failed, p.rounds_failed ? "bad" : "");
  const r = p.last_round;
  cell(tr, r === null ? "-" : r.key + ": " + (r.outcome === "failed" ? "failed, " + r.reason
       : r.outcome + ", group of " + r.size) + " at " + clock(r.time),
       "text" + (r && r.outcome === "failed" ? " bad" : ""));
}

function roundRow(tr, r) {
  tr.className = "round" + (r.split ? " split" : "");
  tr.dataset.key = r.key;
  tr.dataset.sizes = JSON.stringify(r.group_sizes);
  tr.dataset.split = r.split ? "1" : "0";
  cell(tr, clock(r.time), "text");
  cell(tr, r.key, "text");
  const sizes = r.group_sizes.length ? r.group_sizes.join(" + ") : "no group";
  cell(tr, r.split ? sizes + "  (split!)" : sizes, "text sizes");
  cell(tr, String(r.done));
  cell(tr, String(r.partial), r.partial ? "warn" : "");
  cell(tr, String(r.failed), r.failed ? "bad" : "");
  cell(tr, Object.entries(r.failures).map(([k, n]) => k + " " + n).join(", ") || "-", "text");
}

function showAlerts(lines) {
  const list = document.getElementById("alerts");
  list.replaceChildren();
  for (const line of lines) {
    const li = document.createElement("li");
    li.className = "alert";
    li.textContent = line;
    list.append(li);
  }
  if (!lines.length) {
    const li = document.createElement("li");
    li.className = "ok";
    li.textContent = "no split round, no peer alone";
    list.append(li);
  }
}

let updates = 0;
async function poll() {
  const status = document.getElementById("status");
  try {
    const answer = await fetch("data.json", {cache: "no-store"});
    if (!answer.ok) throw new Error("HTTP " + answer.status);
    const data = await answer.json();
    const newest = data.t.length ? data.t[data.t.length - 1] : null;
    // a series is stale when it missed more than its refresh: the newest poll and the
    // one before did not carry it (one missed lookup is not yet news)
    const staleAfter = 1.5 * data.interval;
    for (const [name, ys] of Object.entries(data.series)) {
      const updated = data.updated[name];
      draw(plotFor(name), data.t, ys, newest - updated > staleAfter, updated);
    }
    if (data.health && data.health.peers) {
      fillTable("peers", data.health.peers, peerRow, "no peer seen yet", 11);
      fillTable("rounds", data.health.rounds, roundRow,
                "no round reported yet (daemons report theirs after each round)", 7);
      showAlerts(data.health.alerts);
    }
    updates += 1;
    document.body.dataset.updates = String(updates);
    document.body.dataset.total = String(data.total);
    const silent = newest === null ? 0 : data.now - newest;
    if (newest !== null && silent > 3 * data.interval + 5) {
      status.className = "stale";
      status.textContent = "no poll of the run since " + clock(newest) +
        " (the DHT does not answer the monitor); everything below is stale";
    } else {
      status.className = "";
      status.textContent = data.points + " samples kept (" + data.total + " polls, every " +
        data.interval + " s), last at " + (newest === null ? "never" : clock(newest));
    }
  } catch (err) {
    status.className = "stale";
    status.textContent = "cannot reach the monitor (" + err.message + "); retrying";
  }
  setTimeout(poll, POLL_MS);
}
poll();
</script>
</body></html>
"""


def render_page(run_id: str, poll_seconds: float) -> str:
    """The page for ``run_id``, polling every ``poll_seconds`` (at least 0.2 s)."""
    return PAGE.replace("__RUN__", html.escape(run_id)).replace(
        "__POLL_MS__", str(max(int(poll_seconds * 1000), 200))
    )
