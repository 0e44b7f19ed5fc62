// clmq dashboard: a hash-routed page per view, every number from /api/ (the admin API).
"use strict";

const REFRESH_MS = 2000;
let timer = null;
let charts = [];

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function num(v) { return typeof v === "number" ? v.toLocaleString("en-US", {maximumFractionDigits: 1}) : esc(v); }
async function api(path) {
  // Against the page's address without any user:password@ in it (fetch refuses such
  // URLs); the browser sends the login the page was opened with (HTTP Basic) itself.
  const r = await fetch(new URL("api/" + path, location.origin + location.pathname));
  const doc = await r.json();
  if (!r.ok) throw new Error(doc.error || r.statusText);
  return doc;
}
function table(cols, rows, numeric = []) {
  const head = cols.map(c => `<th>${esc(c)}</th>`).join("");
  const body = rows.map(r => "<tr>" + r.map((v, i) => `<td class="${numeric.includes(i) ? "num" : ""}">${typeof v === "number" ? num(v) : v}</td>`).join("") + "</tr>").join("");
  return `<table><tr>${head}</tr>${body}</table>`;
}
function chart(el, title, times, series) {
  const data = [times.map(t => t / 1000), ...series.map(s => s.values)];
  const opts = {title, width: 560, height: 220, series: [{}, ...series.map(s => ({label: s.label, stroke: s.color, width: 2}))],
                scales: {x: {time: true}}, axes: [{}, {size: 70}]};
  const div = document.createElement("div");
  div.className = "chart";
  el.appendChild(div);
  charts.push(new uPlot(opts, data, div));
}
function params() { return new URLSearchParams(location.hash.split("?")[1] || ""); }

