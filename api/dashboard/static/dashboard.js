// Quilt dashboard: draws the plots of the run, spend and operator pages with uPlot
// (served from the project's own node_modules) and refreshes them by polling the JSON routes
// under /dashboard/data. No inline scripts: the pages' Content-Security-Policy forbids them.
//
// Every plot element gets data-drawn="1" and data-points="<points of its longest series>" once
// drawn, so tests (and people) can tell a drawn plot from an empty one.
"use strict";

(function () {
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d"];
  const RUN_POLL_MS = 5000;
  const OPS_POLL_MS = 3000;
  const LIVE_HISTORY = 200; // samples of the live-only series (queue depth, slots) kept in the page

  // ------------------------------------------------------------------ plotting

  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];

  // Tick labels that stay readable from micro-dollars to millions of tokens.
  function axisNumbers(u, splits) {
    return splits.map((v) => {
      if (v === null || v === undefined) return "";
      if (v === 0) return "0";
      const a = Math.abs(v);
      if (a >= 1e6) return (v / 1e6).toPrecision(3) + "M";
      if (a >= 1e4) return (v / 1e3).toPrecision(3) + "k";
      if (a < 1e-3) return v.toExponential(1);
      return String(Number(v.toPrecision(4)));
    });
  }

  function shortLabel(label) {
    const s = String(label);
    return s.length > 14 ? s.slice(0, 13) + "\u2026" : s;
  }

  function countPoints(values) {
    return values.filter((v) => v !== null && v !== undefined && !Number.isNaN(v)).length;
  }

  function options(el, spec) {
    const bars = spec.kind === "bars";
    const series = [{ label: spec.xLabel || (spec.time ? "time" : "step") }];
    const k = spec.series.length;
    spec.series.forEach((s, i) => {
      const color = COLORS[i % COLORS.length];
      const o = { label: s.label, stroke: color, width: 2, scale: s.scale || "y" };
      if (bars) {
        o.fill = color + "aa";
        o.width = 0;
        o.points = { show: false };
        o.paths = uPlot.paths.bars({ size: [0.8 / Math.max(1, k), 80] });
      } else {
        o.points = { show: spec.x.length <= 60, size: 5 };
        o.spanGaps = true;
      }
      series.push(o);
    });
    const axes = [{ label: spec.xLabel || (spec.time ? "" : "step") },
      { label: spec.yLabel || "", values: axisNumbers, size: 60 }];
    const scales = { x: { time: !!spec.time } };
    if (spec.xLabels) {
      const labels = spec.xLabels;
      scales.x.range = () => [-0.5, labels.length - 0.5];
      axes[0].splits = () => labels.map((_, i) => i);
      // Tenant names are long and many: slanted and cut to a fixed width they never overlap; the
      // legend (series[0].value) still shows the whole name of the bar under the cursor.
      const slant = labels.some((l) => String(l).length > 6);
      axes[0].values = (u, splits) => splits.map((v) => shortLabel(labels[v] ?? ""));
      if (slant) {
        axes[0].rotate = -35;
        axes[0].size = 70;
      }
      axes[0].label = spec.xLabel || "";
      series[0].label = spec.xLabel || "";
      series[0].value = (u, v) => (v === null || v === undefined ? "" : labels[Math.round(v)] ?? "");
    } else if (!spec.time) {
      axes[0].incrs = STEP_INCRS; // steps are whole numbers
    } else {
      // One sample (a live series just opened) would otherwise stretch the axis over years.
      scales.x.range = (u, min, max) => (max - min < 1 ? [max - 60, max + 1] : [min, max]);
    }
    if (spec.series.some((s) => s.scale === "y2")) {
      axes.push({ side: 1, scale: "y2", label: spec.y2Label || "", grid: { show: false }, values: axisNumbers,
        size: 60 });
      scales.y2 = spec.y2Range ? { range: () => spec.y2Range } : {};
    }
    if (spec.yRange) scales.y = { range: () => spec.yRange };
    return {
      width: Math.max(280, el.clientWidth || 600),
      height: spec.height || 240,
      title: el.dataset.title || "",
      scales,
      series,
      axes,
      legend: { show: true },
    };
  }

  // Draw `spec` into `el`, or update it in place when only the numbers changed.
  // spec: {x: [...], series: [{label, values, scale?}], kind?: "line"|"bars", time?, xLabels?, yLabel?}
  function plot(el, spec) {
    if (!el || typeof uPlot === "undefined") return;
    const data = [spec.x, ...spec.series.map((s) => s.values)];
    const sig = JSON.stringify([spec.kind, spec.time, spec.xLabels || null, spec.series.map((s) => s.label)]);
    if (el._uplot && el._sig === sig) {
      el._uplot.setData(data);
    } else {
      if (el._uplot) el._uplot.destroy();
      el._uplot = new uPlot(options(el, spec), data, el);
      el._sig = sig;
    }
    const points = spec.series.length ? Math.max(...spec.series.map((s) => countPoints(s.values))) : 0;
    el.dataset.points = String(points);
    el.dataset.drawn = "1";
    el.classList.toggle("empty", points === 0);
  }

  // Grouped bars over categories: series j of k sits at category + offset_j, so one shared x array
  // carries every bar and the others' slots stay undefined (uPlot skips them).
  function barPlot(el, labels, series, extra) {
    const k = Math.max(1, series.length);
    const width = 0.8 / k;
    const x = [];
    const cols = series.map(() => []);
    labels.forEach((_, c) => {
      series.forEach((s, j) => {
        x.push(c + (j - (k - 1) / 2) * width);
        cols.forEach((col, jj) => col.push(jj === j ? s.values[c] : undefined));
      });
    });
    plot(el, Object.assign({ kind: "bars", x, xLabels: labels,
      series: series.map((s, j) => ({ label: s.label, values: cols[j] })) }, extra || {}));
    const points = labels.length && series.length ? Math.max(...series.map((s) => countPoints(s.values))) : 0;
    el.dataset.points = String(points);
  }

  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (r.status === 401) {
      window.location.assign("/dashboard/login?next=" + encodeURIComponent(window.location.pathname));
      throw new Error("logged out");
    }
    if (!r.ok) throw new Error(url + " answered " + r.status);
    return r.json();
  }

  function poll(fn, ms) {
    let timer = null;
    const tick = async () => {
      try {
        await fn();
        document.body.dataset.lastRefresh = String(Date.now());
      } catch (e) {
        console.warn(e);
      }
      timer = setTimeout(tick, document.hidden ? ms * 4 : ms);
    };
    tick();
    return () => clearTimeout(timer);
  }

  function setText(id, text) {
    const el = document.getElementById(id);
    if (el) el.textContent = text;
  }

  function fmt(v, digits) {
    if (v === null || v === undefined) return "–";
    return Number(v).toLocaleString(undefined, { maximumFractionDigits: digits ?? 3 });
  }

  function pct(v) {
    return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %";
  }

  // ------------------------------------------------------------------ run page

  // Rows at one step (e.g. several forward_backward calls before one optim_step) are averaged.
  function seriesByStep(rows, source, name) {
    const acc = new Map();
    for (const r of rows) {
      if (r.source !== source) continue;
      const v = r.metrics[name];
      if (v === null || v === undefined) continue;
      const a = acc.get(r.step) || [0, 0];
      a[0] += v;
      a[1] += 1;
      acc.set(r.step, a);
    }
    const steps = [...acc.keys()].sort((a, b) => a - b);
    return { x: steps, values: steps.map((s) => acc.get(s)[0] / acc.get(s)[1]) };
  }

  function metricNames(rows, source) {
    const names = new Set();
    for (const r of rows) if (r.source === source) Object.keys(r.metrics).forEach((n) => names.add(n));
    return [...names].sort();
  }

  // Several series on one step axis: the union of their steps, gaps where a series has no value.
  function mergeOnSteps(parts) {
    const steps = [...new Set(parts.flatMap((p) => p.x))].sort((a, b) => a - b);
    return {
      x: steps,
      series: parts.map((p) => {
        const byStep = new Map(p.x.map((s, i) => [s, p.values[i]]));
        return { label: p.label, values: steps.map((s) => (byStep.has(s) ? byStep.get(s) : null)) };
      }),
    };
  }

  const OFF_POLICY = ["staleness:mean", "staleness:max", "mismatch_kl:mean", "logprob_diff_abs:mean"];
  // quilt.rl's per-step shares of time waiting on environments: one plot, not one each.
  const ENV_WAIT = ["env_wait_share", "trainer_env_wait_share"];
  // ... and where each step's time went, in seconds: one plot too.
  const ENV_TIME = {
    env_start_s: "environment start", env_step_s: "environment steps", reward_s: "reward calls",
    sample_s: "sampling", train_s: "training", env_wait_gpu_s: "trainer seconds lost to environments",
  };

  function clientPlotElement(container, name) {
    const id = "client-plot-" + name.replace(/[^A-Za-z0-9_-]/g, "_");
    let el = document.getElementById(id);
    if (!el) {
      el = document.createElement("div");
      el.id = id;
      el.className = "plot";
      el.dataset.title = name + (name === "reward_mean" ? " (reward)" : "");
      el.dataset.metric = name;
      container.appendChild(el);
    }
    return el;
  }

  function drawRun(data) {
    setText("run-status", data.status);
    setText("run-step", String(data.step));
    setText("run-in-flight", String(data.in_flight));
    setText("run-loss", fmt(data.loss, 4));
    const rows = data.metrics;
    const loss = seriesByStep(rows, "trainer", "loss:mean");
    plot(document.getElementById("loss-plot"), { x: loss.x, series: [{ label: "loss per token", values: loss.values }],
      yLabel: "loss" });

    const container = document.getElementById("client-plots");
    const names = metricNames(rows, "client").filter((n) => !ENV_WAIT.includes(n) && !(n in ENV_TIME));
    // reward_mean first: it is the curve RL users look for
    names.sort((a, b) => (a === "reward_mean" ? -1 : b === "reward_mean" ? 1 : a.localeCompare(b)));
    for (const name of names) {
      const s = seriesByStep(rows, "client", name);
      plot(clientPlotElement(container, name), { x: s.x, series: [{ label: name, values: s.values }] });
    }
    document.getElementById("client-empty").hidden = names.length > 0;

    const waits = ENV_WAIT.filter((n) => metricNames(rows, "client").includes(n));
    const envPlot = document.getElementById("envwait-plot");
    envPlot.hidden = waits.length === 0;
    if (waits.length) {
      const merged = mergeOnSteps(waits.map((n) => Object.assign(
        { label: n === "env_wait_share" ? "share of rollout time" : "share of trainer time" },
        seriesByStep(rows, "client", n))));
      plot(envPlot, Object.assign(merged, { yLabel: "share", yRange: [0, 1] }));
    }
    const times = Object.keys(ENV_TIME).filter((n) => metricNames(rows, "client").includes(n));
    const timePlot = document.getElementById("envtime-plot");
    timePlot.hidden = times.length === 0;
    if (times.length) {
      const merged = mergeOnSteps(times.map((n) => Object.assign({ label: ENV_TIME[n] }, seriesByStep(rows, "client", n))));
      plot(timePlot, Object.assign(merged, { yLabel: "seconds per step" }));
    }

    const present = OFF_POLICY.filter((n) => metricNames(rows, "trainer").includes(n));
    const off = document.getElementById("offpolicy-plot");
    off.hidden = present.length === 0;
    if (present.length) {
      const merged = mergeOnSteps(present.map((n) => Object.assign({ label: n }, seriesByStep(rows, "trainer", n))));
      merged.series.forEach((s) => { if (s.label.startsWith("staleness")) s.scale = "y2"; });
      plot(off, Object.assign(merged, { y2Label: "policy versions behind", yLabel: "mismatch" }));
    }
  }

  function runPage() {
    const root = document.getElementById("run");
    const url = "/dashboard/data/runs/" + encodeURIComponent(root.dataset.modelId);
    const stop = poll(async () => {
      const data = await getJSON(url);
      drawRun(data);
      if (data.status === "failed" || data.status === "lost" || data.status === "deleted") stop();
    }, RUN_POLL_MS);
  }

  // ------------------------------------------------------------------ spend page

  function spendPage() {
    const usage = JSON.parse(document.getElementById("usage-json").textContent);
    const days = usage.by_day.map((d) => d.day);
    barPlot(document.getElementById("spend-day-plot"), days,
      [{ label: "USD", values: usage.by_day.map((d) => d.cost_micro_usd / 1e6) }], { yLabel: "USD", xLabel: "day" });
    barPlot(document.getElementById("spend-model-plot"), usage.by_model.map((m) => m.base_model),
      [{ label: "USD", values: usage.by_model.map((m) => m.cost_micro_usd / 1e6) }],
      { yLabel: "USD", xLabel: "base model" });
  }

  // ------------------------------------------------------------------ operator page

  const live = new Map(); // base index -> {t, training, sampling, trainerQueued, genWaiting, slots}

  function remember(i, b, at) {
    const h = live.get(i) || { t: [], training: [], sampling: [], trainerQueued: [], genWaiting: [], slots: [] };
    h.t.push(at);
    h.training.push(b.queues.training);
    h.sampling.push(b.queues.sampling);
    h.trainerQueued.push(b.trainer.up ? b.trainer.queued : null);
    h.genWaiting.push(b.gen && b.gen.up ? b.gen.waiting : null);
    // Where the pool's beacon integrates occupancy (slot_s, capacity_s), use the utilisation over
    // the time since the last refresh; otherwise the instant's running / target.
    let slots = b.gen ? b.gen.slot_utilisation : null;
    const prev = h.lastGen;
    if (b.gen && prev && b.gen.capacity_s !== undefined && b.gen.capacity_s > prev.capacity_s) {
      slots = (b.gen.slot_s - prev.slot_s) / (b.gen.capacity_s - prev.capacity_s);
    }
    h.lastGen = b.gen;
    h.slots.push(slots);
    for (const k of Object.keys(h)) if (Array.isArray(h[k]) && h[k].length > LIVE_HISTORY) h[k].shift();
    live.set(i, h);
    return h;
  }

  function stats(i, b) {
    const t = b.trainer;
    const g = b.gen;
    setText(`trainer-up-${i}`, t.up ? "up" : "down");
    setText(`trainer-busy-${i}`, pct(t.busy_fraction_since_start));
    setText(`trainer-rounds-${i}`, fmt(t.rounds, 0));
    setText(`trainer-models-${i}`, t.up ? `${t.models} (${t.resident} resident, ${t.offloaded} offloaded)` : "–");
    setText(`queue-training-${i}`, fmt(b.queues.training, 0));
    setText(`queue-sampling-${i}`, fmt(b.queues.sampling, 0));
    setText(`fused-tenants-${i}`, fmt(b.fused.mean.tenants, 2));
    setText(`fused-tokens-${i}`, fmt(b.fused.mean.tokens, 0));
    setText(`fused-padding-${i}`, pct(b.fused.mean.padding_fraction));
    if (g) {
      setText(`gen-up-${i}`, g.up ? "up" : "down");
      setText(`gen-slots-${i}`, g.up ? `${g.running} / ${g.target} (${pct(g.slot_utilisation)})` : "–");
      setText(`gen-waiting-${i}`, g.up ? fmt(g.waiting, 0) : "–");
      if (g.group_latency_p50_s !== undefined) {
        setText(`gen-latency-${i}`, `${fmt(g.group_latency_p50_s, 2)} / ${fmt(g.group_latency_p95_s, 2)} s`);
      }
    }
  }

  function capacityText(c) {
    if (!c) return "no reading yet";
    const move = c.reason === "hold" ? "hold" : `move to ${c.recommended[0]} / ${c.recommended[1]} (${c.reason})`;
    const scaler = c.scaler ? `; scaler: ${c.scaler.gen} generation / ${c.scaler.trainer} trainer pods in ` +
      `service (${c.scaler.reason})` : "";
    return `${c.now[0]} / ${c.now[1]} now: ${move}; balanced at ${Math.round(100 * c.balanced_gen_share)}% ` +
      `generation (busy: generation ${Math.round(100 * c.gen_busy)}%, trainer ${Math.round(100 * c.trainer_busy)}%)` +
      scaler;
  }

  function drawBase(i, b, at) {
    stats(i, b);
    const cap = document.getElementById(`capacity-${i}`);
    if (cap) cap.textContent = capacityText(b.capacity);
    const h = remember(i, b, at);
    plot(document.getElementById(`queue-plot-${i}`), { time: true, x: h.t, yLabel: "requests", series: [
      { label: "training stream", values: h.training }, { label: "sampling stream", values: h.sampling },
      { label: "trainer holds", values: h.trainerQueued }, { label: "generator waiting", values: h.genWaiting }] });
    plot(document.getElementById(`rate-plot-${i}`), { time: true, x: b.rates.t, yLabel: "tokens/s", series: [
      { label: "generated (sample tokens/s)", values: b.rates.generated_tokens_per_s },
      { label: "trained (train tokens/s)", values: b.rates.trained_tokens_per_s }] });
    plot(document.getElementById(`busy-plot-${i}`), { time: true, x: b.busy.t, yRange: [0, 1], yLabel: "fraction",
      series: [{ label: "busy", values: b.busy.busy }, { label: "waiting", values: b.busy.waiting }] });
    plot(document.getElementById(`rounds-plot-${i}`), { time: true, x: b.fused.t, yLabel: "tenants", y2Label: "padding",
      y2Range: [0, 1],
      series: [{ label: "tenants per round", values: b.fused.tenants },
        { label: "padding fraction", values: b.fused.padding_fraction, scale: "y2" }] });
    plot(document.getElementById(`tokens-plot-${i}`), { time: true, x: b.fused.t, yLabel: "tokens",
      series: [{ label: "tokens per round", values: b.fused.tokens }] });
    const slots = document.getElementById(`slots-plot-${i}`);
    if (slots) plot(slots, { time: true, x: h.t, yRange: [0, 1], yLabel: "running / target",
      series: [{ label: "slot utilisation", values: h.slots }] });
  }

  function drawOps(data) {
    data.bases.forEach((b, i) => drawBase(i, b, data.at));
    const ttb = data.time_to_batch;
    setText("ttb-overall", ttb.groups
      ? `p50 ${fmt(ttb.p50_s, 2)} s · p95 ${fmt(ttb.p95_s, 2)} s over ${ttb.groups} groups`
      : "no finished sampling groups in the window");
    barPlot(document.getElementById("ttb-plot"), ttb.tenants,
      [{ label: "p50 (s)", values: ttb.p50 }, { label: "p95 (s)", values: ttb.p95 }],
      { yLabel: "seconds", xLabel: "tenant" });
    const st = data.staleness;
    setText("staleness-n", st.n ? `${st.n} forward_backward requests with sampler versions`
      : "no versioned data in the window");
    barPlot(document.getElementById("staleness-plot"), st.labels, [{ label: "requests", values: st.counts }],
      { xLabel: "policy versions behind", yLabel: "requests" });
    const sh = data.shares;
    barPlot(document.getElementById("share-plot"), sh.tenants, [
      { label: "trainer tokens", values: sh.trainer }, { label: "generated tokens", values: sh.generator },
      { label: "cost", values: sh.cost }], { yLabel: "share", yRange: [0, 1], xLabel: "tenant" });
    const ew = data.env_waits;
    barPlot(document.getElementById("envwait-plot"), ew.tenants, [
      { label: "share of rollout time", values: ew.rollout }, { label: "share of trainer time", values: ew.trainer }],
      { yLabel: "share", yRange: [0, 1], xLabel: "tenant" });
    barPlot(document.getElementById("envtime-plot"), ew.tenants, [
      { label: "environment start", values: ew.start_s }, { label: "environment steps", values: ew.step_s },
      { label: "reward calls", values: ew.reward_s }, { label: "sampling", values: ew.sample_s },
      { label: "training", values: ew.train_s }, { label: "trainer seconds lost to environments", values: ew.lost_s }],
      { yLabel: "seconds in the window", xLabel: "tenant" });
    setText("ops-window", `last ${Math.round(data.window_s / 60)} min, ${data.bin_s} s bins`);
  }

  function opsPage() {
    const root = document.getElementById("ops");
    const url = "/dashboard/data/ops?minutes=" + encodeURIComponent(root.dataset.minutes || "15");
    poll(async () => drawOps(await getJSON(url)), OPS_POLL_MS);
  }

  // ------------------------------------------------------------------ start

  const pages = { run: runPage, spend: spendPage, ops: opsPage };
  document.addEventListener("DOMContentLoaded", () => {
    const start = pages[document.body.dataset.page];
    if (start) start();
  });
})();
