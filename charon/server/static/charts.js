// Line charts over time in plain SVG (no library, nothing fetched at runtime).
// lineChart(el, times, series, opts): times are Unix seconds; series is [{name, color, values}] (null = gap).
"use strict";
const SVGNS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function clock(t) {
  return new Date(t * 1000).toTimeString().slice(0, 8);
}

function lineChart(el, times, series, opts) {
  opts = opts || {};
  const W = 560, H = 170, L = 46, R = 8, T = 8, B = 34;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", "data-points": times.length,
                              role: "img", "aria-label": opts.title || "chart" });
  const values = series.flatMap(s => s.values.filter(v => v !== null && v !== undefined && isFinite(v)));
  const ymax = niceMax(Math.max(0, ...values));
  const t0 = times.length ? times[0] : 0, t1 = times.length ? times[times.length - 1] : 1;
  const span = Math.max(1, t1 - t0);
  const x = (t) => L + (W - L - R) * (t - t0) / span;
  const y = (v) => T + (H - T - B) * (1 - v / ymax);
  for (const f of [0, 0.5, 1]) {  // grid and y labels
    svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y(f * ymax), y2: y(f * ymax), class: "grid" }));
    svg.appendChild(svgEl("text", { x: L - 4, y: y(f * ymax) + 4, "text-anchor": "end", class: "axis" },
                          fmtAxis(f * ymax)));
  }
  if (times.length) {
    svg.appendChild(svgEl("text", { x: L, y: H - B + 14, class: "axis" }, clock(t0)));
    svg.appendChild(svgEl("text", { x: W - R, y: H - B + 14, "text-anchor": "end", class: "axis" }, clock(t1)));
  }
  if (!times.length || !series.length) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "axis" },
                          times.length ? (opts.empty || "none") : "no samples yet"));
  }
  let lx = L;
  series.forEach((s) => {
    let d = "", pen = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined || !isFinite(v)) { pen = false; return; }
      d += (pen ? "L" : "M") + x(times[i]).toFixed(1) + "," + y(v).toFixed(1);
      pen = true;
    });
    if (d) svg.appendChild(svgEl("path", { d, stroke: s.color, class: "line", "data-series": s.name }));
    const last = [...s.values].reverse().find(v => v !== null && v !== undefined);
    const label = `${s.name} ${last === undefined ? "-" : fmtAxis(last)}`;
    svg.appendChild(svgEl("rect", { x: lx, y: H - 12, width: 10, height: 4, fill: s.color }));
    svg.appendChild(svgEl("text", { x: lx + 13, y: H - 7, class: "legend" }, label));
    lx += 20 + label.length * 6.2;
  });
  el.replaceChildren(svg);
}

function fmtAxis(v) {
  if (v === 0) return "0";
  if (Math.abs(v) >= 1000) return (v / 1000).toFixed(1) + "k";
  if (Math.abs(v) >= 10) return v.toFixed(0);
  return v.toFixed(v >= 1 ? 1 : 2);
}
