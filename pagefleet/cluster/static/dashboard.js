// pagefleet's dashboard: polls /dashboard/data and draws it with uPlot.
//
// The server computes every number (rates, percentiles; see pagefleet/cluster/dashboard.py); this
// script only plots the columns it gets. Each chart's <section> carries data-points (the
// non-null values plotted) and data-series (the series' labels) so that tests and
// operators' scripts can read what is on screen from the DOM.
(function () {
  "use strict";

  const KEY_STORE = "pagefleet.apiKey"; // sessionStorage: kept for this tab, not on disk
  const DEFAULT_REFRESH_S = 2;
  const FETCH_TIMEOUT_MS = 10000;
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

  const query = new URLSearchParams(window.location.search);
  const minutes = Number(query.get("minutes")) > 0 ? Number(query.get("minutes")) : 15;
  const dataUrl = "dashboard/data?minutes=" + encodeURIComponent(minutes);

  const $ = (id) => document.getElementById(id);
  const chartsEl = $("charts");
  const statusEl = $("status");
  const keyForm = $("key-form");
  const keyInput = $("api-key");
  const keyMessage = $("key-message");

  // -- formatting -------------------------------------------------------------------------

  function num(v) {
    if (v == null || !isFinite(v)) return "–";
    const a = Math.abs(v);
    const digits = a >= 100 ? 0 : a >= 10 ? 1 : a >= 1 ? 2 : 3;
    // Fixed decimals without trailing zeros: 7.50 -> 7.5, 2.00 -> 2, 0.050 -> 0.05.
    let text = v.toFixed(digits);
    if (text.includes(".")) text = text.replace(/0+$/, "").replace(/\.$/, "");
    return a > 0 && a < 0.001 ? v.toPrecision(2) : text;
  }
  const scaled = (values, k) => values.map((v) => (v == null ? null : v * k));
  const clock = (t) => new Date(t).toLocaleTimeString();
  // Time ticks as HH:MM:SS on one line (uPlot's default adds a date line that crowds).
  const tick = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

  // -- the charts -------------------------------------------------------------------------

  // Each chart: lines(d) -> [{label, values, color?, dash?}] from a /dashboard/data body.
  const CHARTS = [
    { id: "output-tokens", title: "Output tokens/s", unit: "tok/s",
      lines: (d) => [{ label: "tokens/s", values: d.fleet.output_tokens_per_s }] },
    { id: "requests", title: "Requests/s (finished; migrated to another replica)",
      unit: "req/s",
      lines: (d) => [
        { label: "requests/s", values: d.fleet.requests_per_s },
        { label: "migrated/s", values: d.fleet.migrated_per_s, color: PALETTE[3], dash: [6, 4] },
      ] },
    { id: "ttft", title: "Time to first token", unit: "ms",
      lines: (d) => [
        { label: "p50", values: scaled(d.fleet.ttft_p50_s, 1000) },
        { label: "p99", values: scaled(d.fleet.ttft_p99_s, 1000), dash: [6, 4] },
      ] },
    { id: "itl", title: "Inter-token latency", unit: "ms",
      lines: (d) => [
        { label: "p50", values: scaled(d.fleet.itl_p50_s, 1000) },
        { label: "p99", values: scaled(d.fleet.itl_p99_s, 1000), dash: [6, 4] },
      ] },
    { id: "kv-cache", title: "KV-cache utilisation per replica", unit: "%", max: 100,
      lines: (d) => perReplica(d, "kv_cache_usage", 100) },
    { id: "running", title: "Running requests per replica", unit: "requests",
      lines: (d) => perReplica(d, "running", 1) },
    { id: "waiting", title: "Waiting requests per replica", unit: "requests",
      lines: (d) => perReplica(d, "waiting", 1) },
    { id: "replicas", title: "Replicas vs autoscaler target", unit: "replicas",
      lines: (d) => [
        { label: "replicas", values: d.fleet.replicas, color: PALETTE[0] },
        { label: "target", values: d.fleet.target_replicas, color: PALETTE[3], dash: [6, 4] },
      ] },
    { id: "routed", title: "Routed requests/s per replica", unit: "req/s",
      lines: (d) => perReplica(d, "routed_per_s", 1) },
  ];

  // One colour per replica, the same in every chart (by its place in the sorted list).
  function perReplica(d, name, k) {
    return d.replicas
      .map((r, i) => ({ label: r, values: scaled(d.per_replica[name][r] || [], k),
        color: PALETTE[i % PALETTE.length] }))
      .filter((line) => line.values.some((v) => v != null));
  }

  const plots = {}; // chart id -> {plot, signature, el, section}

  function buildSections() {
    for (const c of CHARTS) {
      const section = document.createElement("section");
      section.className = "chart";
      section.id = "chart-" + c.id;
      section.dataset.points = "0";
      section.dataset.series = "";
      const h = document.createElement("h2");
      h.textContent = c.title + " ";
      const unit = document.createElement("span");
      unit.className = "unit";
      unit.textContent = "(" + c.unit + ")";
      const now = document.createElement("span");
      now.className = "now";
      h.append(unit, now);
      const el = document.createElement("div");
      el.className = "plot";
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = "no data in this window yet";
      section.append(h, el, empty);
      chartsEl.appendChild(section);
      plots[c.id] = { plot: null, signature: null, el, section, now };
    }
  }

  function plotOptions(c, lines, width) {
    return {
      width,
      height: 190,
      scales: {
        x: { time: true },
        // From zero, so that a flat line near zero does not read as a swing.
        y: { range: (u, min, max) => [0, c.max || (max > 0 ? max * 1.15 : 1)] },
      },
      axes: [
        { space: 70, values: (u, splits) => splits.map(tick) },
        { size: 56, values: (u, splits) => splits.map(num) },
      ],
      series: [{}].concat(lines.map((l, i) => ({
        label: l.label,
        stroke: l.color || PALETTE[i % PALETTE.length],
        width: 2,
        dash: l.dash,
        spanGaps: false,
        value: (u, v) => num(v),
      }))),
      // Labels only: the newest values are in each chart's title.
      legend: { live: false },
    };
  }

  function render(d) {
    for (const c of CHARTS) {
      const p = plots[c.id];
      const lines = c.lines(d);
      const data = [d.t].concat(lines.map((l) => l.values));
      const signature = lines.map((l) => l.label).join("\u0000");
      const width = Math.max(p.el.clientWidth, 200);
      if (p.plot === null || p.signature !== signature) {
        // New or changed series (a replica came or went): uPlot fixes series at creation.
        if (p.plot !== null) p.plot.destroy();
        p.plot = new uPlot(plotOptions(c, lines, width), data, p.el);
        p.signature = signature;
      } else {
        p.plot.setData(data);
      }
      let points = 0;
      for (const l of lines) for (const v of l.values) if (v != null) points++;
      p.section.dataset.points = String(points);
      p.section.dataset.series = lines.map((l) => l.label).join(",");
      p.section.classList.toggle("nodata", points === 0);
      p.now.textContent = lines
        .map((l) => [l.label, newest(l.values)])
        .filter(([, v]) => v != null)
        .map(([label, v]) => (lines.length > 1 ? label + " " : "") + num(v))
        .join(" · ");
    }
    chartsEl.dataset.samples = String(d.t.length);
    const latest = d.latest;
    setStat("replicas", latest ? latest.replicas : null, (v) => String(v),
      latest ? "from " + latest.replicas_source : "");
    setStat("target-replicas", latest ? latest.target_replicas : null, (v) => num(v));
    setStat("autoscaler-kv", latest ? latest.autoscaler_kv_utilization : null,
      (v) => num(v * 100) + " %");
    setStat("autoscaler-compute", latest ? latest.autoscaler_compute_utilization : null,
      (v) => num(v * 100) + " %");
    $("window").textContent = "last " + num(d.minutes) + " min";
    renderTenantQueues(latest ? latest.tenant_queues : {});
  }

  // The fair queue's waiting requests per tenant (`pagefleet:tenant_queue_depth`).
  function renderTenantQueues(queues) {
    const body = $("tenant-queue-rows");
    const rows = Object.entries(queues || {}).filter(([, n]) => n > 0)
      .sort((a, b) => b[1] - a[1]);
    body.replaceChildren();
    if (rows.length === 0) rows.push(["none waiting", null]);
    for (const [tenant, n] of rows) {
      const tr = document.createElement("tr");
      for (const text of [tenant, n == null ? "" : String(n)]) {
        const td = document.createElement("td");
        td.textContent = text;
        tr.appendChild(td);
      }
      tr.dataset.tenant = n == null ? "" : tenant;
      body.appendChild(tr);
    }
  }

  function newest(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] != null) return values[i];
    return null;
  }

  // A missing series (e.g. no autoscaler) reads "n/a" rather than a number or a blank.
  function setStat(id, value, fmt, title) {
    const el = $(id);
    const present = value != null;
    el.textContent = present ? fmt(value) : "n/a";
    el.dataset.value = present ? String(value) : "";
    el.title = title || "";
  }

  window.addEventListener("resize", () => {
    for (const id in plots) {
      const p = plots[id];
      if (p.plot) p.plot.setSize({ width: Math.max(p.el.clientWidth, 200), height: 190 });
    }
  });

  // -- status, key, polling ---------------------------------------------------------------

  function setStatus(state, text) {
    statusEl.dataset.state = state;
    statusEl.textContent = text;
  }

  let lastOk = null; // time of the last good answer
  let down = null; // since when the server has been unreachable
  let timer = null;

  function schedule(seconds) {
    clearTimeout(timer);
    timer = setTimeout(poll, seconds * 1000);
  }

  function askForKey(rejected) {
    keyForm.hidden = false;
    keyMessage.textContent = rejected ? "The key was rejected (401); enter the server's API key." : "";
    setStatus("auth", "Waiting for the API key: /dashboard/data answered 401.");
    keyInput.focus();
  }

  keyForm.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = keyInput.value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    keyInput.value = "";
    keyForm.hidden = true;
    poll();
  });

  async function poll() {
    const key = sessionStorage.getItem(KEY_STORE);
    const headers = key ? { Authorization: "Bearer " + key } : {};
    const abort = new AbortController();
    const timeout = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
    let resp;
    try {
      resp = await fetch(dataUrl, { headers, cache: "no-store", signal: abort.signal });
    } catch (err) {
      // Connection refused, reset or timed out: the server (or the network to it) is down.
      clearTimeout(timeout);
      down = down || Date.now();
      setStatus("unreachable",
        "Cannot reach the pagefleet server at " + window.location.origin + " (since " +
        clock(down) + "). Retrying every " + DEFAULT_REFRESH_S + " s; the charts show " +
        (lastOk ? "the data of " + clock(lastOk) + "." : "no data yet."));
      schedule(DEFAULT_REFRESH_S);
      return;
    }
    clearTimeout(timeout);
    down = null;
    if (resp.status === 401) {
      // Stop polling until a key is given: each poll would be another 401.
      sessionStorage.removeItem(KEY_STORE);
      askForKey(Boolean(key));
      return;
    }
    if (!resp.ok) {
      let message = resp.statusText;
      try { message = (await resp.json()).error.message; } catch (e) { /* not our body */ }
      setStatus("error", "The server answered " + resp.status + ": " + message +
        ". Retrying every " + DEFAULT_REFRESH_S + " s.");
      schedule(DEFAULT_REFRESH_S);
      return;
    }
    const d = await resp.json();
    render(d);
    lastOk = Date.now();
    if (d.error) {
      setStatus("degraded", "Updated " + clock(lastOk) + ", but the server could not read " +
        "the fleet's metrics: " + d.error);
    } else {
      setStatus("ok", "Updated " + clock(lastOk) + " · " + d.t.length + " samples, every " +
        num(d.sample_every_s) + " s; rates over " + num(d.smooth_s) + " s");
    }
    schedule(d.refresh_s || DEFAULT_REFRESH_S);
  }

  buildSections();
  poll();
})();
