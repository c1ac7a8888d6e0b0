// app.js: the ztrain dashboard. Polls the coordinator's JSON API every two
// seconds and redraws the jobs, workers and logbook tables and the loss and
// learning-rate curves of the newest job (with markers where a generation
// started: restarts, rollbacks). Needs nothing outside this coordinator.
"use strict";

const $ = (sel) => document.querySelector(sel);
let lossChart = null, lrChart = null, shownJob = null;

async function get(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
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

const fmtTime = (ms) => ms ? new Date(ms).toLocaleTimeString() : "-";
const fmtNum = (x, d) => (x === null || x === undefined || Number.isNaN(x)) ? "-" : Number(x).toFixed(d);

function chart(canvas, label, color) {
  return new Chart(canvas, {
    type: "line",
    data: { datasets: [
      { label: label, data: [], borderColor: color, pointRadius: 1.5, borderWidth: 1.5 },
      { label: "new generation (restart or rollback)", data: [], showLine: false,
        pointStyle: "triangle",
        pointRadius: 6, borderColor: "#b00", backgroundColor: "#b00" },
    ] },
    options: { animation: false, parsing: false,
      scales: { x: { type: "linear", title: { display: true, text: "step" } } } },
  });
}

async function refreshCharts(job) {
  const m = await get(`/v1/jobs/${job.id}/metrics`);
  const pts = (key) => m.steps.map((s) => ({ x: s.step, y: s[key] }));
  // A marker at the first step each generation reported.
  const marks = (key) => m.steps.filter((s, i) => i > 0 && s.generation !== m.steps[i - 1].generation)
    .map((s) => ({ x: s.step, y: s[key] }));
  if (!lossChart) lossChart = chart($("#loss"), "loss", "#235");
  if (!lrChart) lrChart = chart($("#lr"), "learning rate", "#363");
  lossChart.data.datasets[0].data = pts("loss");
  lossChart.data.datasets[1].data = marks("loss");
  lrChart.data.datasets[0].data = pts("lr");
  lrChart.data.datasets[1].data = marks("lr");
  lossChart.update();
  lrChart.update();
  // For tests and scripts: how many points each chart drew.
  $("#loss").dataset.points = String(lossChart.data.datasets[0].data.length);
  $("#lr").dataset.points = String(lrChart.data.datasets[0].data.length);
  $("#jobname").textContent = `(job ${job.id}: ${job.name})`;
}

async function refresh() {
  try {
    const [st, jobs, workers, events] = await Promise.all([
      get("/v1/status"), get("/v1/jobs"), get("/v1/workers"), get("/v1/events?limit=100000")]);
    $("#coord").textContent = `coordinator epoch ${st.coordinator_epoch}, ` +
      `${st.workers.alive} workers alive`;
    fill("#jobs", jobs.jobs.map((j) => [cell(j.id), cell(j.name), cell(j.state, "state-" + j.state),
      cell(j.generation), cell(j.world), cell(`${j.step}/${j.total_steps}`), cell(fmtNum(j.loss, 4)),
      cell(fmtNum(j.tokens_per_s, 0)), cell(j.restarts), cell(j.message)]));
    fill("#workers", workers.workers.map((w) => [cell(w.id), cell(w.name),
      cell(w.state, "state-" + w.state), cell(w.device), cell(w.host), cell(w.pid),
      cell(fmtTime(w.last_seen_ms))]));
    fill("#events", events.events.slice(-50).reverse().map((e) => [cell(fmtTime(e.t_ms)),
      cell(e.job_id || ""), cell(e.kind), cell(e.worker_id || ""), cell(e.detail)]));
    const job = jobs.jobs.filter((j) => j.generation > 0).pop();
    if (job) {
      shownJob = job.id;
      await refreshCharts(job);
      const ck = await get(`/v1/jobs/${job.id}/checkpoints`);
      $("#ckjob").textContent = `(job ${job.id})`;
      fill("#checkpoints", ck.checkpoints.slice().reverse().map((c) => [cell(c.step),
        cell(c.generation), cell(c.state, c.state === "committed" ? "state-alive" : "state-left"),
        cell(c.world), cell(fmtNum(c.bytes / 1e6, 2)), cell(fmtTime(c.t_ms)), cell(c.dir)]));
    }
    document.body.dataset.ready = "1";
  } catch (e) {
    $("#coord").textContent = "coordinator unreachable: " + e.message;
  }
}

refresh();
setInterval(refresh, 2000);
