// The Charon dashboard: status, charts over time, the request inspector, operations panels, state and SQL.
"use strict";
const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.hash.slice(1));
if (params.get("token")) { sessionStorage.setItem("charon-token", params.get("token")); }
$("token").value = sessionStorage.getItem("charon-token") || "";

class ApiError extends Error {
  constructor(status, type, message) { super(type + ": " + message); this.status = status; this.type = type; }
}

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  const token = $("token").value;
  if (token) headers["Authorization"] = "Bearer " + token;
  const init = { method, headers };
  if (body !== undefined) { headers["Content-Type"] = "application/json"; init.body = JSON.stringify(body); }
  let r;
  try { r = await fetch(path, init); } catch (e) { throw new ApiError(0, "NodeDown", "the node does not answer"); }
  let doc = null;
  try { doc = await r.json(); } catch (e) { /* a proxy's HTML error page */ }
  if (!r.ok) {
    const err = doc && doc.error;
    throw new ApiError(r.status, err ? err.type : "HTTP" + r.status, err ? err.message : r.statusText);
  }
  return doc;
}

const fmt = (v, d = 1) => (v === null || v === undefined) ? "-" : Number(v).toFixed(d);
const fmtBytes = (n) => n >= 1 << 20 ? (n / (1 << 20)).toFixed(0) + " MiB" : n >= 1024 ? (n / 1024).toFixed(0) + " KiB"
  : n + " bytes";
const clockOf = (ms) => new Date(ms).toTimeString().slice(0, 8);

// -- problems: an error stays listed (with when it began) until its condition clears -------------------------
const problems = new Map();  // key -> {message, since}
function problem(key, message) {
  const p = problems.get(key);
  if (!p || p.message !== message) problems.set(key, { message, since: p ? p.since : Date.now() });
  renderProblems();
}
function cleared(key) { if (problems.delete(key)) renderProblems(); }
function renderProblems() {
  const box = $("error");
  box.replaceChildren();
  for (const [key, p] of problems) {
    const row = document.createElement("div");
    row.dataset.problem = key;
    const t = document.createElement("time"); t.textContent = clockOf(p.since);
    row.append(t, document.createTextNode(p.message));
    if (key.startsWith("action:")) {  // an action's failure: kept until dismissed or the action succeeds
      const b = document.createElement("button"); b.textContent = "dismiss"; b.onclick = () => cleared(key);
      row.appendChild(b);
    }
    box.appendChild(row);
  }
}

// -- the connection: live, unauthorized, down; the numbers grey out ("last updated") when not live ------------
let lastLive = null;
function connection(err) {
  const banner = $("conn");
  if (!err) {
    lastLive = Date.now();
    banner.className = ""; banner.textContent = "";
    document.body.classList.remove("stale");
    $("last-updated").textContent = "";
    cleared("conn");
    return;
  }
  document.body.classList.add("stale");
  $("last-updated").textContent = lastLive ? "last updated " + clockOf(lastLive) : "never updated";
  if (err.status === 401 || err.status === 403) {
    banner.className = "unauthorized";
    banner.textContent = "Wrong or missing token: the server refuses it. Numbers below are not live.";
  } else if (err.status === 0) {
    banner.className = "down";
    banner.textContent = "The node is down (" + location.host + " does not answer). Numbers below are not live.";
  } else {
    banner.className = "failing";
    banner.textContent = "The node answers with errors. Numbers below are not live.";
  }
  problem("conn", String(err.message));
}

// -- status and summary ---------------------------------------------------------------------------------------
function bars(canvas, values, colors, labels) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const n = Math.max(values.length, 1), max = Math.max(1, ...values);
  const w = canvas.width / n;
  values.forEach((v, i) => {
    const h = (canvas.height - 14) * v / max;
    ctx.fillStyle = colors ? colors[i] : "#3b6fd4";
    ctx.fillRect(i * w + 1, canvas.height - h - 12, Math.max(1, w - 2), h);
    if (labels) { ctx.fillStyle = "#566"; ctx.font = "10px sans-serif"; ctx.fillText(labels[i], i * w + 2, canvas.height - 1); }
  });
}

