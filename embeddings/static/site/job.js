// Job page: re-reads GET /api/jobs/{id}/ once a second while the job is live and redraws the
// progress bar, rate, ETA, at-risk flag, failures, stage table and chart; the buttons call
// POST /api/jobs/{id}/{pause|resume|cancel}/.
"use strict";
(function () {
  const root = document.getElementById("job");
  const url = root.dataset.url;
  const STAGES = ["load", "decode", "decode_wait", "preprocess", "embed", "upsert", "total"];
  const live = { queued: 1, running: 1, paused: 1 };
  function $(id) { return document.getElementById(id); }
  function fmt(n, d) { return n === null || n === undefined ? "–" : Number(n).toFixed(d); }

  function render(d) {
    const done = d.finished || 0, total = d.total || 0;
    const pct = total ? Math.floor(100 * done / total) : 100;
    $("job-status").textContent = d.status;
    $("job-status").className = "badge s-" + d.status;
    $("job-risk").hidden = !d.at_risk;
    $("job-done").textContent = done;
    $("job-total").textContent = total;
    $("job-percent").textContent = pct;
    $("job-bar").setAttribute("aria-valuenow", String(pct));
    $("job-bar").firstElementChild.style.width = pct + "%";
    $("job-embedded").textContent = d.embedded;
    $("job-skipped").textContent = d.skipped;
    $("job-failed").textContent = d.failed;
    $("job-rate").textContent = fmt(d.throughput_images_per_s, 2);
    $("job-eta").textContent = d.eta ? new Date(d.eta).toLocaleTimeString() : (live[d.status] ? "–" : "finished");
    $("job-batches").textContent = d.batches;
    $("btn-pause").disabled = !(d.status === "queued" || d.status === "running");
    $("btn-resume").disabled = d.status !== "paused";
    $("btn-cancel").disabled = !live[d.status];

    const body = $("job-timings").tBodies[0];
    body.textContent = "";
    const t = d.timings_ms || {};
    const shown = STAGES.filter(function (s) { return t[s]; });
    shown.forEach(function (s) {
      const tr = document.createElement("tr");
      tr.appendChild(Site.el("th", { scope: "row" }, s.replace("_", " ")));
      [t[s].min, t[s].avg, t[s].p95, t[s].max].forEach(function (v) { tr.appendChild(Site.el("td", {}, fmt(v, 1))); });
      tr.appendChild(Site.el("td", {}, fmt(t[s].per_image_avg, 2)));
      body.appendChild(tr);
    });
    chart(shown.filter(function (s) { return s !== "total"; }), t);

    const fl = $("job-failures");
    fl.textContent = "";
    if (!d.failures || !d.failures.length) fl.appendChild(Site.el("li", { "class": "hint" }, "None."));
    (d.failures || []).forEach(function (f) {
      const li = Site.el("li");
      li.appendChild(Site.el("strong", {}, f.original_name || f.id));
      li.appendChild(document.createTextNode(": " + Site.reasonWords(f.reason) + " (" + f.reason + ")"));
      fl.appendChild(li);
    });
  }

  function chart(stages, t) {
    // Horizontal bars of the average time per batch in each stage.
    const svg = $("job-chart");
    const NS = "http://www.w3.org/2000/svg";
    svg.textContent = "";
    const max = Math.max.apply(null, stages.map(function (s) { return t[s].avg; }).concat([1]));
    const rowH = 20, left = 90, width = 220;
    svg.setAttribute("viewBox", "0 0 320 " + Math.max(40, stages.length * rowH + 8));
    stages.forEach(function (s, i) {
      const y = 4 + i * rowH;
      const label = document.createElementNS(NS, "text");
      label.setAttribute("x", "4"); label.setAttribute("y", String(y + 13)); label.setAttribute("font-size", "11");
      label.setAttribute("fill", "#1b1f24");
      label.textContent = s.replace("_", " ");
      const bar = document.createElementNS(NS, "rect");
      const w = Math.max(1, width * t[s].avg / max);
      bar.setAttribute("x", String(left)); bar.setAttribute("y", String(y + 2));
      bar.setAttribute("width", String(w)); bar.setAttribute("height", String(rowH - 6)); bar.setAttribute("fill", "#1f4e8c");
      const val = document.createElementNS(NS, "text");
      val.setAttribute("x", String(Math.min(left + w + 4, 290))); val.setAttribute("y", String(y + 13));
      val.setAttribute("font-size", "10"); val.setAttribute("fill", "#1b1f24");
      val.textContent = fmt(t[s].avg, 0);
      svg.appendChild(label); svg.appendChild(bar); svg.appendChild(val);
    });
  }

  let data = JSON.parse($("job-data").textContent);
  render(data);
  async function refresh() {
    const r = await Site.api("GET", url);
    if (r.status === 200) { data = r.data; render(data); }
    if (live[data.status]) setTimeout(refresh, 1000);
  }
  if (live[data.status]) setTimeout(refresh, 1000);

  root.querySelectorAll("button[data-action]").forEach(function (b) {
    b.addEventListener("click", async function () {
      const action = b.dataset.action;
      if (action === "cancel" && !window.confirm("Cancel this job? Images not yet embedded are dropped.")) return;
      const r = await Site.api("POST", url + action + "/");
      const msg = $("job-message");
      if (r.status === 200) {
        msg.textContent = { pause: "Paused: running chunks finish, the rest wait.", resume: "Resumed.",
                            cancel: "Cancelled." }[action];
        data = Object.assign({}, data, { status: r.data.status });
        render(data);  // the refresh loop runs on while the job is live (paused included)
      } else {
        msg.textContent = Site.reasonWords(r.data && r.data.code) + " " + ((r.data && r.data.message) || "");
      }
    });
  });
})();