const pages = {
  async brokers(el) {
    const doc = await api("overview");
    const rows = doc.brokers.map(b => [esc(b.group), b.broker_id, esc(b.addr), esc(b.role), b.epoch, b.info.messages_in_per_s ?? "-",
      b.info.messages_out_per_s ?? "-", b.info.store_bytes ?? "-", b.info.connections ?? "-", esc(b.info.version ?? "")]);
    el.innerHTML = `<h2>Brokers</h2>` + table(["group", "id", "address", "role", "epoch", "msgs in/s", "msgs out/s", "store bytes",
      "connections", "version"], rows, [1, 4, 5, 6, 7, 8]) + `<h2>Rates (all brokers)</h2><div id="charts"></div>`;
    const h = doc.history;
    chart(el.querySelector("#charts"), "messages per second", h.map(x => x.t),
          [{label: "in", values: h.map(x => x.messages_in_per_s), color: "#1f77b4"},
           {label: "out", values: h.map(x => x.messages_out_per_s), color: "#ff7f0e"}]);
    chart(el.querySelector("#charts"), "bytes per second", h.map(x => x.t),
          [{label: "in", values: h.map(x => x.bytes_in_per_s), color: "#2ca02c"},
           {label: "out", values: h.map(x => x.bytes_out_per_s), color: "#d62728"}]);
    if (doc.sampler_error) el.insertAdjacentHTML("beforeend", `<p class="error">sampler: ${esc(doc.sampler_error)}</p>`);
  },
  async topics(el) {
    const name = params().get("name");
    if (name) {
      const doc = await api("topic?name=" + encodeURIComponent(name));
      el.innerHTML = `<h2>Topic ${esc(name)}</h2>` + table(["broker", "queue", "min offset", "max offset", "messages", ""],
        doc.queues.map(q => [esc(q.broker_name), q.queue_id, q.min_offset, q.max_offset, q.max_offset - q.min_offset,
          `<a href="#/messages?topic=${encodeURIComponent(name)}&queue=${q.queue_id}&offset=${q.min_offset}">browse</a>`]), [1, 2, 3, 4]);
      return;
    }
    const doc = await api("topics");
    el.innerHTML = `<h2>Topics</h2>` + table(["topic", "queues per broker"], Object.entries(doc.topics).map(([t, by]) =>
      [`<a href="#/topics?name=${encodeURIComponent(t)}">${esc(t)}</a>`, esc(Object.entries(by).map(([b, n]) => `${b}: ${n}`).join(", "))]));
  },
  async groups(el) {
    const name = params().get("name");
    if (name) {
      const doc = await api("group?name=" + encodeURIComponent(name));
      const dead = await api("deadletters?group=" + encodeURIComponent(name));
      const popOnly = doc.pop_queues.length > 0 && !doc.queues.length && !doc.members.length;  // a group that only pops
      el.innerHTML = `<h2>Group ${esc(name)}: total lag <span class="lag">${num(doc.lag + doc.pop_totals.lag)}</span></h2>` +
        `<p>retry backlog <span class="retry">${num(doc.retry_backlog)}</span>, dead letters <span class="dlq">${num(doc.dead_letters)}</span></p>` +
        (popOnly ? "" : table(["broker", "topic", "queue", "committed", "max offset", "lag"], doc.queues.map(q =>
          [esc(q.broker_name), esc(q.topic), q.queue_id, q.committed, q.max_offset, `<span class="${q.lag ? "lag" : "ok"}">${num(q.lag)}</span>`]), [2, 3, 4, 5]) +
        `<h2>Members</h2>` + (doc.members.length ? table(["client id", "mode", "topics"], doc.members.map(m =>
          [esc(m.client_id), esc(m.mode), esc(m.topics.join(", "))])) : "<p>none connected</p>")) + popSection(doc) +
        `<h2>Lag trend</h2><div id="charts"></div>`;
      chart(el.querySelector("#charts"), "lag (messages)", doc.trend.map(x => x.t), [{label: "lag", values: doc.trend.map(x => x.lag), color: "#b03a2e"}]);
      el.insertAdjacentHTML("beforeend", `<h2>Dead letters</h2>` + (dead.messages.length ? table(["broker", "offset", "msg id",
        "origin topic", "origin queue", "attempts", "body"], dead.messages.map(m => [esc(m.broker_name), m.queue_offset, esc(m.msg_id),
        esc(m.origin_topic), m.origin_queue_id, m.reconsume_times, `<span class="body">${esc((m.body ?? ("base64:" + m.body_base64)).slice(0, 80))}</span>`]),
        [1, 4, 5]) + "<p>clmq dlq resend sends them again</p>" : "<p>none</p>"));
      return;
    }
    const doc = await api("groups");
    el.innerHTML = `<h2>Consumer groups</h2>` + table(["group", "lag", "members", "queues", "retry backlog", "dead letters",
      "in flight (POP)", "redelivering (POP)"], doc.groups.map(g =>
      [`<a href="#/groups?name=${encodeURIComponent(g.group)}">${esc(g.group)}</a>`, g.lag, g.members, g.queues, g.retry_backlog,
       `<span class="${g.dead_letters ? "dlq" : "ok"}">${num(g.dead_letters)}</span>`, g.pop ? g.inflight : "-",
       g.pop ? `<span class="${g.redelivering ? "retry" : "ok"}">${num(g.redelivering)}</span>` : "-"]), [1, 2, 3, 4, 5, 6, 7]);
  },
  async messages(el) {
    const p = params();
    el.innerHTML = `<h2>Messages</h2>
      <form id="browse">queue: <input name="topic" placeholder="topic" value="${esc(p.get("topic") || "")}">
        <input name="queue" type="number" min="0" placeholder="queue" value="${esc(p.get("queue") || "0")}">
        <input name="offset" type="number" min="0" placeholder="offset" value="${esc(p.get("offset") || "0")}">
        <button>read</button></form>
      <form id="byid">by id: <input name="id" size="40" placeholder="host:port@HEXOFFSET" value="${esc(p.get("id") || "")}"><button>get</button></form>
      <form id="bykey">by key: <input name="topic" placeholder="topic" value="${esc(p.get("ktopic") || "")}">
        <input name="key" placeholder="key" value="${esc(p.get("key") || "")}"><button>find</button></form>
      <div id="found"></div>`;
    const go = (f, hash) => f.addEventListener("submit", e => { e.preventDefault(); location.hash = hash(new FormData(f)); });
    go(el.querySelector("#browse"), d => `#/messages?topic=${encodeURIComponent(d.get("topic"))}&queue=${d.get("queue")}&offset=${d.get("offset")}`);
    go(el.querySelector("#byid"), d => `#/messages?id=${encodeURIComponent(d.get("id"))}`);
    go(el.querySelector("#bykey"), d => `#/messages?ktopic=${encodeURIComponent(d.get("topic"))}&key=${encodeURIComponent(d.get("key"))}`);
    let doc = null;
    if (p.get("id")) doc = await api("message?id=" + encodeURIComponent(p.get("id")));
    else if (p.get("key")) doc = await api(`find?topic=${encodeURIComponent(p.get("ktopic"))}&key=${encodeURIComponent(p.get("key"))}`);
    else if (p.get("topic")) doc = await api(`messages?topic=${encodeURIComponent(p.get("topic"))}&queue=${p.get("queue")}&offset=${p.get("offset") || 0}&count=20`);
    if (!doc) return;
    el.querySelector("#found").innerHTML = table(["topic", "queue", "offset", "stored", "tags", "keys", "properties", "body"],
      doc.messages.map(m => [esc(m.topic), m.queue_id, m.queue_offset, esc(m.store_time), esc(m.tags), esc(m.keys),
        esc(Object.entries(m.properties).map(([k, v]) => `${k}=${v}`).join(" ")), `<span class="body">${esc(m.body ?? ("base64:" + m.body_base64))}</span>`]), [1, 2]) +
      (doc.complete === false ? `<p>scanned ${num(doc.scanned)} messages; older ones not searched</p>` : "");
    if (p.get("id")) await traceOf(el.querySelector("#found"), "id=" + encodeURIComponent(p.get("id")));
  },
};