function showStatus(st) {
  $("state").textContent = st.state;
  $("state").className = "state-" + st.state;
  $("epoch").textContent = st.epoch;
  $("backlog").textContent = st.backlog ?? ("? " + (st.log_error || "log unavailable"));
  const stuck = st.stuck;
  $("stuck").textContent = stuck ? `STUCK: ${stuck.operator}.${stuck.function} on key ${JSON.stringify(stuck.key)} ` +
    `for ${fmt(stuck.seconds)} s (budget ${stuck.budget_s} s)` : "";
}

// a version label as given ("v2", "2", "2024-05-01"): prefixed with "v" only when it is a bare number
const versionLabel = (v) => /^[0-9]/.test(String(v)) ? "v" + v : String(v);

// answers to requests sent before a token change, or older than one already shown, are dropped
let tokenGen = 0, sent = 0, shown = 0;
async function refresh() {
  const gen = tokenGen, mine = ++sent;
  let s, err = null;
  try { s = await api("GET", "/admin/summary"); } catch (e) { err = e; }
  if (gen !== tokenGen || mine < shown) return;
  shown = mine;
  if (err) { connection(err); return; }
  connection(null);
  showStatus(s.status);
  $("code").textContent = s.code.app + " " + versionLabel(s.code.version);
  $("window").textContent = s.window_s;
  $("throughput").textContent = fmt(s.throughput);
  $("aborts").textContent = fmt(s.aborts_per_s);
  $("p50").textContent = fmt(s.latency_ms.p50, 2);
  $("p90").textContent = fmt(s.latency_ms.p90, 2);
  $("p99").textContent = fmt(s.latency_ms.p99, 2);
  $("inflight").textContent = s.inflight;
  $("reasons").textContent = Object.entries(s.aborts).map(([k, v]) => k + " " + v).join(", ") || "-";
  const ep = s.epochs;
  bars($("timeline"), ep.map(e => e.duration_ms), ep.map(e => e.aborted > 0 ? "#d46b3b" : "#3b6fd4"));
  const last = ep[ep.length - 1];
  $("timeline-last").textContent = last ? `epoch ${last.epoch}: ${fmt(last.duration_ms, 2)} ms, ` +
    `${last.size} txns, ${last.rounds} rounds, ${last.deferred} deferred` : "-";
  bars($("load"), s.partition_load, null, s.partition_load.map((_, i) => "p" + i));
  if (s.code.version !== shownVersion) refreshCodeHistory();
}

// -- charts over time (GET /admin/metrics/history?since=: a reload redraws from the server's memory) ---------
const PALETTE = ["#d43b3b", "#d4873b", "#8a3bd4", "#3bb0d4", "#3bd46b", "#d43b9e", "#7a7a2a", "#2a7a6a"];
let samples = [], maxSamples = 900, historyBusy = false;
async function refreshHistory() {
  if (historyBusy) return;  // one at a time: each asks for what is newer than the last sample it has
  historyBusy = true;
  try {
    const since = samples.length ? samples[samples.length - 1].t : null;
    const doc = await api("GET", "/admin/metrics/history" + (since === null ? "" : "?since=" + since));
    maxSamples = doc.max_samples;
    const last = samples.length ? samples[samples.length - 1].t : -Infinity;
    samples = samples.concat(doc.samples.filter(x => x.t > last)).slice(-maxSamples);
    drawCharts();
  } catch (e) { /* the summary's refresh reports the connection */ }
  finally { historyBusy = false; }
}

