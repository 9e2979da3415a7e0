// kcache dashboard: reads GET /v1/stats and draws it. Plain DOM and <canvas>, no
// dependencies, nothing fetched from anywhere but this server. Text from the server
// is only ever set through textContent, never parsed as HTML.
"use strict";

(function () {
  const WINDOWS = { "15m": 900, "1h": 3600, "6h": 21600, "24h": 86400, "7d": 604800, "30d": 2592000 };
  // The outcomes, in the order they are shown, and those that count as hits: the server
  // writes its one list (kcache.outcomes) into the page, so the two never drift apart.
  const words = (name) => document.querySelector(`meta[name="${name}"]`).content.split(" ").filter(Boolean);
  const OUTCOMES = words("kcache-outcomes");
  const HIT_OUTCOMES = words("kcache-hit-outcomes");
  const LABELS = Object.fromEntries(OUTCOMES.map((o) => [o, o.replace(/_/g, " ")]));
  // The page's own address says what it shows (GET /dashboard declares these): a job, a
  // kernel or a target (job_id, kernel, target, as /v1/stats names them), a fixed window
  // (since and until, as /v1/stats reads them) or a sliding one (window), and refresh.
  const params = new URLSearchParams(location.search);
  const REFRESH_MS = Number(params.get("refresh") || 10) * 1000;
  const FILTERS = ["job_id", "kernel", "target"];
  const filters = Object.fromEntries(FILTERS.map((f) => [f, params.get(f) || ""]).filter(([, v]) => v));
  const fixed = params.get("since") ? { since: params.get("since"), until: params.get("until") || "" } : null;

  const $ = (id) => document.getElementById(id);
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue("--" + name).trim();

  let windowName = params.get("window") || (location.hash.match(/window=(\w+)/) || [])[1] || "24h";
  if (!(windowName in WINDOWS)) windowName = "24h";
  // The token lives for this tab only: sessionStorage, never localStorage.
  let token = sessionStorage.getItem("kcache.token") || "";
  let timer = null;
  let lastStats = null;
  let loads = 0;

  // ------------------------------------------------------------------ formatting
  const int = (n) => Number(n || 0).toLocaleString("en-US");
  const pct = (r) => (r === null || r === undefined ? "–" : (r * 100).toFixed(1) + "%");
  function duration(s) {
    s = Number(s || 0);
    if (s < 60) return s.toFixed(1) + " s";
    if (s < 3600) return (s / 60).toFixed(1) + " min";
    if (s < 86400 * 2) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  }
  function ago(t) {
    if (!t) return "";
    const d = Math.max(0, Date.now() / 1000 - t);
    if (d < 60) return Math.round(d) + " s ago";
    if (d < 3600) return Math.round(d / 60) + " min ago";
    if (d < 86400) return Math.round(d / 3600) + " h ago";
    return Math.round(d / 86400) + " d ago";
  }
  const short = (digest) => (digest ? digest.slice(0, 12) : "–");

  // The address of this page showing ``changes`` on top of what it shows now (null: drop);
  // ``sliding``: the last that long instead of the window shown.
  function pageUrl(changes, sliding) {
    const next = new URLSearchParams();
    for (const [k, v] of Object.entries({ ...filters, ...changes })) if (v) next.set(k, v);
    if (fixed && !sliding) {
      next.set("since", fixed.since);
      if (fixed.until) next.set("until", fixed.until);
    } else next.set("window", sliding || windowName);
    if (params.get("refresh")) next.set("refresh", params.get("refresh"));
    return "/dashboard?" + next.toString();
  }
  // A link that narrows the page to one job, kernel or target.
  function filterLink(name, value, text) {
    if (value === null || value === undefined || value === "") return text;
    return el("a", { class: "filter", href: pageUrl({ [name]: String(value) }), "data-filter": name },
      text);
  }
  // What a rank got: every kernel found, some or most compiled, or none looked up.
  function got(rate) {
    if (rate === null || rate === undefined) return "none";
    if (rate >= 1) return "all";
    return rate > 0.5 ? "some" : "most";
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "title") node.title = v;
      else node.setAttribute(k, v);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  function setValue(id, text, value) {
    const node = $(id);
    node.textContent = text;
    node.dataset.value = value === null || value === undefined ? "" : String(value);
  }

  // ------------------------------------------------------------------ loading
  // Progressive: opening the page (or another window) first asks for everything but
  // the jobs (no group_by: the job and per-rank counts are the costly part of the
  // answer) and draws it, then asks again with group_by=job and draws that whole
  // answer, jobs included. Each panel shows what its own answer said; an answer
  // arriving for a window no longer shown is dropped. A refresh of a window already
  // on screen asks once, for the whole answer.
  let generation = 0;

  async function fetchStats(query) {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    let response;
    try {
      response = await fetch("/v1/stats?" + query, { headers, cache: "no-store" });
    } catch (err) {
      return { error: "cannot reach the server: " + err };
    }
    if (response.status === 401 || response.status === 403) {
      return { auth: true, error: response.status === 401 ? "a token is needed" : "this token lacks the read scope" };
    }
    if (!response.ok) {
      let detail = response.statusText;
      try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
      return { error: `GET /v1/stats answered ${response.status}: ${detail}` };
    }
    return { stats: await response.json() };
  }

  // Shows an answer, or its error as the page always has; true when it drew.
  function accept(answer, my) {
    if (my !== generation) return false; // a newer load owns the page
    if (answer.error) {
      if (answer.auth) $("auth").hidden = false;
      showError(answer.error);
      return false;
    }
    $("auth").hidden = true;
    $("error").hidden = true;
    return true;
  }

  async function load(refresh) {
    const my = ++generation;
    let span;
    if (fixed) {
      span = `since=${encodeURIComponent(fixed.since)}` +
        (fixed.until ? `&until=${encodeURIComponent(fixed.until)}` : "");
    } else {
      const until = Date.now() / 1000;
      const since = until - WINDOWS[windowName];
      span = `since=${since.toFixed(3)}&until=${until.toFixed(3)}`;
    }
    const narrowed = Object.entries(filters).map(([k, v]) => `&${k}=${encodeURIComponent(v)}`).join("");
    const query = `${span}&buckets=60&top=10${narrowed}`;
    if (!refresh) {
      const first = await fetchStats(query);
      if (!accept(first, my)) return;
      lastStats = first.stats;
      render(lastStats, false);
      painted();
    }
    const full = await fetchStats(query + "&group_by=job");
    if (!accept(full, my)) {
      // The first answer's panels stay; the jobs never came, and the banner says why.
      if (my === generation && $("jobs").dataset.pending) {
        $("jobs").tBodies[0].replaceChildren();
        emptyRow($("jobs").tBodies[0], 5, "jobs not loaded");
      }
      return;
    }
    lastStats = full.stats;
    render(lastStats, true);
    painted();
    // The kernels and the targets of what is shown, each a link to its own page.
    for (const [group, table] of [["kernel", "kernels"], ["target", "targets"]]) {
      const answer = await fetchStats(query + `&group_by=${group}&limit=50`);
      if (my !== generation) return;
      renderGroups(table, group, answer.stats ? answer.stats.groups : null);
    }
    await loadVerification();
    loads += 1;
    document.body.dataset.loads = String(loads);
  }
  // One answer is on screen: its panels hold data (the bench's first paint waits for this).
  function painted() {
    document.body.dataset.paints = String(Number(document.body.dataset.paints || 0) + 1);
    document.body.dataset.window = windowName;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  }
  function showError(text) {
    const node = $("error");
    node.textContent = text;
    node.hidden = false;
  }
  function schedule() {
    clearInterval(timer);
    timer = $("auto-refresh").checked ? setInterval(() => load(true), REFRESH_MS) : null;
  }

  // ------------------------------------------------------------------ rendering
  // ``withJobs``: the answer was asked with group_by=job; without it the jobs table
  // says it is loading rather than showing an empty answer it was never asked.
  function render(s, withJobs) {
    // One hit rate, as /v1/stats, `kcache stats`, /metrics and Grafana count it: the share of
    // kernel lookups (each process's first lookup of each recipe) that needed no compile
    // anywhere. Its parts are beside it: hits the server answered itself, hits clients
    // reported (with the tokens that reported them), and the requests (every lookup,
    // repeats included) the figures rest on.
    const sum = (o) => Object.values(o || {}).reduce((a, b) => a + b, 0);
    const reported = s.reported || {};
    setValue("kpi-hit-rate", pct(s.hit_rate), s.hit_rate);
    setValue("kpi-hits", `${int(s.kernel_hits)} of ${int(s.kernel_lookups)} kernel lookups needed no compile`,
      s.kernel_hits);
    setValue("kpi-parts", `${int(s.observed_hits)} answered by the server · ${int(s.reported_hits)} reported by clients`,
      s.observed_hits);
    renderReporters(s.reported_by || []);
    setValue("kpi-lookups", int(s.kernel_lookups), s.kernel_lookups);
    setValue("kpi-lookups-sub",
      `${int(s.lookups)} requests, repeats included: ${int(sum(s.totals))} seen by the server · ` +
      `${int(sum(reported))} reported by clients`, s.lookups);
    setValue("kpi-saved", duration(s.compile_seconds_saved), s.compile_seconds_saved);
    setValue("kpi-saved-sub", `${int(s.compiles_avoided)} compiles avoided` +
      (s.reported_compile_seconds_saved
        ? ` · ${duration(s.reported_compile_seconds_saved)} of it reported by clients` : ""),
      s.compiles_avoided);
    setValue("kpi-misses", int(s.kernel_misses), s.kernel_misses);
    const errors = (s.miss_reasons || []).filter((r) => r.reason.startsWith("error:"))
      .reduce((n, r) => n + r.kernel_lookups, 0);
    setValue("kpi-errors", `${int(errors)} failed to compile`, errors);
    renderScope();
    renderReasons(s.miss_reasons || []);
    const observed = s.divergence.filter((d) => !d.reported);
    const hearsay = s.divergence.length - observed.length;
    setValue("kpi-divergence", int(observed.length), observed.length);
    $("kpi-divergence-sub").textContent = hearsay
      ? `recipes resolved differently across ranks · ${int(hearsay)} more reported by clients`
      : "recipes resolved differently across ranks";
    $("kpi-divergence-card").classList.toggle("alarm", observed.length > 0);

    renderStore(s.store);
    renderTiers(s);
    renderDivergence(s.divergence);
    renderMissed(s.top_missed);
    renderForeign(s.foreign_by_library || []);
    if (withJobs) renderJobs(s.groups, new Set(observed.map((d) => d.job_id)));
    else pendingJobs();
    drawChart(s);
  }

  // Who reported the client figures: the tokens (client addresses on an open server).
  function renderReporters(rows) {
    const shown = rows.slice(0, 3).map((r) => `${r.reporter || "unattributed"} (${int(r.lookups)})`);
    const more = rows.length > 3 ? ` and ${rows.length - 3} more` : "";
    const node = $("kpi-reporters");
    node.textContent = rows.length ? `reported by ${shown.join(", ")}${more}` : "";
    node.title = rows.map((r) => `${r.reporter || "unattributed"}: ${int(r.lookups)} lookups, ` +
      `${pct(r.share)} of all`).join("\n");
  }

  function bytes(n) {
    let v = Number(n || 0);
    for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
      if (v < 1024 || unit === "TiB") return unit === "B" ? `${v} B` : `${v.toFixed(1)} ${unit}`;
      v /= 1024;
    }
  }

  // The usage bar: pinned bytes, the rest of what is stored, out of the cap. Without a
  // cap there is no whole to fill: the bar stays empty and says so.
  function renderStore(store) {
    const card = $("store-card");
    card.hidden = !store;
    if (!store) return;
    const cap = store.bytes_cap;
    const bar = $("store-bar");
    bar.replaceChildren();
    bar.classList.toggle("uncapped", !cap);
    bar.setAttribute("aria-valuenow", String(store.bytes_used));
    if (!cap) {
      bar.removeAttribute("aria-valuemax");
      bar.append(el("span", { class: "label" }, "no cap"));
    } else {
      bar.setAttribute("aria-valuemax", String(cap));
    }
    const parts = !cap ? [] : [
      ["pinned", store.pinned_bytes, color("waited")],
      ["stored", Math.max(0, store.bytes_used - store.pinned_bytes), color("accent")],
    ];
    for (const [name, n, fill] of parts) {
      if (!n) continue;
      const seg = el("div", { class: "seg", title: `${name}: ${bytes(n)}` });
      seg.style.width = Math.min(100, (100 * n) / cap) + "%";
      seg.style.background = fill;
      bar.append(seg);
    }
    $("store-sub").textContent = cap
      ? `${bytes(store.bytes_used)} of ${bytes(cap)} (${pct(store.bytes_used / cap)})`
      : `${bytes(store.bytes_used)}, no cap`;
    const figures = $("store-figures");
    figures.replaceChildren(
      el("span", { "data-value": store.artifacts }, "artifacts ", el("b", {}, int(store.artifacts))),
      el("span", { "data-value": store.pinned_artifacts }, "pinned ",
        el("b", {}, `${int(store.pinned_artifacts)} (${bytes(store.pinned_bytes)})`)),
      el("span", { "data-value": store.evictions }, "evicted in this window ",
        el("b", {}, `${int(store.evictions)} (${bytes(store.bytes_freed)} freed)`)),
    );
  }

  function renderTiers(s) {
    const box = $("tiers");
    box.replaceChildren();
    const tiers = Object.keys(s.by_tier).sort();
    if (!tiers.length) box.append(el("p", { class: "muted" }, "no requests in this window"));
    for (const tier of tiers) {
      const counts = s.by_tier[tier];
      const total = Object.values(counts).reduce((a, b) => a + b, 0);
      const hits = HIT_OUTCOMES.reduce((sum, o) => sum + (counts[o] || 0), 0);
      const bar = el("div", { class: "bar" });
      const list = el("div", { class: "tier-counts" });
      for (const outcome of OUTCOMES) {
        const n = counts[outcome] || 0;
        if (!n) continue;
        const seg = el("div", { class: "seg", title: `${LABELS[outcome]}: ${n}` });
        seg.style.width = (100 * n) / total + "%";
        seg.style.background = color(outcome);
        bar.append(seg);
        list.append(el("span", { "data-tier": tier, "data-outcome": outcome, "data-value": n },
          LABELS[outcome] + " ", el("b", {}, int(n))));
      }
      box.append(el("div", { class: "tier", "data-tier": tier },
        el("div", { class: "tier-head" },
          el("span", { class: "tier-name" }, tier),
          el("span", { class: "muted" }, `${int(total)} requests · ${pct(total ? hits / total : null)} hits`)),
        bar, list));
    }
    const legend = $("outcome-legend");
    if (!legend.childElementCount) {
      for (const outcome of OUTCOMES) {
        const sw = el("i", { class: "sw" });
        sw.style.background = color(outcome);
        legend.append(el("span", {}, sw, LABELS[outcome]));
      }
    }
  }

  function emptyRow(tbody, cols, text) {
    tbody.append(el("tr", {}, el("td", { class: "empty", colspan: cols }, text)));
  }

  function renderDivergence(rows) {
    const tbody = $("divergence").tBodies[0];
    tbody.replaceChildren();
    if (!rows.length) emptyRow(tbody, 5, "every rank of every job got the same artifact");
    for (const d of rows) {
      const ranks = el("div", { class: "ranks" });
      for (const [rank, digest] of Object.entries(d.ranks)) {
        ranks.append(el("span", { class: "chip", title: digest }, "rank " + rank + " → ",
          el("span", { class: "digest" }, short(digest))));
      }
      tbody.append(el("tr", { class: d.reported ? "reported-divergence" : "divergent",
                              "data-job": d.job_id, "data-base-key": d.base_key },
        el("td", {}, d.job_id, el("span", { class: "badge" }, !d.reported ? "diverged"
          : "reported by " + ((d.reported_by || []).join(", ") || "clients"))),
        el("td", { class: "kernel" }, d.kernel || "–"),
        el("td", {}, d.target || "–"),
        el("td", { class: "digest", title: d.base_key }, short(d.base_key)),
        el("td", {}, ranks)));
    }
  }

  // GET /v1/verification needs the admin scope: without it the section says so.
  async function loadVerification() {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    const summary = $("verification-summary");
    const tbody = $("verification").tBodies[0];
    let response;
    try {
      response = await fetch("/v1/verification?limit=20", { headers, cache: "no-store" });
    } catch (err) {
      summary.textContent = "cannot reach the server";
      return;
    }
    if (!response.ok) {
      tbody.replaceChildren();
      emptyRow(tbody, 6, response.status === 401 || response.status === 403
        ? "an admin token shows what verification found" : "verification not available");
      return;
    }
    const v = await response.json();
    const counts = v.verified || {};
    const total = Object.values(counts).reduce((a, b) => a + b, 0);
    summary.textContent = v.enabled
      ? `${int(total)} verified in 30 d · ${int(counts.same_bytes)} same bytes · ` +
        `${int(counts.diverged)} diverged · ${int(counts.failed)} failed · ` +
        `coverage ${pct(v.coverage)} of ${int(v.served_recipes)} served recipes`
      : "verification is off (KCACHE_VERIFY_ENABLED)";
    summary.dataset.diverged = String(counts.diverged || 0);
    tbody.replaceChildren();
    if (!v.divergences.length) emptyRow(tbody, 6, "no served artifact differed from a fresh compile");
    for (const d of v.divergences) {
      tbody.append(el("tr", { class: "divergent", "data-recipe-key": d.recipe_key },
        el("td", {}, new Date(d.at).toLocaleString()),
        el("td", { class: "kernel" }, d.kernel || "–"),
        el("td", { class: "digest", title: d.recipe_key }, short(d.recipe_key)),
        el("td", {}, d.via === "manifest" ? "manifest match" : "exact key"),
        el("td", { class: "digest" }, short(d.stored_digest) + " → " + short(d.fresh_digest)),
        el("td", { class: "why" }, d.differences.join("; "))));
    }
  }

  function renderMissed(rows) {
    const tbody = $("top-missed").tBodies[0];
    tbody.replaceChildren();
    if (!rows.length) emptyRow(tbody, 5, "no misses in this window");
    for (const m of rows) {
      const isError = m.last_miss_outcome === "error";
      tbody.append(el("tr", { "data-kernel": m.kernel || "" },
        el("td", { class: "kernel" }, filterLink("kernel", m.kernel, m.kernel || "(unnamed)")),
        el("td", { class: "num", "data-value": m.misses }, int(m.misses)),
        el("td", { class: "num", "data-value": m.errors }, int(m.errors)),
        el("td", { class: "reason" + (isError ? " error" : "") },
          el("span", { class: "why" }, m.last_miss_reason || "–"),
          // What differs from the nearest recipe the server recorded, or "never seen".
          m.last_miss_explanation
            ? el("div", { class: "explained", title: m.last_miss_explanation }, m.last_miss_explanation)
            : null),
        el("td", { class: "muted" }, ago(m.last_miss_at))));
    }
  }

  function pendingJobs() {
    const tbody = $("jobs").tBodies[0];
    tbody.replaceChildren();
    $("jobs").dataset.pending = "true";
    emptyRow(tbody, 5, "loading jobs…");
  }

  function renderJobs(groups, divergent) {
    const tbody = $("jobs").tBodies[0];
    tbody.replaceChildren();
    delete $("jobs").dataset.pending;
    const jobs = groups.filter((g) => g.key !== null);
    if (!jobs.length) emptyRow(tbody, 5, "no job ids in this window");
    for (const g of jobs) {
      const ranks = el("div", { class: "ranks" });
      for (const r of g.ranks || []) {
        // Coloured by what the rank got (the legend below the table says how).
        const kind = got(r.hit_rate);
        ranks.append(el("span", { class: "chip", "data-rank": r.rank === null ? "" : r.rank, "data-got": kind,
          "data-hit-rate": r.hit_rate === null ? "" : r.hit_rate,
          title: `rank ${r.rank === null ? "?" : r.rank}: ${int(r.kernel_lookups)} kernel lookups, ` +
            `${int(r.kernel_hits)} found without a compile (${pct(r.hit_rate)}), ${int(r.kernel_misses)} needed one` },
          el("i", { class: "dot got-" + kind }), "r" + (r.rank === null ? "?" : r.rank)));
      }
      const size = g.world_size ? ` of ${g.world_size}` : "";
      const row = el("tr", { "data-job": g.key, class: g.divergent || divergent.has(g.key) ? "divergent" : "" },
        el("td", {}, filterLink("job_id", g.key, String(g.key)),
          g.divergent ? el("span", { class: "badge" }, "diverged") : null),
        el("td", { class: "num", "data-value": g.kernel_lookups,
                   title: `${int(g.total)} requests, repeats included` }, int(g.kernel_lookups)),
        el("td", { class: "num", "data-value": g.hit_rate === null ? "" : g.hit_rate }, pct(g.hit_rate)),
        el("td", { class: "num", "data-value": g.compile_seconds_saved }, duration(g.compile_seconds_saved)),
        el("td", {}, ranks, el("span", { class: "muted" }, ` ${(g.ranks || []).length} rank(s)${size}`)));
      tbody.append(row);
    }
  }

  // The kernels (or targets) of what is shown, each a link to its own page; null: not loaded.
  function renderGroups(table, name, groups) {
    const tbody = $(table).tBodies[0];
    tbody.replaceChildren();
    if (groups === null) { emptyRow(tbody, 5, `${table} not loaded`); return; }
    if (!groups.length) emptyRow(tbody, 5, `no ${table} in this window`);
    for (const g of groups) {
      tbody.append(el("tr", { "data-key": g.key === null ? "" : g.key },
        el("td", { class: name === "kernel" ? "kernel" : "" },
          filterLink(name, g.key, g.key === null ? "(none)" : String(g.key))),
        el("td", { class: "num", "data-value": g.kernel_lookups }, int(g.kernel_lookups)),
        el("td", { class: "num", "data-value": g.kernel_misses }, int(g.kernel_misses)),
        el("td", { class: "num", "data-value": g.hit_rate === null ? "" : g.hit_rate }, pct(g.hit_rate)),
        el("td", { class: "num", "data-value": g.compile_seconds_saved }, duration(g.compile_seconds_saved))));
    }
  }

  // Foreign kernels (GET /v1/foreign/{library}/{key}: what CuPy's, cuda.core's or Triton's
  // cache hooks looked up) by library, most looked up first; one line when there were none.
  function renderForeign(rows) {
    const tbody = $("foreign-libraries").tBodies[0];
    tbody.replaceChildren();
    if (!rows.length) emptyRow(tbody, 4, "no foreign kernels looked up in this window");
    for (const f of rows) {
      tbody.append(el("tr", { "data-library": f.library },
        el("td", { class: "kernel" }, f.library),
        el("td", { class: "num", "data-value": f.lookups }, int(f.lookups)),
        el("td", { class: "num", "data-value": f.hits,
                   title: `${int(f.misses)} missed: the library compiled` }, int(f.hits)),
        el("td", { class: "num", "data-value": f.hit_rate === null ? "" : f.hit_rate }, pct(f.hit_rate))));
    }
  }

  // Why the kernel lookups of what is shown missed, most first.
  function renderReasons(rows) {
    const tbody = $("miss-reasons").tBodies[0];
    tbody.replaceChildren();
    if (!rows.length) emptyRow(tbody, 2, "no kernel lookup needed a compile");
    for (const r of rows) {
      tbody.append(el("tr", { "data-reason": r.reason },
        el("td", { class: "reason" + (r.reason.startsWith("error:") ? " error" : "") }, r.text),
        el("td", { class: "num", "data-value": r.kernel_lookups }, int(r.kernel_lookups))));
    }
  }

  // The page's title line: the fleet, or the job, kernel and target it is narrowed to.
  function renderScope() {
    const said = [];
    if (filters.job_id) said.push(`job ${filters.job_id}`);
    if (filters.kernel) said.push(`kernel ${filters.kernel}`);
    if (filters.target) said.push(`target ${filters.target}`);
    $("scope").textContent = said.length ? said.join(" · ") : "all jobs and kernels";
    document.title = `kcache · ${said.length ? said.join(" · ") : "cache audit"}`;
  }

  // ------------------------------------------------------------------ the chart
  let chartGeometry = null;

  function drawChart(s) {
    const canvas = $("hit-chart");
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 600;
    const height = canvas.clientHeight || 260;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);

    const pad = { left: 44, right: 46, top: 12, bottom: 28 };
    const w = width - pad.left - pad.right;
    const h = height - pad.top - pad.bottom;
    const pts = s.series || [];
    const n = Math.max(pts.length, 1);
    // The line is the hit rate of each bucket's kernel lookups, the bars those lookups.
    const seen = (p) => p.kernel_lookups || 0;
    const maxTotal = Math.max(1, ...pts.map(seen));
    const x = (i) => pad.left + (w * (i + 0.5)) / n;
    const y = (rate) => pad.top + h * (1 - rate);

    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    // Grid and the left axis (hit rate).
    for (const r of [0, 0.25, 0.5, 0.75, 1]) {
      ctx.strokeStyle = "#1e2943";
      ctx.lineWidth = 1;
      ctx.beginPath();
      ctx.moveTo(pad.left, Math.round(y(r)) + 0.5);
      ctx.lineTo(pad.left + w, Math.round(y(r)) + 0.5);
      ctx.stroke();
      ctx.fillStyle = color("muted");
      ctx.textAlign = "right";
      ctx.fillText(Math.round(r * 100) + "%", pad.left - 8, y(r));
    }
    // Right axis: lookups per bucket.
    ctx.textAlign = "left";
    ctx.fillText(int(maxTotal), pad.left + w + 8, y(1));
    ctx.fillText("0", pad.left + w + 8, y(0));

    // Volume bars behind the line.
    const bw = Math.max(1, (w / n) * 0.7);
    ctx.fillStyle = "#22304f";
    pts.forEach((p, i) => {
      if (!seen(p)) return;
      const bh = (h * seen(p)) / maxTotal;
      ctx.fillRect(x(i) - bw / 2, pad.top + h - bh, bw, bh);
    });

    // Hit rate: an area and a line through the buckets that had lookups.
    const drawn = pts.map((p, i) => [p, i]).filter(([p]) => p.hit_rate !== null);
    if (drawn.length) {
      const accent = color("accent");
      const grad = ctx.createLinearGradient(0, pad.top, 0, pad.top + h);
      grad.addColorStop(0, "rgba(94, 234, 212, .28)");
      grad.addColorStop(1, "rgba(94, 234, 212, 0)");
      ctx.beginPath();
      drawn.forEach(([p, i], k) => (k ? ctx.lineTo(x(i), y(p.hit_rate)) : ctx.moveTo(x(i), y(p.hit_rate))));
      ctx.lineTo(x(drawn[drawn.length - 1][1]), y(0));
      ctx.lineTo(x(drawn[0][1]), y(0));
      ctx.closePath();
      ctx.fillStyle = grad;
      ctx.fill();
      ctx.beginPath();
      drawn.forEach(([p, i], k) => (k ? ctx.lineTo(x(i), y(p.hit_rate)) : ctx.moveTo(x(i), y(p.hit_rate))));
      ctx.strokeStyle = accent;
      ctx.lineWidth = 2;
      ctx.lineJoin = "round";
      ctx.stroke();
      ctx.fillStyle = accent;
      for (const [p, i] of drawn) {
        ctx.beginPath();
        ctx.arc(x(i), y(p.hit_rate), drawn.length > 40 ? 1.5 : 3, 0, Math.PI * 2);
        ctx.fill();
      }
    } else {
      ctx.fillStyle = color("muted");
      ctx.textAlign = "center";
      ctx.fillText("no lookups in this window", pad.left + w / 2, pad.top + h / 2);
    }

    // Time labels: about six, aligned with their buckets.
    ctx.fillStyle = color("muted");
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const long = (s.bucket_seconds || 60) >= 3600;
    const every = Math.max(1, Math.ceil(n / 6));
    pts.forEach((p, i) => {
      if (i % every) return;
      const d = new Date(p.t * 1000);
      const label = long
        ? d.toLocaleDateString(undefined, { month: "short", day: "numeric" }) + " " +
          d.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit" })
        : d.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit" });
      ctx.fillText(label, x(i), pad.top + h + 8);
    });

    chartGeometry = { pts, x, n, pad, w };
    canvas.dataset.points = String(drawn.length);
    canvas.dataset.buckets = String(pts.length);
  }

  function onHover(event) {
    const tip = $("chart-tip");
    if (!chartGeometry || !chartGeometry.pts.length) return;
    const canvas = $("hit-chart");
    const rect = canvas.getBoundingClientRect();
    const { pts, n, pad, w } = chartGeometry;
    const i = Math.floor(((event.clientX - rect.left - pad.left) / w) * n);
    const p = pts[i];
    if (!p) { tip.hidden = true; return; }
    tip.textContent = `${new Date(p.t * 1000).toLocaleString()} · ${pct(p.hit_rate)} of ` +
      `${int(p.kernel_lookups)} kernel lookups · ${int(p.total)} requests`;
    tip.style.left = Math.min(event.clientX - rect.left + 24, rect.width - 200) + "px";
    tip.style.top = "48px";
    tip.hidden = false;
  }

  // ------------------------------------------------------------------ wiring
  function selectWindow(name) {
    if (fixed) { location.href = pageUrl({}, name); return; } // a fixed window no longer
    windowName = name;
    history.replaceState(null, "", pageUrl({}) + "#window=" + name);
    for (const b of document.querySelectorAll("#windows button")) {
      b.classList.toggle("active", b.dataset.window === name);
    }
    load(false);
  }

  document.addEventListener("DOMContentLoaded", () => {
    for (const b of document.querySelectorAll("#windows button")) {
      b.addEventListener("click", () => selectWindow(b.dataset.window));
    }
    $("auto-refresh").addEventListener("change", schedule);
    // The filter form: its fields as they are, and one URL for what it shows.
    $("f-job").value = filters.job_id || "";
    $("f-kernel").value = filters.kernel || "";
    $("f-target").value = filters.target || "";
    $("f-clear").href = pageUrl({ job_id: null, kernel: null, target: null });
    $("filter-form").addEventListener("submit", (event) => {
      event.preventDefault();
      location.href = pageUrl({
        job_id: $("f-job").value.trim(), kernel: $("f-kernel").value.trim(), target: $("f-target").value.trim(),
      });
    });
    $("auth-form").addEventListener("submit", (event) => {
      event.preventDefault();
      token = $("token").value.trim();
      sessionStorage.setItem("kcache.token", token);
      load(false);
    });
    const canvas = $("hit-chart");
    canvas.addEventListener("mousemove", onHover);
    canvas.addEventListener("mouseleave", () => { $("chart-tip").hidden = true; });
    window.addEventListener("resize", () => lastStats && drawChart(lastStats));
    if (fixed) {
      // A fixed window (?since=&until=): the same figures each time it is asked.
      document.body.dataset.fixed = "true";
      load(false);
    } else selectWindow(windowName);
    schedule();
  });
})();
