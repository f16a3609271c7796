// Upload page. Images, up to the interactive limit, each go to POST /api/images/ on their own, so
// each shows its status as it arrives (200: embedded or refused with its reason; 202: polled at
// GET /api/images/{id}/ until done). More images than the limit, or any zip, become one bulk job
// (POST /api/jobs/) and the page moves to that job's progress page.
"use strict";
(function () {
  const form = document.getElementById("upload");
  const input = document.getElementById("files");
  const list = document.getElementById("upload-list");
  const summary = document.getElementById("upload-summary");
  const limit = parseInt(form.dataset.interactiveMax, 10);
  const PARALLEL = 3;  // requests in flight at once: the interactive lane batches them together

  function isZip(f) { return /\.zip$/i.test(f.name) || f.type === "application/zip" || f.type === "application/x-zip-compressed"; }

  function item(file) {
    const li = Site.el("li", { "class": "upload-item" });
    li.appendChild(Site.el("span", { "class": "ph", "aria-hidden": "true" }));
    const body = Site.el("div");
    body.appendChild(Site.el("div", { "class": "ellipsis" }, file.name));
    const state = Site.el("div", { "class": "state" }, "waiting…");
    body.appendChild(state);
    li.appendChild(body);
    list.appendChild(li);
    return { li: li, state: state };
  }

  function show(row, image) {
    const st = image.status;
    row.li.dataset.status = st;
    if (st === "embedded" || st === "skipped") {
      row.li.classList.remove("refused");
      const a = Site.el("a", { href: "/images/" + image.id + "/" });
      const img = Site.el("img", { src: image.thumbnail_url, alt: image.original_name || "uploaded image", width: "64", height: "64" });
      a.appendChild(img);
      row.li.replaceChild(a, row.li.firstChild);
      row.state.textContent = (st === "embedded" ? "embedded" : "already here (same bytes): skipped") +
        (image.width ? " · " + image.width + " × " + image.height : "");
    } else if (st === "queued") {
      row.state.textContent = "still working… (" + (image.reason ? Site.reasonWords(image.reason) : "queued") + ")";
    } else {
      row.li.classList.add("refused");
      row.state.textContent = "";
      row.state.appendChild(Site.el("strong", { "class": "why" }, "Refused: " + Site.reasonWords(image.reason || st)));
      row.state.appendChild(document.createTextNode(" (" + (image.reason || st) + ")"));
    }
  }

  async function poll(row, url) {
    for (let i = 0; i < 600; i++) {
      await new Promise(function (r) { setTimeout(r, 1000); });
      const r = await Site.api("GET", url);
      if (r.status === 200 && r.data.status !== "queued") {
        show(row, Object.assign({}, r.data, { reason: r.data.reason }));
        return;
      }
    }
  }

  async function sendOne(file) {
    const row = item(file);
    row.state.textContent = "uploading…";
    const body = new FormData();
    body.append("files", file, file.name);
    body.append("k", "0");
    const r = await Site.api("POST", "/api/images/", body);
    if (r.data && r.data.images && r.data.images.length) {
      const image = r.data.images[0];
      show(row, image);
      if (r.status === 202 || image.status === "queued") {
        row.state.textContent = "accepted; still working…";
        await poll(row, image.url);
      }
    } else {
      row.li.classList.add("refused");
      row.state.textContent = "";
      const code = (r.data && r.data.code) || ("HTTP " + r.status);
      row.state.appendChild(Site.el("strong", { "class": "why" }, "Refused: " + Site.reasonWords(code)));
      if (r.data && r.data.message) row.state.appendChild(document.createTextNode(" " + r.data.message));
    }
  }

  async function interactive(files) {
    summary.textContent = files.length + " image(s) sent to be embedded now.";
    let next = 0;
    async function worker() {
      while (next < files.length) { const f = files[next++]; await sendOne(f); }
    }
    const workers = [];
    for (let i = 0; i < Math.min(PARALLEL, files.length); i++) workers.push(worker());
    await Promise.all(workers);
    summary.textContent = files.length + " image(s) done.";
  }

  async function bulk(files) {
    summary.textContent = "Creating a bulk job for " + files.length + " file(s)…";
    const body = new FormData();
    files.forEach(function (f) { body.append(isZip(f) ? "zip" : "files", f, f.name); });
    const name = files.length === 1 ? files[0].name : files.length + " files, " + new Date().toLocaleString();
    body.append("name", name.slice(0, 200));
    const r = await Site.api("POST", "/api/jobs/", body);
    if (r.status === 202) {
      summary.textContent = "Job created with " + r.data.total + " images; opening its page…";
      window.location.assign("/jobs/" + r.data.id + "/");
    } else {
      summary.textContent = "";
      summary.appendChild(Site.el("strong", { "class": "why" }, "The job was refused: " +
        Site.reasonWords(r.data && r.data.code) + " " + ((r.data && r.data.message) || "")));
    }
  }

  function onFiles(files) {
    list.textContent = "";
    if (files.some(isZip) || files.length > limit) bulk(files);
    else interactive(files);
    input.value = "";
  }
  Site.dropZone(form, input, onFiles);
  form.addEventListener("submit", function (e) { e.preventDefault(); });
})();