function drawCharts() {
  const t = samples.map(s => s.t);
  const col = (f) => samples.map(f);
  lineChart($("chart-throughput"), t, [
    { name: "committed/s", color: "#3b6fd4", values: col(s => s.committed) },
    { name: "aborted/s", color: "#d43b3b", values: col(s => s.aborted) }], { title: "throughput" });
  lineChart($("chart-latency"), t, [
    { name: "p50", color: "#3b6fd4", values: col(s => s.p50_ms) },
    { name: "p99", color: "#d4873b", values: col(s => s.p99_ms) }], { title: "latency" });
  const types = [...new Set(samples.flatMap(s => Object.keys(s.aborts)))].sort();
  lineChart($("chart-aborts"), t, types.map((k, i) => (
    { name: k, color: PALETTE[i % PALETTE.length], values: col(s => s.aborts[k] || 0) })),
    { title: "aborts", empty: "no aborts" });
  lineChart($("chart-epochs"), t, [
    { name: "mean", color: "#3b6fd4", values: col(s => s.epoch_ms) },
    { name: "max", color: "#d4873b", values: col(s => s.epoch_max_ms) }], { title: "epoch duration" });
  lineChart($("chart-backlog"), t, [
    { name: "backlog", color: "#8a3bd4", values: col(s => s.backlog) },
    { name: "in flight", color: "#3bb0d4", values: col(s => s.inflight) }], { title: "backlog" });
  $("history-span").textContent = samples.length ? `${samples.length} s shown, up to ${maxSamples} s kept` : "none yet";
}

// -- the request inspector (GET /admin/requests, GET /admin/requests/{id}) ----------------------------------------
let reqCursor = null;
function reqQuery(cursor) {
  const q = new URLSearchParams();
  const set = (name, id) => { const v = $(id).value.trim(); if (v) q.set(name, v); };
  set("status", "req-status"); set("operator", "req-operator"); set("function", "req-function");
  set("key", "req-key"); set("error_type", "req-error"); set("epoch_min", "req-epoch-min");
  set("epoch_max", "req-epoch-max");
  q.set("limit", "50");
  if (cursor) q.set("cursor", cursor);
  return q;
}

async function searchRequests(more) {
  let doc;
  try { doc = await api("GET", "/admin/requests?" + reqQuery(more ? reqCursor : null).toString()); }
  catch (e) { problem("action:inspector", "inspector: " + e.message); return; }
  cleared("action:inspector");
  const body = $("req-list");
  if (!more) body.replaceChildren();
  for (const r of doc.items) {
    const tr = document.createElement("tr");
    tr.dataset.request = r.request_id;
    const cells = [r.request_id, r.status, r.operator + "." + r.function, r.key, r.error_type || "",
                   r.epoch === null ? "-" : String(r.epoch), r.replied_at ? clockOf(r.replied_at * 1000) : "-"];
    cells.forEach((text, i) => {
      const td = document.createElement("td"); td.textContent = text;
      if (i === 1) td.className = "st-" + r.status;
      tr.appendChild(td);
    });
    tr.addEventListener("click", () => showRequest(r.request_id, tr));
    body.appendChild(tr);
  }
  reqCursor = doc.next;
  $("req-more").disabled = !reqCursor;
  const ret = doc.retention || {};
  $("req-info").textContent = `${body.children.length} shown${reqCursor ? ", more older" : ""}; kept: ` +
    `${ret.max_records} requests / ${fmtBytes(ret.max_bytes)}` +
    (ret.oldest ? `, oldest ${clockOf(ret.oldest * 1000)}` : "");
}

function kvTable(pairs) {
  const div = document.createElement("div"); div.className = "kv";
  for (const [k, v] of pairs) {
    const a = document.createElement("span"); a.textContent = k;
    const b = document.createElement("span"); b.textContent = v;
    div.append(a, b);
  }
  return div;
}

function callGraph(nodes, id = "req-graph") {
  const children = new Map();
  for (const n of nodes) {
    const p = n.parent === null ? -1 : n.parent;
    if (!children.has(p)) children.set(p, []);
    children.get(p).push(n);
  }
  const build = (parent) => {
    const ul = document.createElement("ul");
    for (const n of children.get(parent) || []) {
      const li = document.createElement("li");
      li.dataset.node = n.index;
      li.textContent = `${n.kind} ${n.operator}/${n.key}.${n.function}` + (n.outcome ? ` → ${n.outcome}` : "");
      if (n.outcome === "raised") li.className = "raised";
      if (children.has(n.index)) li.appendChild(build(n.index));
      ul.appendChild(li);
    }
    return ul;
  };
  const root = build(-1); root.className = "graph"; if (id) root.id = id;
  return root;
}

