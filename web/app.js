// app.js: the ztrain dashboard, one job at a time. The job is picked in the
// header (newest first; the URL hash #job=N keeps the choice, so a link or
// a reload shows the same job); the default is the newest job that started.
// It shows the job's training and validation loss, learning rate, gradient
// norm and tokens per second per step, a dashed vertical line where a
// generation started or a rollback happened (the reason on hover, and in
// the list under the loss chart), the newest committed checkpoint, the
// workers and the logbook. While the picked job has not ended the page
// polls the coordinator's JSON API every two seconds, fetching only new
// steps and logbook entries; once it has ended, polling stops (picking a
// job or reloading starts it again). Needs nothing outside this
// coordinator: Chart.js is served by it too.
//
// For tests and scripts the page also says what it drew in data-
// attributes: body[data-ready], #jobinfo[data-job, data-state, data-step,
// data-total, data-checkpoint-step, data-live], canvas[data-points] (and
// #loss[data-val-points, data-marks]), #markers li[data-step, data-kinds].
"use strict";

const POLL_MS = 2000;
const ENDED = new Set(["completed", "failed", "canceled"]);
const MARK_KINDS = new Set(["generation_started", "rollback"]);
const $ = (sel) => document.querySelector(sel);

// What is cached of the job shown; reset when another job is picked.
const view = {
  job: 0,          // its id (0: none yet)
  steps: [],       // its step records, ascending by step
  events: [],      // its logbook events that make markers
  eventsAfter: 0,  // the newest of its event ids fetched
  eventsGen: -1,   // its generation when its events were fetched
  marks: [],       // markers: {step, kinds, text}, ascending by step
};
const logbook = { after: 0, rows: [] };  // the newest entries, all jobs
const charts = {};
let timer = null, busy = false, again = false;

async function get(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

// ---- formatting and tables ---------------------------------------------------

const fmtTime = (ms) => ms ? new Date(ms).toLocaleTimeString() : "-";
const fmtNum = (x, d) => (x === null || x === undefined || Number.isNaN(x)) ? "-" : Number(x).toFixed(d);

function fmtDuration(s) {
  const t = Math.round(s);
  if (t < 60) return `${t}s`;
  if (t < 3600) return `${Math.floor(t / 60)}m${String(t % 60).padStart(2, "0")}s`;
  return `${Math.floor(t / 3600)}h${String(Math.floor(t / 60) % 60).padStart(2, "0")}m`;
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function link(text, href) {
  const td = document.createElement("td"), a = document.createElement("a");
  a.textContent = text;
  a.href = href;
  td.append(a);
  return td;
}

function fill(table, rows) {
  const tb = $(table + " tbody");
  tb.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    tr.append(...cells);
    return tr;
  }));
}

// ---- which job -----------------------------------------------------------------

// The job id in the URL hash (#job=N), or 0.
function hashJob() {
  const m = /^#job=(\d{1,15})$/.exec(location.hash);
  return m ? Number(m[1]) : 0;
}

// The hash's job if there is one, else the newest job that started, else
// the newest job; null when there are no jobs.
function pickJob(jobs) {
  const want = hashJob();
  const byHash = jobs.find((j) => j.id === want);
  if (byHash) return byHash;
  const started = jobs.filter((j) => j.generation > 0);
  return (started.length ? started : jobs).reduce((a, j) => (!a || j.id > a.id ? j : a), null);
}

function fillPicker(jobs, shown) {
  const sel = $("#job-picker");
  const opts = jobs.slice().sort((a, b) => b.id - a.id).map((j) => {
    const o = document.createElement("option");
    o.value = String(j.id);
    o.textContent = `#${j.id} ${j.name} (${j.state}, step ${j.step}/${j.total_steps})`;
    return o;
  });
  sel.replaceChildren(...opts);
  if (shown) sel.value = String(shown.id);
}

function resetView(id) {
  Object.assign(view, { job: id, steps: [], events: [], eventsAfter: 0, eventsGen: -1, marks: [] });
}

// ---- fetching: only what is new ---------------------------------------------------

// The job's logbook events that make markers. A failure loop collapses
// repeats of generation_started into one row (its first detail and time,
// and the latest's), so the list is fetched afresh whenever the generation
// changed.
async function fetchJobEvents(job) {
  if (job.generation !== view.eventsGen) {
    view.events = [];
    view.eventsAfter = 0;
  }
  const r = await get(`/v1/events?job=${job.id}&after=${view.eventsAfter}&limit=100000`);
  for (const e of r.events) {
    view.eventsAfter = Math.max(view.eventsAfter, e.id);
    if (MARK_KINDS.has(e.kind)) view.events.push(e);
  }
  view.eventsGen = job.generation;
}

