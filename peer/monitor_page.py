"""The monitor's dashboard page: one self-contained HTML document (plain JS and canvas,
nothing fetched from elsewhere) that polls ``/data.json`` and plots every series.

For tests and scripts the page says what it shows in data attributes: ``<body
data-updates>`` counts the answers it has drawn, each plot's ``data-points`` the points it
drew, ``data-series`` its name.
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
#status { color: #555; margin-bottom: 1em; }
#status.stale { color: #b00; }
#plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 1em; }
figure { margin: 0; background: #fff; border: 1px solid #ddd; border-radius: 4px; padding: .5em; }
figcaption { font-weight: 600; display: flex; justify-content: space-between; }
figcaption span { font-weight: 400; color: #555; }
canvas { width: 100%; height: 180px; display: block; }
</style></head>
<body data-updates="0" data-total="0">
<h1>swarmavg monitor: run <code>__RUN__</code></h1>
<div id="status">waiting for the first poll...</div>
<div id="plots"></div>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
const TITLES = {
  "peers": "peers", "trainers": "training processes", "epoch": "epoch",
  "samples_per_second": "samples/s (swarm)", "eta": "seconds to next step",
  "ignored_records": "ignored records"
};
const plots = new Map();

function plotFor(name) {
  let plot = plots.get(name);
  if (plot) return plot;
  const figure = document.createElement("figure");
  figure.className = "plot";
  figure.dataset.series = name;
  figure.dataset.points = "0";
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

function draw(plot, t, ys) {
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
  plot.last.textContent = pts.length ? fmt(pts[pts.length - 1][1]) : "-";
  if (!pts.length) return;
  const left = 56, bottom = 20, top = 6, right = 8;
  let x0 = t[0], x1 = t[t.length - 1];
  let y0 = Math.min(...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) { y0 -= 1; y1 += 1; }
  const X = x => left + (x - x0) / (x1 - x0) * (w - left - right);
  const Y = y => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);
  ctx.strokeStyle = "#ddd"; ctx.fillStyle = "#666"; ctx.font = "11px sans-serif";
  ctx.beginPath();
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    ctx.moveTo(left, Y(y)); ctx.lineTo(w - right, Y(y));
    ctx.fillText(fmt(y), 2, Y(y) + 4);
  }
  ctx.stroke();
  const span = x1 - x0;
  ctx.fillText(span >= 120 ? (span / 60).toFixed(0) + " min" : span.toFixed(0) + " s",
               w - right - 40, h - 4);
  ctx.strokeStyle = "#1f6feb"; ctx.lineWidth = 1.5;
  ctx.beginPath();
  pts.forEach((p, i) => i ? ctx.lineTo(X(p[0]), Y(p[1])) : ctx.moveTo(X(p[0]), Y(p[1])));
  ctx.stroke();
  if (pts.length === 1) {
    ctx.fillStyle = "#1f6feb";
    ctx.fillRect(X(pts[0][0]) - 2, Y(pts[0][1]) - 2, 4, 4);
  }
}

let updates = 0;
async function poll() {
  const status = document.getElementById("status");
  try {
    const answer = await fetch("data.json", {cache: "no-store"});
    if (!answer.ok) throw new Error("HTTP " + answer.status);
    const data = await answer.json();
    for (const [name, ys] of Object.entries(data.series)) draw(plotFor(name), data.t, ys);
    updates += 1;
    document.body.dataset.updates = String(updates);
    document.body.dataset.total = String(data.total);
    const newest = data.t.length ? data.t[data.t.length - 1] : null;
    const when = newest === null ? "never" : new Date(newest * 1000).toLocaleTimeString();
    status.className = "";
    status.textContent = data.points + " samples kept (" + data.total + " polls), last at " + when;
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