async function showRequest(id, tr) {
  for (const row of $("req-list").children) row.classList.toggle("selected", row === tr);
  let d;
  try { d = await api("GET", "/admin/requests/" + encodeURIComponent(id)); }
  catch (e) { problem("action:inspector", "request " + id + ": " + e.message); return; }
  cleared("action:inspector");
  const box = $("req-detail");
  box.replaceChildren();
  const h = document.createElement("h3"); h.textContent = id; h.id = "req-detail-id"; box.appendChild(h);
  const t = (v) => v ? new Date(v * 1000).toISOString().slice(11, 23) : "-";
  box.appendChild(kvTable([
    ["status", d.status], ["call", `${d.operator}/${d.key}.${d.function}`],
    ["epoch, position", `${d.epoch ?? "-"}, ${d.position ?? "-"}`],
    ["accepted", t(d.accepted_at)], ["sequenced", t(d.sequenced_at)], ["replied", t(d.replied_at)],
    ["latency", d.accepted_at && d.replied_at ? fmt((d.replied_at - d.accepted_at) * 1000, 2) + " ms" : "-"]]));
  if (d.error) {
    const e = document.createElement("div"); e.id = "req-error-line"; e.className = "action-error";
    e.textContent = `${d.error.type}: ${d.error.message}`; box.appendChild(e);
    const tb = document.createElement("pre"); tb.id = "req-traceback";
    tb.textContent = d.error.traceback || "(no traceback recorded)"; box.appendChild(tb);
  } else {
    const r = document.createElement("pre"); r.id = "req-reply"; r.textContent = "reply: " + JSON.stringify(d.reply);
    box.appendChild(r);
  }
  const g = document.createElement("div"); g.className = "muted";
  g.textContent = "call graph" + (d.truncated ? " (truncated)" : ""); box.appendChild(g);
  box.appendChild(callGraph(d.call_graph || []));
}
$("req-go").addEventListener("click", () => searchRequests(false));
$("req-more").addEventListener("click", () => searchRequests(true));

// -- dead letters, effects, timers, streams, code history ---------------------------------------------------------
async function refreshDeadLetters() {
  try {
    const doc = await api("GET", "/admin/dead-letters?limit=20");
    const body = $("dead-letters");
    body.replaceChildren();
    for (const d of doc.dead_letters) {
      const tr = document.createElement("tr");
      tr.title = d.message;
      for (const text of [d.request_id, d.operator + "." + d.function, d.key, d.error_type, String(d.epoch)]) {
        const td = document.createElement("td"); td.textContent = text; tr.appendChild(td);
      }
      body.appendChild(tr);
    }
    $("dead-count").textContent = doc.dead_letters.length ? "newest first; hover a row for its message" : "none";
  } catch (e) { /* the runtime may have none (a gateway without engine); the summary reports the connection */ }
}

async function effectAction(id, action) {
  try { await api("POST", "/admin/effects/" + encodeURIComponent(id) + "/" + action, {}); cleared("action:effect"); }
  catch (e) { problem("action:effect", `effect ${id} ${action}: ${e.message}`); }
  refreshEffects();
}