// The first step whose record may be new or changed since the last fetch.
// A generation reports its steps in order from its start step on, replacing
// the records of the steps it replays, and a record of the current
// generation never changes: so what follows the newest record of the
// current generation, or, before it reported one, what follows its start.
function stepsFrom(job) {
  for (let i = view.steps.length - 1; i >= 0; i--)
    if (view.steps[i].generation === job.generation) return view.steps[i].step + 1;
  const m = view.events.map(parseGeneration).find((g) => g && g.gen === job.generation);
  return m ? m.step + 1 : 0;
}

// The API returns at most this many steps per request; a longer history
// is read in pages, each from the step after the previous page's last.
const STEPS_PAGE = 10000;

async function fetchSteps(job) {
  const from = stepsFrom(job);
  let steps = [];
  for (let next = from; ;) {
    const r = await get(`/v1/jobs/${job.id}/metrics?from=${next}&limit=${STEPS_PAGE}`);
    steps = steps.concat(r.steps);
    if (r.steps.length < STEPS_PAGE) break;
    next = r.steps[r.steps.length - 1].step + 1;
  }
  view.steps = view.steps.filter((s) => s.step < from).concat(steps);
}

// ---- markers -----------------------------------------------------------------------

// A collapsed row's latest occurrence (its detail and time), else the row's.
function latest(e) {
  return e.count > 1 && e.last_detail ? { detail: e.last_detail, t_ms: e.last_ms } : e;
}

// generation_started: "generation G: ..., start step S, ...; reason: R".
function parseGeneration(e) {
  if (e.kind !== "generation_started") return null;
  const m = /^generation (\d+):.*?start step (\d+)/.exec(latest(e).detail);
  return m ? { gen: Number(m[1]), step: Number(m[2]) } : null;
}

// The step an event happened at, read from the job's steps by time: the
// last step recorded before it (records of replayed steps are newer).
function stepAtTime(t) {
  let at = 0;
  for (const s of view.steps) {
    if (s.t_ms > t) break;
    at = s.step;
  }
  return at;
}

// Where a marker goes: a new generation at its start step, a rollback at
// the step it went back to ("... (step S)"), otherwise by time.
function markerStep(e) {
  const g = parseGeneration(e);
  if (g) return g.step;
  const l = latest(e);
  const m = /\(step (\d+)\)\s*$/.exec(l.detail);
  return m ? Number(m[1]) : stepAtTime(l.t_ms);
}

// One marker per step: every generation after the first and every
// rollback, with their details as the reason.
function buildMarks() {
  const at = new Map();
  for (const e of view.events) {
    const g = parseGeneration(e);
    if (g && g.gen <= 1) continue;
    const step = markerStep(e);
    const m = at.get(step) || { step, kinds: new Set(), lines: [] };
    m.kinds.add(e.kind);
    m.lines.push(`${e.kind}: ${latest(e).detail}`);
    at.set(step, m);
  }
  view.marks = [...at.values()].sort((a, b) => a.step - b.step)
    .map((m) => ({ step: m.step, kinds: [...m.kinds].join(" "), text: m.lines.join("\n") }));
}

function drawMarkList() {
  $("#markers").replaceChildren(...view.marks.map((m) => {
    const li = document.createElement("li");
    li.dataset.step = String(m.step);
    li.dataset.kinds = m.kinds;
    li.title = m.text;
    li.className = m.kinds.includes("rollback") ? "mark-rollback" : "mark-generation";
    li.textContent = `step ${m.step}: ${m.text.replace(/\n/g, " | ")}`;
    return li;
  }));
}

// A Chart.js plugin: a dashed vertical line at each marker's step.
const vlines = {
  id: "ztVlines",
  afterDatasetsDraw(chart) {
    const { ctx, chartArea: a, scales: { x } } = chart;
    ctx.save();
    ctx.setLineDash([4, 3]);
    ctx.lineWidth = 1;
    for (const m of view.marks) {
      const px = x.getPixelForValue(m.step);
      if (px < a.left || px > a.right) continue;
      ctx.strokeStyle = m.kinds.includes("rollback") ? "#b00" : "#c70";
      ctx.beginPath();
      ctx.moveTo(px, a.top);
      ctx.lineTo(px, a.bottom);
      ctx.stroke();
    }
    ctx.restore();
  },
};

// ---- charts ----------------------------------------------------------------------------

function series(label, color, extra) {
  return { label, data: [], borderColor: color, backgroundColor: color, pointRadius: 1.5,
           borderWidth: 1.5, ...extra };
}

