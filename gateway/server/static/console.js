// kvgate console: polls /console/state.json, keeps the time series in the browser (the gateway
// keeps none for the console), redraws the charts (uPlot) and the live tables.
"use strict";
(function () {
  const POLL_MS = 2000;
  const KEEP = 900; // samples kept: 30 min at one every 2 s
  const page = document.body.dataset.page;
  const history = []; // [{t, samples}]
  const charts = {};
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#4b5563"];

  function sum(samples, name, filter) {
    let total = 0;
    for (const [labels, v] of samples[name] || []) {
      if (!filter || Object.entries(filter).every(([k, want]) => labels[k] === want)) total += v;
    }
    return total;
  }
  function byLabel(samples, name, label, filter) {
    const out = {};
    for (const [labels, v] of samples[name] || []) {
      if (filter && !Object.entries(filter).every(([k, want]) => labels[k] === want)) continue;
      const key = labels[label] || "";
      out[key] = (out[key] || 0) + v;
    }
    return out;
  }
  function fmt(v, percent) {
    if (v === undefined || v === null || Number.isNaN(v)) return "–";
    if (percent) return (v * 100).toFixed(1) + "%";
    return Number.isInteger(v) || Math.abs(v) >= 100 ? Math.round(v).toLocaleString("en") : v.toPrecision(3);
  }
  function money(v) {
    if (v === undefined || v === null || Number.isNaN(v)) return "–";
    if (Math.abs(v) >= 1) return "$" + v.toLocaleString("en", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
    return v ? "$" + Number(v.toPrecision(4)).toString() : "$0";
  }
  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }
  function fillTable(name, rows) {
    const table = document.querySelector(`table[data-live="${name}"] tbody`);
    if (!table) return;
    table.innerHTML = rows.length
      ? rows.map((r) => "<tr>" + r.map((c) => `<td>${c}</td>`).join("") + "</tr>").join("")
      : '<tr><td class="empty" colspan="99">nothing yet</td></tr>';
  }

  // series: {label: [values aligned with xs]}
  function draw(name, xs, series, percent) {
    const el = document.querySelector(`[data-chart="${name}"]`);
    if (!el) return;
    const labels = Object.keys(series).sort();
    const data = [xs, ...labels.map((l) => series[l])];
    const key = labels.join("\u0000");
    let chart = charts[name];
    if (!chart || chart.key !== key) {
      if (chart) chart.plot.destroy();
      const opts = {
        width: Math.max(el.clientWidth, 320),
        height: 220,
        series: [{}, ...labels.map((l, i) => ({ label: l, stroke: COLORS[i % COLORS.length], width: 2 }))],
        axes: [{}, { size: 70, values: (u, ticks) => ticks.map((t) => fmt(t, percent)) }],
      };
      chart = charts[name] = { key, plot: new uPlot(opts, data, el) };
    } else {
      chart.plot.setData(data);
    }
    el.dataset.points = String(xs.length);
  }

  // per-interval rates between consecutive samples of a counter (by a label)
  function rates(name, label, filter) {
    const xs = [], series = {};
    for (let i = 1; i < history.length; i++) {
      const a = history[i - 1], b = history[i];
      const dt = b.t - a.t;
      if (dt <= 0) continue;
      const before = byLabel(a.samples, name, label, filter), after = byLabel(b.samples, name, label, filter);
      xs.push(b.t);
      for (const k of Object.keys(after)) {
        if (!series[k]) series[k] = new Array(xs.length - 1).fill(null);
      }
      for (const k of Object.keys(series)) series[k].push(Math.max(0, ((after[k] || 0) - (before[k] || 0)) / dt));
    }
    return [xs, series];
  }
  function gauges(name, label) {
    const xs = [], series = {};
    history.forEach((h, i) => {
      xs.push(h.t);
      const values = byLabel(h.samples, name, label);
      for (const k of Object.keys(values)) if (!series[k]) series[k] = new Array(i).fill(null);
      for (const k of Object.keys(series)) series[k].push(values[k] === undefined ? null : values[k]);
    });
    return [xs, series];
  }

  function fleet(now) {
    const healthy = byLabel(now, "kvgate_replica_healthy", "replica");
    const cols = ["kvgate_replica_inflight", "kvgate_replica_pending_prefill_tokens", "kvgate_engine_num_waiting",
      "kvgate_engine_num_running", "kvgate_engine_kv_usage", "kvgate_replica_requests_total"];
    const values = cols.map((c) => byLabel(now, c, "replica"));
    fillTable("replicas", Object.keys(healthy).sort().map((r) => [esc(r), healthy[r] ? "up" : "down",
      ...values.map((v, i) => fmt(v[r], cols[i] === "kvgate_engine_kv_usage"))]));
    draw("inflight", ...gauges("kvgate_replica_inflight", "replica"));
    draw("attempts", ...rates("kvgate_replica_requests_total", "replica"));
  }

  function routing(now) {
    const xs = [], hit = { "engines reported": [], "directory predicted": [] };
    for (let i = 1; i < history.length; i++) {
      const a = history[i - 1].samples, b = history[i].samples;
      const prompt = sum(b, "kvgate_tenant_tokens_total", { kind: "prompt" }) - sum(a, "kvgate_tenant_tokens_total", { kind: "prompt" });
      xs.push(history[i].t);
      for (const [label, source] of [["engines reported", "engine"], ["directory predicted", "predicted"]]) {
        const cached = sum(b, "kvgate_cached_tokens_total", { source }) - sum(a, "kvgate_cached_tokens_total", { source });
        hit[label].push(prompt > 0 ? cached / prompt : null);
      }
    }
    draw("hit", xs, hit, true);
    draw("decisions", ...rates("kvgate_routing_decisions_total", "reason"));
    fillTable("decisions", (now["kvgate_routing_decisions_total"] || []).map(([l, v]) => [esc(l.policy), esc(l.reason), fmt(v)]));
    fillTable("hot", (now["kvgate_hot_prefix_replicas"] || []).map(([l, v]) => [esc(l.prefix), fmt(v)]));
    const lookups = byLabel(now, "kvgate_directory_lookups_total", "source");
    fillTable("lookups", Object.keys(lookups).sort().map((k) => [esc(k), fmt(lookups[k])]));
    const holds = document.querySelector('[data-live="holds"]');
    if (holds) holds.textContent = fmt(sum(now, "kvgate_fanout_holds_total"));
  }

  function tenants(now) {
    const windowS = Number((document.getElementById("window") || { value: "0" }).value);
    const last = history[history.length - 1];
    let base = null;
    if (windowS > 0) base = history.find((h) => h.t >= last.t - windowS) || history[0];
    const totals = {};
    for (const [l, v] of now["kvgate_tenant_tokens_total"] || []) {
      (totals[l.tenant] = totals[l.tenant] || {})[l.kind] = v;
    }
    if (base) {
      for (const [l, v] of base.samples["kvgate_tenant_tokens_total"] || []) {
        if (totals[l.tenant]) totals[l.tenant][l.kind] = (totals[l.tenant][l.kind] || 0) - v;
      }
    }
    // spend and what the same exchanges cost without caching, over the same window
    const cost = {};
    for (const [l, v] of now["kvgate_tenant_cost_dollars_total"] || []) {
      (cost[l.tenant] = cost[l.tenant] || {})[l.basis] = v;
    }
    if (base) {
      for (const [l, v] of base.samples["kvgate_tenant_cost_dollars_total"] || []) {
        if (cost[l.tenant]) cost[l.tenant][l.basis] = (cost[l.tenant][l.basis] || 0) - v;
      }
    }
    const queued = byLabel(now, "kvgate_flow_queue_depth", "tenant");
    for (const t of [...Object.keys(queued), ...Object.keys(cost)]) totals[t] = totals[t] || {};
    fillTable("tenants", Object.keys(totals).sort().map((t) => {
      const k = totals[t];
      const share = k.prompt ? (k.cache_read || 0) / k.prompt : null;
      const c = cost[t] || {};
      const saved = c.billed !== undefined && c.without_caching !== undefined ? c.without_caching - c.billed : null;
      return [esc(t), fmt(k.prompt), fmt(k.cache_read), fmt(k.cache_written), fmt(k.completion), fmt(share, true),
        money(c.billed), money(c.without_caching), money(saved), fmt(saved !== null && c.without_caching ? saved / c.without_caching : null, true),
        fmt(queued[t] || 0)];
    }));
    const [sx, spend] = rates("kvgate_tenant_cost_dollars_total", "tenant", { basis: "billed" });
    for (const k of Object.keys(spend)) spend[k] = spend[k].map((v) => (v === null ? null : v * 60));
    draw("tenant_spend", sx, spend);
    draw("tenant_tokens", ...rates("kvgate_tenant_tokens_total", "tenant", { kind: "prompt" }));
    draw("queued", ...gauges("kvgate_flow_queue_depth", "tenant"));
  }

  function requests(recent) {
    fillTable("latest", recent.map((e) => [
      `<a href="/console/requests?id=${encodeURIComponent(e.request_id)}">${esc(e.request_id)}</a>`,
      esc(e.tenant), esc(e.policy), esc(e.reason), esc(e.replica), esc(e.matched)]));
  }

  async function poll() {
    try {
      const r = await fetch("/console/state.json", { credentials: "same-origin" });
      if (!r.ok) throw new Error("state " + r.status);
      const state = await r.json();
      history.push({ t: Date.now() / 1000, samples: state.samples });
      if (history.length > KEEP) history.shift();
      const now = state.samples;
      if (page === "/console") fleet(now);
      else if (page === "/console/routing") routing(now);
      else if (page === "/console/tenants") tenants(now);
      else if (page === "/console/requests") requests(state.recent);
      document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    } catch (e) {
      document.getElementById("updated").textContent = "not updating: " + e.message;
    }
  }
  poll();
  setInterval(poll, POLL_MS);
})();
