// Job page: re-reads GET /api/jobs/{id}/ once a second while the job is live (or still reading its
// manifest or prefix) and redraws the progress bar, rate, ETA, at-risk flag, the source's rows read,
// failures by reason and their list, stage table and chart; the buttons call
// POST /api/jobs/{id}/{pause|resume|cancel}/. The server renders the same markup first (job.html).
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

    source(d);
    failures(d);
  }

  function source(d) {
    $("job-reading").hidden = !d.reading;
    if (!$("job-source")) return;
    const s = d.source || {};
    $("job-rows-read").textContent = s.rows_read || 0;
    $("job-reading-state").textContent = d.reading ? "reading…" : "finished";
    const err = $("job-source-error");
    err.hidden = !s.error;
    if (s.error) {
      err.textContent = "";
      err.appendChild(Site.el("strong", {}, "The " + s.kind + " could not be read to the end."));
      err.appendChild(document.createTextNode(" " + Site.reasonWords(s.error.code) + " "));
      err.appendChild(Site.el("span", { "class": "code" }, "(" + s.error.code + ": " + s.error.message + ")"));
    }
  }

  function failures(d) {
    const list = d.failures || [];
    $("job-failed-count").textContent = d.failed;
    const reasons = $("job-reasons");
    reasons.textContent = "";
    Object.keys(d.failure_reasons || {}).forEach(function (code) {  // most first, as the API sends them
      const li = Site.el("li");
      li.appendChild(Site.el("span", { "class": "code" }, code));
      li.appendChild(document.createTextNode(" "));
      li.appendChild(Site.el("strong", {}, String(d.failure_reasons[code])));
      li.appendChild(document.createTextNode(" "));
      li.appendChild(Site.el("span", { "class": "words" }, Site.reasonWords(code)));
      reasons.appendChild(li);
    });
    $("job-failures-none").hidden = list.length > 0;
    $("job-failures-wrap").hidden = list.length === 0;
    $("job-failures-shown").hidden = d.failed <= list.length;
    $("job-failures-n").textContent = list.length;
    const body = $("job-failures").tBodies[0];
    body.textContent = "";
    list.forEach(function (f) {
      const tr = Site.el("tr");
      tr.appendChild(Site.el("td", {}, f.row === null || f.row === undefined ? "–" : String(f.row)));
      const where = Site.el("td", { "class": "wrap" });
      where.appendChild(Site.el("a", { href: "/images/" + f.id + "/" }, f.origin || f.original_name || f.id));
      tr.appendChild(where);
      const why = Site.el("td");
      why.appendChild(Site.el("span", { "class": "code" }, f.reason));
      tr.appendChild(why);
      tr.appendChild(Site.el("td", { "class": "wrap" }, f.reason_detail || ""));
      body.appendChild(tr);
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
  function going(d) { return live[d.status] || d.reading; }
  async function refresh() {
    const r = await Site.api("GET", url);
    if (r.status === 200) { data = r.data; render(data); }
    if (going(data)) setTimeout(refresh, 1000);
  }
  if (going(data)) setTimeout(refresh, 1000);

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