// The reason of a marker on hover; the value of any other point.
function tooltipLabel(ctx) {
  if (ctx.raw && ctx.raw.text) return ctx.raw.text.split("\n");
  return `${ctx.dataset.label}: ${ctx.formattedValue}`;
}

function chart(canvas, datasets, yFromZero) {
  return new Chart(canvas, {
    type: "line",
    data: { datasets },
    options: { animation: false, parsing: false,
      plugins: { tooltip: { callbacks: { label: tooltipLabel } },
                 // Long runs: at most ~1000 points a line, keeping the
                 // extremes (spikes stay visible).
                 decimation: { enabled: true, algorithm: "min-max" } },
      scales: { x: { type: "linear", title: { display: true, text: "step" } },
                y: { beginAtZero: !!yFromZero } } },
    plugins: [vlines],
  });
}

function makeCharts() {
  if (charts.loss) return;
  charts.loss = chart($("#loss"), [
    series("training loss", "#235"),
    series("validation loss", "#c60", { pointRadius: 3 }),
    series("generation change or rollback (hover: reason)", "#b00",
           { showLine: false, pointStyle: "triangle", pointRadius: 7 }),
  ]);
  charts.lr = chart($("#lr"), [series("learning rate", "#363")]);
  charts.gradnorm = chart($("#gradnorm"), [series("gradient norm", "#639")]);
  charts.tokens = chart($("#tokens"), [series("tokens/s", "#366")], true);
}

// The training loss at the recorded step nearest to `step`.
function lossNear(step) {
  let best = null;
  for (const s of view.steps)
    if (!best || Math.abs(s.step - step) < Math.abs(best.step - step)) best = s;
  return best ? best.loss : 0;
}

// Sets a line's points; returns how many (the chart may draw fewer).
function setSeries(name, i, pts) {
  charts[name].data.datasets[i].data = pts;
  return pts.length;
}

function drawCharts() {
  makeCharts();
  const pts = (key) => view.steps.filter((s) => s[key] !== null && s[key] !== undefined)
    .map((s) => ({ x: s.step, y: s[key] }));
  const n = {
    loss: setSeries("loss", 0, pts("loss")),
    lr: setSeries("lr", 0, pts("lr")),
    gradnorm: setSeries("gradnorm", 0, pts("grad_norm")),
    tokens: setSeries("tokens", 0, pts("tokens_per_s")),
  };
  const nval = setSeries("loss", 1, pts("val_loss"));
  setSeries("loss", 2, view.marks.map((m) => ({ x: m.step, y: lossNear(m.step), text: m.text })));
  for (const name of Object.keys(charts)) {
    // Long runs: lines, whose undrawn points take no hover (a marker drawn
    // over one keeps its tooltip).
    const line = charts[name].data.datasets[0], many = n[name] > 400;
    line.pointRadius = many ? 0 : 1.5;
    line.pointHitRadius = many ? 0 : 1;
    charts[name].update();
    charts[name].canvas.dataset.points = String(n[name]);
  }
  $("#loss").dataset.valPoints = String(nval);
  $("#loss").dataset.marks = String(view.marks.length);
}

// ---- the job's summary and checkpoints --------------------------------------------------

// Time left at the rate of the current generation's last (up to) 100 steps.
function eta(job) {
  if (job.state !== "running") return null;
  const cur = view.steps.filter((s) => s.generation === job.generation).slice(-100);
  if (cur.length < 2) return null;
  const a = cur[0], b = cur[cur.length - 1];
  const perStep = (b.t_ms - a.t_ms) / 1000 / (b.step - a.step);
  return perStep > 0 ? fmtDuration(perStep * (job.total_steps - job.step)) : null;
}

function newestCommitted(cks) {
  return cks.filter((c) => c.state === "committed").reduce((m, c) => Math.max(m, c.step), -1);
}

function span(text, cls) {
  const s = document.createElement("span");
  s.textContent = text;
  if (cls) s.className = cls;
  return s;
}

function drawJobInfo(job, cks) {
  const info = $("#jobinfo"), ck = newestCommitted(cks);
  const val = view.steps.filter((s) => s.val_loss !== null && s.val_loss !== undefined).pop();
  const left = eta(job);
  info.dataset.job = String(job.id);
  info.dataset.state = job.state;
  info.dataset.step = String(job.step);
  info.dataset.total = String(job.total_steps);
  info.dataset.checkpointStep = String(ck);
  const parts = [
    span(job.state, "state-" + job.state),
    span(`step ${job.step}/${job.total_steps}`),
    span(`loss ${fmtNum(job.loss, 4)}`),
    span(val ? `val loss ${fmtNum(val.val_loss, 4)} (step ${val.step})` : "val loss -"),
    span(`${fmtNum(job.tokens_per_s, 0)} tokens/s`),
    span(`generation ${job.generation}, world ${job.world}`),
    span(ck >= 0 ? `newest committed checkpoint: step ${ck}` : "no committed checkpoint",
         "ckpt"),
  ];
  if (left) parts.splice(5, 0, span(`ETA ${left}`));
  if (job.message) parts.push(span(job.message, "message"));
  info.replaceChildren(...parts);
  $("#jobname").textContent = `${job.id}: ${job.name}`;
}