// A POP group's state (docs/consuming.md, "Queue-based or POP?"): per queue, the members, the counts.
function popSection(doc) {
  if (!doc.pop_queues || !doc.pop_queues.length) return "";
  const t = doc.pop_totals;
  return `<h2>POP: in flight <span class="pop-inflight">${num(t.inflight)}</span>, redelivering <span class="retry">${num(t.redelivering)}</span></h2>` +
    table(["broker", "topic", "queue", "next offset", "settled offset", "max offset", "lag", "in flight", "redelivering"],
      doc.pop_queues.map(r => [esc(r[0]), esc(r[1]), r[2], r[3], r[4], r[5], `<span class="${r[6] ? "lag" : "ok"}">${num(r[6])}</span>`,
        r[7], `<span class="${r[8] ? "retry" : "ok"}">${num(r[8])}</span>`]), [2, 3, 4, 5, 6, 7, 8]) +
    `<p class="pop-counts">since the leader started: popped ${num(t.popped)}, acked ${num(t.acked)}, expired acks (refused) ${num(t.ack_expired)}, ` +
    `redelivered ${num(t.redelivered)}, dead-lettered ${num(t.dead_lettered)}</p>` +
    `<p>POP members: ${t.members.length ? esc(t.members.join(", ")) : "none popped lately"}</p>`;
}

// A message's life (docs/traces.md): its trace events as a timeline under the message.
async function traceOf(el, query) {
  const tr = await api("trace?" + query);
  el.insertAdjacentHTML("beforeend", `<h3>Trace</h3>` + (tr.rows.length
    ? `<div class="trace">` + table(["time", "+ms", "event", "by", "where", "attempt", "msg id", "detail"],
        tr.rows.map(r => [esc(r[0]), r[1], `<span class="event ${esc(r[2])}">${esc(r[2])}</span>`, esc(r[3]), esc(r[4]), r[5], esc(r[6]), esc(r[7])]),
        [1, 5]) + `</div>` + (tr.complete ? "" : `<p>older events may exist (a bound was hit)</p>`)
    : `<p class="none">no trace events (sent or consumed without trace=True, or older than trace_retention_ms)</p>`));
}

async function show() {
  const page = (location.hash.match(/^#\/(\w+)/) || [null, "brokers"])[1];
  document.querySelectorAll("nav a").forEach(a => a.classList.toggle("active", a.dataset.page === page));
  const el = document.getElementById("page");
  charts.forEach(c => c.destroy());
  charts = [];
  try {
    await (pages[page] || pages.brokers)(el);
    document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    el.innerHTML = `<p class="error">${esc(e.message)}</p>`;
  }
  document.body.dataset.ready = page;  // for tests and screenshots: this page has rendered
  clearTimeout(timer);
  if (page !== "messages") timer = setTimeout(show, REFRESH_MS);
}
window.addEventListener("hashchange", show);
show();