async function refreshEffects() {
  let doc;
  try { doc = await api("GET", "/admin/effects?limit=20"); }
  catch (e) { if (e.status === 404) $("effects-section").style.display = "none"; return; }  // no executor here
  $("effects-section").style.display = "";
  $("effect-counts").textContent = Object.entries(doc.counts).map(([k, v]) => k + " " + v).join(", ");
  const body = $("effects");
  body.replaceChildren();
  for (const f of doc.effects) {
    const tr = document.createElement("tr");
    tr.dataset.effect = f.id;
    for (const text of [f.id, f.handler, f.status, f.attempts + "/" + f.max_attempts, f.last_error]) {
      const td = document.createElement("td"); td.textContent = text; tr.appendChild(td);
    }
    const td = document.createElement("td");
    const actions = f.status === "failed" ? ["retry", "abandon"] : f.status === "pending" ? ["abandon"] : [];
    for (const a of actions) {
      const b = document.createElement("button");
      b.textContent = a; b.className = "effect-" + a;
      b.addEventListener("click", () => effectAction(f.id, a));
      td.appendChild(b);
    }
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

// -- bulk operations (POST /admin/bulk/{resource}/{action}): a dry run counts, then Run follows every page -----
let bulkCounted = null;  // the target and filter the last count was for (Run needs the same)
function bulkRequest() {
  const where = {};
  for (const [field, id] of [["operator", "bulk-operator"], ["function", "bulk-function"], ["key_prefix", "bulk-key"],
                             ["error_type", "bulk-error"]]) {
    const v = $(id).value.trim();
    if (v) where[field] = v;
  }
  for (const [field, id] of [["since", "bulk-since"], ["until", "bulk-until"]]) {
    const v = $(id).value.trim();
    if (v) where[field] = Number(v);
  }
  return { target: $("bulk-target").value, where };
}
async function bulkPages(req, dryRun) {
  const op = "dash-" + Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 10);
  const total = { examined: 0, matched: 0, done: 0, skipped: {}, pages: 0 };
  let cursor = null;
  do {  // each page its own call: none holds the engine for more than a page
    const r = await fetch("/admin/bulk/" + req.target, {
      method: "POST",
      headers: { "Content-Type": "application/json", "Accept": "application/json", "Idempotency-Key": op,
                 ...($("token").value ? { "Authorization": "Bearer " + $("token").value } : {}) },
      body: JSON.stringify({ where: req.where, dry_run: dryRun, limit: 500, cursor }) });
    const doc = await r.json();
    if (!r.ok) throw new ApiError(r.status, doc.error.type, doc.error.message);
    for (const k of ["examined", "matched", "done"]) total[k] += doc[k];
    for (const [k, n] of Object.entries(doc.skipped)) total.skipped[k] = (total.skipped[k] || 0) + n;
    total.pages += 1;
    cursor = doc.next;
  } while (cursor !== null);
  total.operation = op;
  return total;
}
$("bulk-count").addEventListener("click", async () => {
  const req = bulkRequest();
  $("bulk-result").textContent = "counting...";
  try {
    const t = await bulkPages(req, true);
    bulkCounted = JSON.stringify(req);
    $("bulk-run").disabled = t.matched === 0;
    $("bulk-result").textContent = `${t.matched} match (of ${t.examined} looked at); nothing changed`;
  } catch (e) { bulkCounted = null; $("bulk-run").disabled = true; $("bulk-result").textContent = String(e); }
});
$("bulk-run").addEventListener("click", async () => {
  const req = bulkRequest();
  if (JSON.stringify(req) !== bulkCounted) { $("bulk-result").textContent = "the filter changed: count again"; return; }
  if (!confirm(`${req.target.replace("/", ": ")} what matches ${JSON.stringify(req.where)}?`)) return;
  $("bulk-run").disabled = true;
  $("bulk-result").textContent = "running...";
  try {
    const t = await bulkPages(req, false);
    const skipped = Object.keys(t.skipped).length ? `; skipped ${JSON.stringify(t.skipped)}` : "";
    $("bulk-result").textContent = `${t.done} done of ${t.matched} matched${skipped} (operation ${t.operation})`;
  } catch (e) { $("bulk-result").textContent = String(e); }
  bulkCounted = null;
  refreshEffects();
});
for (const id of ["bulk-target", "bulk-operator", "bulk-function", "bulk-key", "bulk-error", "bulk-since", "bulk-until"]) {
  $(id).addEventListener("input", () => { $("bulk-run").disabled = JSON.stringify(bulkRequest()) !== bulkCounted; });
}

function fillRows(body, rows) {
  body.replaceChildren();
  for (const cells of rows) {
    const tr = document.createElement("tr");
    for (const text of cells) { const td = document.createElement("td"); td.textContent = text; tr.appendChild(td); }
    body.appendChild(tr);
  }
}

$("timer-go").addEventListener("click", async () => {
  const op = $("timer-operator").value.trim(), key = $("timer-key").value.trim();
  try {
    const doc = await api("GET", `/timers/${encodeURIComponent(op)}/${encodeURIComponent(key)}`);
    fillRows($("timer-list"), doc.timers.map(t => [t.id, new Date(t.due * 1000).toISOString().slice(0, 19) + "Z",
                                                   t.function, JSON.stringify(t.args)]));
    $("timer-info").textContent = `${doc.timers.length} pending on ${op}/${key}`;
    cleared("action:timers");
  } catch (e) { problem("action:timers", "timers: " + e.message); }
});

let streamNext = null;
async function readStream(from) {
  const name = $("stream-name").value.trim();
  try {
    const doc = await api("GET", `/streams/${encodeURIComponent(name)}?from_offset=${from}&limit=50`);
    fillRows($("stream-list"), doc.events.map(e => [String(e.offset), String(e.epoch), JSON.stringify(e.value)]));
    streamNext = doc.next_offset;
    $("stream-next").disabled = doc.next_offset >= doc.end_offset;
    $("stream-info").textContent = `offsets ${doc.first_offset}..${doc.end_offset}; next ${doc.next_offset}`;
    cleared("action:streams");
  } catch (e) { problem("action:streams", "streams: " + e.message); }
}
$("stream-go").addEventListener("click", () => readStream(Number($("stream-from").value.trim() || 0)));
$("stream-next").addEventListener("click", () => readStream(streamNext));

let shownVersion = null;
async function refreshCodeHistory() {
  let doc;
  try { doc = await api("GET", "/admin/code/history"); } catch (e) { return; }
  shownVersion = doc.current;
  fillRows($("code-history"), doc.versions.slice().reverse().map(v => [
    versionLabel(v.version) + (v.version === doc.current ? " (current)" : ""), String(v.from_epoch),
    v.ref || "(as started)", v.migration || "-"]));
}

// the drain: workflows still in flight on each code version (charon workflows versions); after a deploy an old
// version's bar only shrinks; charon workflows migrate --from V moves them to the deployed one
async function refreshWorkflowVersions() {
  let doc;
  try { doc = await api("GET", "/admin/workflows/versions"); } catch (e) { return; }
  const body = $("wf-versions");
  body.replaceChildren();
  const rows = Object.entries(doc.versions);
  const most = Math.max(1, ...rows.map(([, c]) => c.running + c.waiting));
  for (const [version, c] of rows) {
    const tr = document.createElement("tr");
    tr.dataset.version = version;
    const label = versionLabel(version) + (version === doc.current ? " (current)" : "");
    for (const text of [label, String(c.running), String(c.waiting)]) {
      const td = document.createElement("td"); td.textContent = text; tr.appendChild(td);
    }
    const td = document.createElement("td");
    const bar = document.createElement("div");
    bar.className = "wf-bar";
    bar.style.cssText = "height:10px;background:" + (version === doc.current ? "#4a8" : "#d84") +
      ";width:" + Math.round(100 * (c.running + c.waiting) / most) + "px";
    td.appendChild(bar); tr.appendChild(td);
    body.appendChild(tr);
  }
  $("wf-names").replaceChildren(...Object.keys(doc.workflows).map((n) => {
    const o = document.createElement("option"); o.value = n; return o;
  }));
  $("wf-note").textContent = (rows.length ? "old versions drain as their workflows finish; migrate: charon " +
    "workflows migrate --from VERSION" : "no workflow in flight") + (doc.truncated ? " (counted in part)" : "");
}

// one workflow as a tree (GET /workflows/{name}/{id}/tree, charon workflows show --tree): its steps in order, each
// with its transaction's call graph while the inspector keeps it, and what it awaits now
const when = (t) => t ? new Date(t * 1000).toTimeString().slice(0, 8) : "-";
function stepNext(s) {
  if (s.awaits) return " → awaits " + s.awaits.kind + " " + (s.awaits.id || (s.awaits.ids || []).join(", "));
  if (s.finished) return " → " + s.finished;
  return s.migrated ? " → migrated " + s.migrated.join(" → ") : "";
}
function awaitedText(a) {
  let t = `awaiting ${a.kind} ${a.id}`;
  if (a.promise) t += `: ${a.promise.status}, deadline ${when(a.promise.deadline)}`;
  else if (a.effect) t += `: ${a.effect.status}, attempts ${a.effect.attempts}/${a.effect.max_attempts}` +
    (a.effect.last_error ? ", last error " + a.effect.last_error : "");
  else if (a.kind === "timer") t += ": due " + when(a.due);
  return t + (a.note ? ` (${a.note})` : "");
}
async function refreshWorkflowTree() {
  const name = $("wf-name").value.trim(), wid = $("wf-id").value.trim();
  if (!name || !wid) return;
  const box = $("wf-tree");
  let t;
  try {
    t = await api("GET", `/workflows/${encodeURIComponent(name)}/${encodeURIComponent(wid)}/tree`);
  } catch (e) { box.className = "action-error"; box.textContent = e.message; return; }
  box.className = "";
  const head = document.createElement("div");
  head.id = "wf-root";
  head.textContent = `${t.workflow} ${t.id}: ${t.status} at step ${t.step} (version ${t.version}, epoch ` +
    `${t.epoch}, updated ${when(t.updated)})` + (t.error ? " " + t.error : "") +
    (t.omitted ? ` (${t.omitted} earlier steps not shown)` : "");
  const ul = document.createElement("ul");
  ul.className = "graph";
  for (const s of t.steps) {
    const li = document.createElement("li");
    li.className = "wf-step"; li.dataset.step = s.step;
    li.textContent = `step ${s.step} seq ${s.seq} attempt ${s.attempt ?? "-"} tid ${s.tid}` + stepNext(s);
    if (s.call_graph) li.appendChild(callGraph(s.call_graph, null));
    else { const n = document.createElement("div"); n.className = "muted"; n.textContent = s.note; li.appendChild(n); }
    ul.appendChild(li);
  }
  for (const a of t.awaiting) {
    const li = document.createElement("li");
    li.className = "wf-await"; li.textContent = awaitedText(a);
    ul.appendChild(li);
  }
  box.replaceChildren(head, ul);
}
$("wf-form").addEventListener("submit", (e) => { e.preventDefault(); refreshWorkflowTree(); });

// -- pause / resume -------------------------------------------------------------------------------------------
async function control(path) {
  try { showStatus(await api("POST", path, {})); cleared("action:control"); }
  catch (e) { problem("action:control", path + ": " + e.message); }
}
$("pause").addEventListener("click", () => control("/admin/pause"));
$("resume").addEventListener("click", () => control("/admin/resume"));

// -- the state browser: pages read from the server (GET /admin/state ?after=&limit=&prefix=), every page of one
// browse at the epoch of its first page (one cut); Prev re-reads the previous page's cursor at that epoch --------
let browse = null;  // {op, keys, prefix, epoch, size, cursors: the after of each page up to the one shown, page}
let searchTimer = null;
async function browseRead(b, page) {
  const q = new URLSearchParams();
  if (b.keys.length) b.keys.forEach(k => q.append("key", k));
  else {
    q.set("limit", String(b.size));
    if (b.prefix) q.set("prefix", b.prefix);
    if (b.cursors[page] !== null) q.set("after", b.cursors[page]);
  }
  if (b.epoch !== null) q.set("epoch", String(b.epoch));
  try {
    const doc = await api("GET", "/admin/state/" + encodeURIComponent(b.op) + "?" + q.toString());
    if (browse !== b) return;  // a newer browse started meanwhile
    b.epoch = doc.epoch;
    b.page = page;
    b.cursors.length = page + 1;
    if (doc.next !== null && doc.next !== undefined) b.cursors.push(doc.next);
    renderBrowse(b, doc);
    cleared("action:state");
  } catch (e) {
    if (browse !== b) return;
    const hint = e.type === "EpochNotRetained" ? ` (the pages are read at epoch ${b.epoch}, which the engine no ` +
      "longer keeps: Read again for the latest state)" : "";
    problem("action:state", "state browser: " + e.message + hint);
  }
}
function renderBrowse(b, doc) {
  const keys = Object.keys(doc.entities), more = b.cursors.length > b.page + 1;
  const from = b.page * b.size + 1, to = b.page * b.size + keys.length;
  fillRows($("browse-result"), keys.map(k => [k, JSON.stringify(doc.entities[k]), JSON.stringify(doc.items[k] || {})]));
  $("browse-at").textContent = doc.epoch;
  $("browse-count").textContent = b.keys.length ? String(doc.count) : to + (more ? "+" : "");
  $("browse-page").textContent = !keys.length ? "no entities" : b.keys.length ? `${keys.length} of the keys given`
    : more ? `page ${b.page + 1} (${from}-${to}, more after)` : `page ${b.page + 1}, the last (${from}-${to} of ${to})`;
  $("browse-matching").textContent = b.prefix ? `, keys starting with ${b.prefix}` : "";
  $("browse-prev").disabled = b.page === 0;
  $("browse-next").disabled = !more;
}
function browseStart(epoch) {  // page 1 of a new browse (epoch null: the latest); the last browse's error goes
  clearTimeout(searchTimer);  // a search typed before this browse does not re-read the last one after it
  cleared("action:state");
  const keys = $("browse-keys").value.split(",").map(k => k.trim()).filter(k => k);
  browse = { op: $("browse-operator").value.trim(), keys, prefix: keys.length ? "" : $("browse-search").value.trim(), epoch,
             size: Number($("browse-size").value), cursors: [null], page: 0 };
  return browseRead(browse, 0);
}
function browseAgain() {  // the same cut from page 1: another search or page size
  if (!browse) return;
  browseStart(browse.epoch);
}
$("browse-prev").addEventListener("click", () => { if (browse && browse.page > 0) browseRead(browse, browse.page - 1); });
$("browse-next").addEventListener("click", () => {
  if (browse && browse.cursors.length > browse.page + 1) browseRead(browse, browse.page + 1);
});
$("browse-search").addEventListener("input", () => { clearTimeout(searchTimer); searchTimer = setTimeout(browseAgain, 200); });
$("browse-size").addEventListener("change", browseAgain);
$("browse-go").addEventListener("click", () => {
  const epoch = $("browse-epoch").value.trim();
  browseStart(epoch ? Number(epoch) : null);
});

// -- the SQL box --------------------------------------------------------------------------------------------
$("sql-go").addEventListener("click", async () => {
  const body = { sql: $("sql").value };
  if ($("sql-epoch").value.trim()) body.epoch = Number($("sql-epoch").value.trim());
  $("sql-error").textContent = "running...";
  try {
    const doc = await api("POST", "/admin/sql", body);
    $("sql-at").textContent = doc.epoch;
    $("sql-count").textContent = doc.rows.length + (doc.truncated ? "+" : "");
    $("sql-engine").textContent = doc.engine;
    const head = document.createElement("tr");
    for (const c of doc.columns) { const th = document.createElement("th"); th.textContent = c; head.appendChild(th); }
    $("sql-head").replaceChildren(head);
    fillRows($("sql-result"), doc.rows.map(r => r.map(v => typeof v === "string" ? v : JSON.stringify(v))));
    $("sql-error").textContent = "";
  } catch (e) {
    $("sql-error").textContent = String(e);
    $("sql-head").replaceChildren(); $("sql-result").replaceChildren();
    $("sql-at").textContent = "-"; $("sql-count").textContent = "0";
  }
});

// -- navigation and the refresh loops --------------------------------------------------------------------------
for (const b of document.querySelectorAll("nav button")) {
  b.addEventListener("click", () => {  // below the sticky top (header, banner, errors)
    const y = $(b.dataset.go).getBoundingClientRect().top + window.scrollY - $("top").offsetHeight - 8;
    window.scrollTo({ top: Math.max(0, y), behavior: "instant" });
  });
}
function refreshAll() {
  refresh(); refreshHistory(); refreshDeadLetters(); refreshEffects(); refreshCodeHistory(); refreshWorkflowVersions();
  refreshWorkflowTree();
}
$("token").addEventListener("change", () => {
  tokenGen += 1;
  sessionStorage.setItem("charon-token", $("token").value);
  refreshAll();
});

refreshAll();
setInterval(refresh, 500);
setInterval(refreshHistory, 1000);
setInterval(refreshDeadLetters, 2000);
setInterval(refreshEffects, 1000);
setInterval(refreshWorkflowVersions, 2000);
setInterval(refreshWorkflowTree, 2000);