function drawCheckpoints(job, cks) {
  const ck = newestCommitted(cks);
  $("#ckjob").textContent = `(job ${job.id}` + (ck >= 0 ? `; newest committed: step ${ck})` : ")");
  fill("#checkpoints", cks.slice().reverse().map((c) => [cell(c.step),
    cell(c.generation), cell(c.state, c.state === "committed" ? "state-alive" : "state-left"),
    cell(c.world), cell(fmtNum(c.bytes / 1e6, 2)), cell(fmtTime(c.t_ms)), cell(c.dir)]));
}

async function showJob(job) {
  if (job.id !== view.job) resetView(job.id);
  await fetchJobEvents(job);
  const [, ck] = await Promise.all([fetchSteps(job), get(`/v1/jobs/${job.id}/checkpoints`)]);
  buildMarks();
  drawCharts();
  drawMarkList();
  drawJobInfo(job, ck.checkpoints);
  drawCheckpoints(job, ck.checkpoints);
}

// ---- the other tables ------------------------------------------------------------------------

async function fetchLogbook() {
  // The newest 50 at first, then whatever came after them.
  const r = await get(logbook.after ? `/v1/events?after=${logbook.after}&limit=100000`
                                    : "/v1/events?tail=50");
  for (const e of r.events) logbook.after = Math.max(logbook.after, e.id);
  logbook.rows = logbook.rows.concat(r.events).slice(-50);
}

function drawTables(st, jobs, workers) {
  $("#coord").textContent = `coordinator epoch ${st.coordinator_epoch}, ` +
    `${st.workers.alive} workers alive`;
  fill("#jobs", jobs.map((j) => [link(j.id, `#job=${j.id}`), cell(j.name),
    cell(j.state, "state-" + j.state), cell(j.generation), cell(j.world),
    cell(`${j.step}/${j.total_steps}`), cell(fmtNum(j.loss, 4)), cell(fmtNum(j.tokens_per_s, 0)),
    cell(j.restarts), cell(j.message)]));
  fill("#workers", workers.map((w) => [cell(w.id), cell(w.name),
    cell(w.state, "state-" + w.state), cell(w.device), cell(w.host), cell(w.pid),
    cell(fmtTime(w.last_seen_ms))]));
  fill("#events", logbook.rows.slice().reverse().map((e) => [cell(fmtTime(e.t_ms)),
    cell(e.job_id || ""), cell(e.kind), cell(e.worker_id || ""), cell(e.count > 1
      ? `${e.detail} (x${e.count}; the last at ${fmtTime(e.last_ms)}: ${e.last_detail})`
      : e.detail)]));
}

// ---- the refresh loop -----------------------------------------------------------------------------

function setLive(live, job) {
  $("#jobinfo").dataset.live = live ? "1" : "0";
  $("#live").textContent = live ? "live: refreshing every 2 s"
    : `job ${job.id} ${job.state}: not refreshing (pick a job or reload)`;
}

// One refresh; then another in POLL_MS unless the job shown has ended (an
// error, or no job yet, keeps polling: the coordinator may come back, a
// job may be submitted). Calls while one runs are folded into one more.
async function refresh() {
  if (busy) {
    again = true;
    return;
  }
  busy = true;
  clearTimeout(timer);
  timer = null;
  let job = null, ok = false;
  try {
    const [st, jobs, workers] = await Promise.all([get("/v1/status"), get("/v1/jobs"),
                                                   get("/v1/workers")]);
    await fetchLogbook();
    drawTables(st, jobs.jobs, workers.workers);
    job = pickJob(jobs.jobs);
    fillPicker(jobs.jobs, job);
    if (job) await showJob(job);
    ok = true;
    document.body.dataset.ready = "1";
  } catch (e) {
    $("#coord").textContent = "coordinator unreachable: " + e.message;
  }
  const live = !ok || !job || !ENDED.has(job.state);
  setLive(live, job);
  busy = false;
  if (again) {
    again = false;
    refresh();
  } else if (live) {
    timer = setTimeout(refresh, POLL_MS);
  }
}

$("#job-picker").addEventListener("change", (ev) => { location.hash = `job=${ev.target.value}`; });
window.addEventListener("hashchange", refresh);
refresh();
