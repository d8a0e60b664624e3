// BlockTrain node page. Plain JS, no dependencies, no external requests.
// Everything that comes from the API (peer ids, generated text, errors) is untrusted: it is only
// ever written with textContent / setAttribute, never parsed as HTML.
"use strict";

(function () {
  const REFRESH_MS = 2000;
  const STATUS_TIMEOUT_MS = 10000;
  const GENERATE_TIMEOUT_MS = 300000;
  const MAX_LOSS_POINTS = 20000;     // client-side loss history of this node's block
  const MAX_STEP_POINTS = 1800;      // per holder: one hour at one point per refresh
  const LN256 = Math.log(256);
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2563eb", "#d97706", "#059669", "#db2777", "#7c3aed", "#0891b2", "#65a30d",
                   "#dc2626", "#4b5563", "#9333ea"];

  const $ = (id) => document.getElementById(id);
  const nf0 = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  const nf1 = new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 });

  // ---- client-side history (the node only keeps its own block's last 200 losses) -------------
  const hist = {
    key: null,               // run id + config hash + this peer: reset histories when it changes
    loss: new Map(),         // step -> [time, step, loss]
    steps: new Map(),        // peer id -> {block, points: [[time, step]], isSelf}
    ce: new Map(),           // time -> ce
    selfBlock: null,
  };
  let lastStatus = null;
  let maxBytesTouched = false;
  let limits = null;         // per mode {max, default}: the most bytes it emits for this run (/v1/status run.generate)

  function resetHistory(key) {
    hist.key = key;
    hist.loss.clear();
    hist.steps.clear();
    hist.ce.clear();
  }

  function record(st, now) {
    const key = [st.run && st.run.run_id, st.run && st.run.config_hash, st.self && st.self.peer_id,
                 st.self && st.self.block].join("|");
    if (key !== hist.key) resetHistory(key);
    hist.selfBlock = st.self ? st.self.block : null;
    for (const row of st.losses || []) {
      if (Array.isArray(row) && row.length >= 3 && Number.isFinite(row[1]) && Number.isFinite(row[2])) {
        hist.loss.set(row[1], row);
      }
    }
    if (hist.loss.size > MAX_LOSS_POINTS) {
      const keys = Array.from(hist.loss.keys()).sort((a, b) => a - b);
      for (const k of keys.slice(0, hist.loss.size - MAX_LOSS_POINTS)) hist.loss.delete(k);
    }
    for (const b of st.blocks || []) {
      for (const h of b.holders || []) {
        if (typeof h.peer_id !== "string" || !Number.isFinite(h.step)) continue;
        let e = hist.steps.get(h.peer_id);
        if (!e) {
          e = { block: b.block, points: [], isSelf: !!h.is_self };
          hist.steps.set(h.peer_id, e);
        }
        e.block = b.block;
        e.isSelf = !!h.is_self;
        e.seen = now;
        // this node's own step is fresher than its announced record
        const step = h.is_self && st.self && Number.isFinite(st.self.step) ? Math.max(h.step, st.self.step) : h.step;
        const last = e.points[e.points.length - 1];
        if (!last || last[1] !== step || now - last[0] > 10) e.points.push([now, step]);
        if (e.points.length > MAX_STEP_POINTS) e.points.splice(0, e.points.length - MAX_STEP_POINTS);
      }
    }
    for (const [peer, e] of hist.steps) {   // holders gone for 10 minutes leave the chart
      if (now - e.seen > 600) hist.steps.delete(peer);
    }
    for (const row of st.chain_ce || []) {
      if (Array.isArray(row) && row.length >= 2 && Number.isFinite(row[0]) && Number.isFinite(row[1])) {
        hist.ce.set(row[0], row[1]);
      }
    }
  }

  // ---- formatting ----------------------------------------------------------------------------
  function shortId(id) {
    if (typeof id !== "string") return "?";
    return id.length > 14 ? id.slice(0, 4) + "\u2026" + id.slice(-6) : id;
  }
  function fmtNum(x, digits) {
    if (x === null || x === undefined || !Number.isFinite(x)) return "\u2013";
    if (digits === 0) return nf0.format(x);
    if (digits === 1) return nf1.format(x);
    return Number(x).toFixed(digits === undefined ? 3 : digits);
  }
  function fmtDuration(s) {
    if (!Number.isFinite(s) || s < 0) return "\u2013";
    s = Math.round(s);
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    const h = Math.floor(s / 3600);
    if (h < 48) return h + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(h / 24) + " d " + (h % 24) + " h";
  }
  function fmtClock(t) {
    const d = new Date(t * 1000);
    const p = (n) => String(n).padStart(2, "0");
    return p(d.getHours()) + ":" + p(d.getMinutes()) + ":" + p(d.getSeconds());
  }
  function setText(id, v) {
    const el = $(id);
    const s = v === null || v === undefined || v === "" ? "\u2013" : String(v);
    if (el.textContent !== s) el.textContent = s;
  }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function badge(text, kind) {
    const safeKind = String(kind || "").toLowerCase().replace(/[^a-z_-]/g, "");
    return el("span", "badge " + safeKind, text);
  }

  // ---- rendering of the status ---------------------------------------------------------------
  function renderRun(run) {
    run = run || {};
    setText("run-id", run.run_id);
    const parts = [];
    if (Number.isFinite(run.n_blocks)) parts.push(run.n_blocks + " blocks");
    if (Number.isFinite(run.layers_per_block)) parts.push(run.layers_per_block + " layer(s) per block");
    if (Number.isFinite(run.d_model)) parts.push("d_model " + run.d_model);
    if (Number.isFinite(run.seq_len)) parts.push("seq_len " + run.seq_len);
    setText("run-config", parts.join(", "));
    setText("run-hash", run.config_hash);
    setText("run-objective", run.objective);
    setText("run-data", run.data);
    setText("run-protocol", run.protocol);
    limits = run.generate || null;
    renderLimits();
  }

  function renderLimits() {
    const mode = $("mode").value;
    const lim = limits && limits[mode];
    if (!lim || !Number.isFinite(lim.max)) return;
    const other = mode === "one_sweep" ? "autoregressive" : "one_sweep";
    const olim = limits[other];
    setText("max-hint", (mode === "one_sweep" ? "One sweep" : "Autoregressive") + " emits at most " + lim.max +
            " bytes for this run (empty: " + lim.default + ")" +
            (olim && Number.isFinite(olim.max) ? "; " + other.replace("_", " ") + " up to " + olim.max + "." : "."));
    const input = $("max-bytes");
    input.max = String(lim.max);
    if (!maxBytesTouched && input.value !== "" && Number(input.value) > lim.max) input.value = String(lim.max);
  }

  function renderSelf(s) {
    s = s || {};
    const who = $("whoami");
    who.textContent = "";
    who.append("peer ", el("span", "mono", shortId(s.peer_id)), " \u00b7 block " +
               (Number.isFinite(s.block) ? s.block : "?") + " \u00b7 ");
    who.append(badge(s.state || "unknown", s.state));
    const peer = $("self-peer");
    if (peer.textContent !== String(s.peer_id || "\u2013")) peer.textContent = s.peer_id || "\u2013";
    setText("self-block", s.block);
    const state = $("self-state");
    state.textContent = "";
    state.append(badge(s.state || "unknown", s.state));
    setText("self-step", fmtNum(s.step, 0));
    setText("self-samples", fmtNum(s.samples_seen, 0));
    setText("self-throughput", Number.isFinite(s.throughput) ? fmtNum(s.throughput, 1) + " samples/s" : null);
    setText("self-loss", Number.isFinite(s.loss) && s.loss !== null ? fmtNum(s.loss, 4) : null);
    setText("self-uptime", fmtDuration(s.uptime_s));
    setText("self-origin", s.resumed ? "its checkpoint (resumed)"
            : s.downloaded_state ? describeDownload(s.late_join) : "fresh initialisation");
    setText("self-checkpoint", describeCheckpoint(s.checkpoint));
    setText("self-reach", s.reachability);
    setText("self-rebalance", describeRebalance(s.rebalance));
  }

  function describeCheckpoint(c) {
    // a write the disk refused does not stop the node (Node.try_checkpoint): say so, or what was last written
    if (!c) return null;
    if (c.error) return "NOT WRITING: " + c.error;
    if (!c.last) return "none yet";
    return "step " + fmtNum(c.last.step, 0) + " at " + fmtClock(c.last.at);
  }

  function describeDownload(j) {
    // the late join kept the best of the states it compared (node/state_fetch.py fetch_best)
    if (!j || !j.from) return "state downloaded from a peer";
    const n = (j.compared || []).length;
    const judged = j.judged_by === "chain ce" ? "the chain's held-out CE" : "its held-out check loss";
    return "state downloaded from " + shortId(j.from) + (n > 1 ? " (best of " + n + " offers by " + judged + ")" : "");
  }

  function describeRebalance(r) {
    if (!r || !r.enabled) return "off (block pinned)";
    if (Number.isInteger(r.moving_to)) return "moving to block " + r.moving_to;
    const moves = r.moves || [];
    let text = moves.length ? moves.length + " move(s); last: block " + moves[moves.length - 1].from + " \u2192 " +
      moves[moves.length - 1].to + " at " + fmtClock(moves[moves.length - 1].at) : "no move yet";
    const refused = r.refused || [];
    if (refused.length) text += "; last refused move: " + refused[refused.length - 1].reason;
    return text;
  }

  function renderAveraging(a, st) {
    a = a || {};
    setText("avg-ok", fmtNum(a.succeeded, 0));
    setText("avg-rejected", fmtNum(a.rejected, 0));
    setText("avg-failed", fmtNum(a.failed, 0));
    setText("avg-attempted", fmtNum(a.attempted, 0));
    let last = "none yet";
    if (a.last_round_time) {
      const ago = Date.now() / 1000 - a.last_round_time;
      last = fmtClock(a.last_round_time) + " (" + fmtDuration(Math.max(0, ago)) + " ago)";
      if (Number.isFinite(a.last_group_size) && a.last_group_size > 0) last += ", group of " + a.last_group_size;
      if (a.last_verdict) last += ", " + a.last_verdict;
    } else if (a.last_verdict) {
      last = a.last_verdict;
    }
    setText("avg-last", last);
    const note = $("avg-note");
    const mine = (st.blocks || []).find((b) => st.self && b.block === st.self.block);
    const alone = mine && (mine.holders || []).length <= 1;
    note.hidden = !alone;
    if (alone) note.textContent = "No other holder of block " + st.self.block +
      " is online, so averaging rounds find no partner.";
  }

  function fmtBytes(n) {
    if (!Number.isFinite(n)) return "\u2013";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  // chain-trained runs (pipeline, forward-streamed): GET v1/status self.pipeline; null otherwise
  function renderPipeline(p, run) {
    const card = $("pipe-card");
    card.hidden = !p;
    if (!p) return;
    const first = p.block === 0 && !p.last;
    setText("pipe-role", (p.mode === "streamed" ? "forward only (each block trains its own head)" : "backprop") +
            " \u00b7 " + (first ? "block 0: reads data, sends micro-batches" :
                           p.last ? "last block: computes the loss" : "middle block: serves and forwards"));
    const reasons = Object.entries(p.lost_by_reason || {}).map(([k, v]) => k + " " + v).join(", ");
    setText("pipe-completed", first ? fmtNum(p.completed, 0) : "\u2013");
    setText("pipe-lost", first ? fmtNum(p.lost, 0) + (reasons ? " (" + reasons + ")" : "")
                               : "\u2013 (block 0's holder counts micro-batches)");
    setText("pipe-served", first ? "\u2013 (block 0 sends, it is not called)" :
            fmtNum(p.received, 0) + " received, " + fmtNum(p.answered, 0) + " answered" +
            (p.expired_in_queue ? ", " + fmtNum(p.expired_in_queue, 0) + " expired while queued" : ""));
    setText("pipe-steps", fmtNum(p.steps, 0));
    setText("pipe-stalled", fmtDuration(p.stalled_s));
    const tr = p.traffic || {};
    setText("pipe-sent", fmtBytes(tr.wire_bytes_sent));
    const b = p.budget;
    setText("pipe-budget", b ? fmtNum(b.budget_s, 1) + " s per micro-batch (from " + fmtNum(b.floor_s, 0) +
            ", at most " + fmtNum(b.ceiling_s, 0) + "; round trip " + (b.srtt_s === null ? "not measured yet" :
            Number(b.srtt_s).toFixed(2) + " s") + ")" : "set by block 0's holder");
    const note = $("pipe-note");
    const timedOut = first ? (p.lost_by_reason || {}).timeout || 0 : 0;
    note.hidden = !timedOut;
    if (timedOut) note.textContent = timedOut + " micro-batch(es) ran out of time; the budget doubles after each " +
      "and then follows the round trips measured.";
  }

  function renderBlocks(st) {
    const list = $("blocks");
    const frag = document.createDocumentFragment();
    const blocks = Array.isArray(st.blocks) ? st.blocks : [];
    for (const b of blocks) {
      const holders = Array.isArray(b.holders) ? b.holders : [];
      const row = el("li", "block-row" + (holders.length ? "" : " empty"));
      row.dataset.block = String(b.block);
      row.dataset.holders = String(holders.length);
      const label = el("div", "block-label", "Block " + b.block);
      label.append(el("span", "count", holders.length === 1 ? "1 holder" : holders.length + " holders"));
      row.append(label);
      if (!holders.length) {
        row.append(el("p", "no-holder", "No live holder: the chain cannot run until a node takes this block."));
      } else {
        const ul = el("ul", "holders");
        ul.setAttribute("aria-label", "holders of block " + b.block);
        for (const h of holders) {
          const li = el("li", "holder" + (h.is_self ? " is-self" : ""));
          li.dataset.peer = String(h.peer_id);
          li.title = String(h.peer_id);
          li.append(el("span", "hid", shortId(h.peer_id)));
          li.append(badge(h.state || "unknown", h.state));
          if (h.is_self) {
            li.append(" ", badge("this node", "self"));
          }
          // this node's own numbers are fresher than the record it last announced
          const live = h.is_self && st.self ? st.self : h;
          const stats = ["step " + fmtNum(live.step, 0), fmtNum(live.throughput, 1) + " samples/s",
                         "load " + fmtNum(h.load, 2), h.serving ? "serving" : "not serving"];
          li.append(el("span", "hstats", stats.join(" \u00b7 ")));
          if (h.is_self && st.averaging) {
            const a = st.averaging;
            const when = a.last_round_time ? "last averaged " + fmtDuration(Date.now() / 1000 - a.last_round_time) + " ago"
              : "not averaged yet";
            li.append(el("span", "hstats", when + " \u00b7 " + fmtNum(a.succeeded, 0) + " rounds ok"));
          }
          ul.append(li);
        }
        row.append(ul);
      }
      frag.append(row);
    }
    list.replaceChildren(frag);
    list.setAttribute("aria-busy", "false");
  }

  function renderErrors(errors) {
    const card = $("errors-card");
    const list = $("node-errors");
    errors = Array.isArray(errors) ? errors : [];
    card.hidden = errors.length === 0;
    list.replaceChildren(...errors.map((e) => el("li", null, e)));
  }

  // ---- SVG line charts -----------------------------------------------------------------------
  function niceStep(range, count) {
    const raw = range / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * mag;
  }
  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
  function ticks(lo, hi, count, isTime) {
    let step = niceStep(hi - lo, count);
    if (isTime) {
      const raw = (hi - lo) / Math.max(1, count);
      step = TIME_STEPS.find((s) => s >= raw) || Math.ceil(raw / 86400) * 86400;
    }
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }
  function downsample(points, maxN) {
    if (points.length <= maxN) return points;
    const out = [];
    const per = points.length / maxN;
    for (let i = 0; i < maxN; i++) {
      const a = Math.floor(i * per), b = Math.max(a + 1, Math.floor((i + 1) * per));
      let sx = 0, sy = 0;
      for (let j = a; j < b; j++) { sx += points[j][0]; sy += points[j][1]; }
      out.push([sx / (b - a), sy / (b - a)]);
    }
    return out;
  }
  function bandPath(points, maxN, sx, sy) {
    if (!points.length) return "";
    const per = Math.max(1, points.length / maxN);
    const top = [], bottom = [];
    for (let a = 0; a < points.length; ) {
      const b = Math.min(points.length, Math.max(a + 1, Math.round(a + per)));
      let x = 0, lo = Infinity, hi = -Infinity;
      for (let j = a; j < b; j++) {
        x += points[j][0];
        if (points[j][1] < lo) lo = points[j][1];
        if (points[j][1] > hi) hi = points[j][1];
      }
      x /= b - a;
      top.push(sx(x).toFixed(1) + " " + sy(hi).toFixed(1));
      bottom.push(sx(x).toFixed(1) + " " + sy(lo).toFixed(1));
      a = b;
    }
    return "M" + top.join("L") + "L" + bottom.reverse().join("L") + "Z";
  }
  function svgEl(tag, attrs, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const k in attrs) e.setAttribute(k, String(attrs[k]));
    if (text !== undefined) e.textContent = String(text);
    return e;
  }

  // opts: {title, series: [{label, color, points: [[x, y]], width, opacity, legend}], xLabel, yLabel,
  //        xFmt, yFmt, empty, refs: [{y, label}]}
  function lineChart(boxId, legendId, opts) {
    const box = $(boxId);
    const W = Math.max(260, Math.round(box.clientWidth || 360));
    const H = W < 420 ? 190 : 220;
    const m = { l: 54, r: 12, t: 10, b: 40 };
    const pw = W - m.l - m.r, ph = H - m.t - m.b;
    const svg = svgEl("svg", { viewBox: "0 0 " + W + " " + H, width: W, height: H, role: "img",
                               "aria-label": opts.title, preserveAspectRatio: "xMidYMid meet" });
    svg.append(svgEl("title", {}, opts.title));
    const all = [];
    for (const s of opts.series) for (const p of s.points) if (Number.isFinite(p[0]) && Number.isFinite(p[1])) all.push(p);
    svg.append(svgEl("rect", { class: "frame", x: m.l, y: m.t, width: pw, height: ph }));
    // axis labels
    svg.append(svgEl("text", { class: "axis-label", x: m.l + pw / 2, y: H - 4, "text-anchor": "middle" },
                     opts.xLabel));
    svg.append(svgEl("text", { class: "axis-label", x: 0, y: 0, "text-anchor": "middle",
                               transform: "translate(12," + (m.t + ph / 2) + ") rotate(-90)" }, opts.yLabel));
    const legend = $(legendId);
    if (!all.length) {
      svg.append(svgEl("text", { class: "empty", x: m.l + pw / 2, y: m.t + ph / 2, "text-anchor": "middle" },
                       opts.empty));
      box.replaceChildren(svg);
      legend.replaceChildren();
      box.dataset.points = "0";
      return;
    }
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const p of all) {
      if (p[0] < x0) x0 = p[0];
      if (p[0] > x1) x1 = p[0];
      if (p[1] < y0) y0 = p[1];
      if (p[1] > y1) y1 = p[1];
    }
    if (x1 - x0 < 1e-9) { x0 -= 1; x1 += 1; }
    if (y1 - y0 < 1e-9) { const d = Math.abs(y0) * 0.05 || 1; y0 -= d; y1 += d; }
    const pad = (y1 - y0) * 0.06;
    y0 -= pad; y1 += pad;
    if (opts.yMin !== undefined && y0 < opts.yMin) y0 = opts.yMin;
    const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * pw;
    const sy = (y) => m.t + ph - ((y - y0) / (y1 - y0)) * ph;
    const g = svgEl("g", {});
    const nx = Math.max(2, Math.floor(pw / 90)), ny = Math.max(3, Math.floor(ph / 28));
    for (const v of ticks(y0, y1, ny)) {
      const y = sy(v).toFixed(1);
      g.append(svgEl("line", { class: "gridline", x1: m.l, x2: m.l + pw, y1: y, y2: y }));
      g.append(svgEl("text", { x: m.l - 6, y: +y + 4, "text-anchor": "end" }, opts.yFmt(v)));
    }
    for (const v of ticks(x0, x1, nx, !!opts.xTime)) {
      const x = sx(v).toFixed(1);
      g.append(svgEl("line", { class: "gridline", x1: x, x2: x, y1: m.t, y2: m.t + ph }));
      g.append(svgEl("text", { x: x, y: m.t + ph + 15, "text-anchor": "middle" }, opts.xFmt(v)));
    }
    svg.insertBefore(g, svg.childNodes[1]);
    for (const r of opts.refs || []) {
      if (r.y < y0 || r.y > y1) continue;
      const y = sy(r.y).toFixed(1);
      svg.append(svgEl("line", { class: "refline", x1: m.l, x2: m.l + pw, y1: y, y2: y }));
      svg.append(svgEl("text", { x: m.l + pw - 4, y: +y - 4, "text-anchor": "end" }, r.label));
    }
    const legendItems = [];
    for (const s of opts.series) {
      if (s.band) {   // noisy per-step values: the min..max envelope of each pixel-wide bucket
        const d = bandPath(s.points.filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1])), Math.max(50, Math.floor(pw / 2)),
                           sx, sy);
        if (!d) continue;
        svg.append(svgEl("path", { d: d, fill: s.color, "fill-opacity": 0.35, stroke: s.color, "stroke-width": 1,
                                   "stroke-opacity": 0.6, "stroke-linejoin": "round", class: "series band" }));
        if (s.legend !== false) {
          const li = el("li");
          const sw = el("span", "swatch");
          sw.style.background = s.color;
          sw.style.height = "8px";
          sw.style.opacity = "0.6";
          li.append(sw, s.label);
          legendItems.push(li);
        }
        continue;
      }
      const pts = downsample(s.points.filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1])), Math.max(50, pw));
      if (!pts.length) continue;
      let d = "";
      for (let i = 0; i < pts.length; i++) {
        d += (i ? "L" : "M") + sx(pts[i][0]).toFixed(1) + " " + sy(pts[i][1]).toFixed(1);
      }
      const attrs = { d: d, fill: "none", stroke: s.color, "stroke-width": s.width || 2,
                      "stroke-linejoin": "round", "stroke-linecap": "round", class: "series" };
      if (s.opacity) attrs["stroke-opacity"] = s.opacity;
      svg.append(svgEl("path", attrs));
      if (pts.length === 1 || s.dots) {
        for (const p of pts) {
          svg.append(svgEl("circle", { cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 3, fill: s.color }));
        }
      }
      if (s.legend !== false) {
        const li = el("li");
        const sw = el("span", "swatch");
        sw.style.background = s.color;
        if (s.width && s.width > 2.5) sw.style.height = "5px";
        li.append(sw, s.label);
        legendItems.push(li);
      }
    }
    box.replaceChildren(svg);
    legend.replaceChildren(...legendItems);
    box.dataset.points = String(all.length);
  }

  function colorFor(peer, i) {
    return PALETTE[i % PALETTE.length];
  }

  function renderCharts() {
    // 1. this node's block: training loss per step (raw + moving average)
    const rows = Array.from(hist.loss.values()).sort((a, b) => a[1] - b[1]);
    const raw = rows.map((r) => [r[1], r[2]]);
    const ema = [];
    let acc = null;
    for (const p of raw) {
      acc = acc === null ? p[1] : acc + 0.05 * (p[1] - acc);
      ema.push([p[0], acc]);
    }
    const b = hist.selfBlock;
    $("loss-cap").textContent = "Training loss of block " + (b === null ? "?" : b) + " (this node)";
    lineChart("loss-chart", "loss-legend", {
      title: "Training loss of block " + b + " by step" +
        (ema.length ? ", latest moving average " + ema[ema.length - 1][1].toFixed(3) : ", no data yet"),
      series: [
        { label: "loss per step (range)", color: "#93b4f5", points: raw, band: true },
        { label: "moving average", color: "#2563eb", points: ema, width: 2.5 },
      ],
      xLabel: "training step", yLabel: "loss", xFmt: (v) => fmtNum(v, 0), yFmt: (v) => fmtNum(v, 2),
      empty: "no training steps recorded yet",
    });

    // 2. every holder's announced step over time
    const series = [];
    let i = 0;
    const entries = Array.from(hist.steps.entries()).sort((a, c) => a[1].block - c[1].block || (a[0] < c[0] ? -1 : 1));
    for (const [peer, e] of entries) {
      series.push({ label: "block " + e.block + " \u00b7 " + shortId(peer) + (e.isSelf ? " (this node)" : ""),
                    color: colorFor(peer, i++), points: e.points, width: e.isSelf ? 3 : 1.8 });
    }
    lineChart("steps-chart", "steps-legend", {
      title: "Announced training step of each holder over time",
      series: series, xLabel: "time (clock)", yLabel: "step", xFmt: fmtClock, xTime: true, yFmt: (v) => fmtNum(v, 0),
      empty: "waiting for holders", yMin: 0,
    });

    // 3. chain cross entropy, when the node measured it
    const ce = Array.from(hist.ce.entries()).sort((a, c) => a[0] - c[0]);
    lineChart("ce-chart", "ce-legend", {
      title: ce.length ? "Chain cross entropy, latest " + ce[ce.length - 1][1].toFixed(3) + " nats per byte"
        : "Chain cross entropy: not measured yet",
      series: [{ label: "chain CE (nats/byte)", color: "#059669", points: ce, width: 2.5, dots: true }],
      xLabel: "time (clock)", yLabel: "nats / byte", xFmt: fmtClock, xTime: true, yFmt: (v) => fmtNum(v, 2),
      empty: "not measured yet on this node",
      refs: [{ y: LN256, label: "uniform, ln 256" }],
    });
  }

  function render(st) {
    renderRun(st.run);
    renderSelf(st.self);
    renderAveraging(st.averaging, st);
    renderPipeline(st.self && st.self.pipeline, st.run);
    renderBlocks(st);
    renderErrors(st.errors);
    renderCharts();
  }

  // ---- HTTP ----------------------------------------------------------------------------------
  function describeError(status, body, fallback) {
    let detail = body && body.detail !== undefined ? body.detail : null;
    if (Array.isArray(detail)) {   // FastAPI validation errors
      detail = detail.map((d) => {
        const loc = Array.isArray(d && d.loc) ? d.loc.filter((x) => x !== "body").join(".") : "";
        const msg = d && d.msg ? d.msg : JSON.stringify(d);
        return loc ? loc + ": " + msg : msg;
      }).join("\n");
    } else if (detail !== null && typeof detail !== "string") {
      detail = JSON.stringify(detail);
    }
    const head = status ? "Error " + status : "Error";
    return head + ": " + (detail || fallback || "request failed");
  }

  async function requestJSON(path, init, timeoutMs) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), timeoutMs);
    let resp;
    try {
      resp = await fetch(path, Object.assign({ signal: ctl.signal, cache: "no-store" }, init || {}));
    } catch (e) {
      const msg = e && e.name === "AbortError" ? "no answer within " + Math.round(timeoutMs / 1000) + " s"
        : "cannot reach this node (" + (e && e.message ? e.message : e) + ")";
      throw new Error(msg);
    } finally {
      clearTimeout(timer);
    }
    let body = null;
    const text = await resp.text();
    try { body = text ? JSON.parse(text) : null; } catch (e) { body = null; }
    if (!resp.ok) {
      throw new Error(describeError(resp.status, body, text.slice(0, 300) || resp.statusText));
    }
    return body;
  }

  let pollTimer = null;
  async function poll() {
    pollTimer = null;
    const conn = $("conn");
    if (!document.hidden || !lastStatus) {
      try {
        const st = await requestJSON("v1/status", { headers: { accept: "application/json" } }, STATUS_TIMEOUT_MS);
        const now = Date.now() / 1000;
        lastStatus = st;
        record(st, now);
        render(st);
        conn.className = "conn ok";
        conn.textContent = "live \u00b7 updated " + fmtClock(now);
      } catch (e) {
        conn.className = "conn bad";
        conn.textContent = "status unavailable: " + e.message + " (retrying)";
      }
    }
    pollTimer = setTimeout(poll, REFRESH_MS);
  }

  // ---- playground ----------------------------------------------------------------------------
  async function onGenerate(ev) {
    ev.preventDefault();
    const btn = $("generate");
    const errBox = $("gen-error");
    const result = $("gen-result");
    const prompt = $("prompt").value;
    const maxBytes = Number($("max-bytes").value);
    const temp = Number($("temperature").value || 0);
    const body = { prompt: prompt, mode: $("mode").value, temperature: Number.isFinite(temp) ? temp : 0 };
    const rawMax = $("max-bytes").value.trim();
    if (rawMax !== "") {   // empty: the node's default for this run and mode
      body.max_bytes = Number.isFinite(maxBytes) ? Math.trunc(maxBytes) : rawMax;
    }
    btn.disabled = true;
    btn.textContent = "Generating\u2026";
    $("gen-out").setAttribute("aria-busy", "true");
    errBox.hidden = true;
    try {
      const out = await requestJSON("v1/generate", {
        method: "POST", headers: { "content-type": "application/json", accept: "application/json" },
        body: JSON.stringify(body),
      }, GENERATE_TIMEOUT_MS);
      $("gen-prompt").textContent = prompt;
      $("gen-text").textContent = out.text;
      const route = $("gen-route");
      const hops = [];
      for (const hop of out.route || []) {
        if (hops.length) {
          const arrow = el("li", "arrow", "\u2192");
          arrow.setAttribute("aria-hidden", "true");
          hops.push(arrow);
        }
        const li = el("li", "hop");
        li.dataset.block = String(hop.block);
        li.title = String(hop.peer);
        li.append(el("span", "hop-block", "block " + hop.block), " ", el("span", "peer", shortId(hop.peer)));
        hops.push(li);
      }
      route.replaceChildren(...hops);
      const meta = [fmtNum(out.bytes_generated, 0) + " bytes", out.mode === "one_sweep" ? "one sweep" : out.mode,
                    fmtNum(out.latency_ms, 0) + " ms",
                    fmtNum(out.traversals, 0) + (out.traversals === 1 ? " traversal" : " traversals")];
      if (out.failovers) meta.push(out.failovers + " failover(s)");
      if (Number.isFinite(out.bytes_out) && Number.isFinite(out.bytes_in)) {
        meta.push(fmtNum(out.bytes_out / 1024, 1) + " KiB sent, " + fmtNum(out.bytes_in / 1024, 1) + " KiB received");
      }
      $("gen-meta").textContent = meta.join(" \u00b7 ");
      result.hidden = false;
    } catch (e) {
      errBox.textContent = e.message;
      errBox.hidden = false;
    } finally {
      btn.disabled = false;
      btn.textContent = "Generate";
      $("gen-out").setAttribute("aria-busy", "false");
    }
  }

  // ---- start ---------------------------------------------------------------------------------
  function start() {
    $("gen-form").addEventListener("submit", onGenerate);
    $("max-bytes").addEventListener("input", () => { maxBytesTouched = true; });
    $("mode").addEventListener("change", renderLimits);
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { if (lastStatus) renderCharts(); }, 150);
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && pollTimer) { clearTimeout(pollTimer); poll(); }
    });
    renderCharts();
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
