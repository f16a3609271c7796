// Search page: an image dropped on (or chosen in) the drop zone is posted as a search by image, and
// the examples form ("search again with the selected") is posted as a search by examples, each with
// the job, metadata filter (m-<field> inputs) and "diverse results" toggle as they stand in the text
// form at that moment (without this script, the forms carry those of the last search: hidden inputs
// from the server). A result is ticked (a positive example) or crossed (a negative one), never both.
"use strict";
(function () {
  const textForm = document.getElementById("text-search");
  function carried(name) { return name === "job" || name === "diversity" || name.indexOf("m-") === 0; }
  function carryFilters(form) {
    if (!textForm) return;
    form.querySelectorAll("input[type=hidden]").forEach(function (h) { if (carried(h.name)) h.remove(); });
    Array.from(textForm.elements).forEach(function (el) {
      if (!el.name || !carried(el.name)) return;
      if (el.type === "checkbox" && !el.checked) return;
      if (el.name === "job" || el.value.trim()) {
        form.appendChild(Object.assign(document.createElement("input"), { type: "hidden", name: el.name, value: el.value }));
      }
    });
  }

  const form = document.getElementById("image-search");
  if (form) {
    const input = document.getElementById("image-file");
    const send = function () { carryFilters(form); form.submit(); };
    const submitWith = function (files) {
      if (!files.length) return;
      if (input.files[0] !== files[0] && window.DataTransfer) {
        const dt = new DataTransfer();
        dt.items.add(files[0]);
        input.files = dt.files;
      }
      send();
    };
    Site.dropZone(form, input, submitWith);  // common.js: drag and drop, and the chooser
  }

  const examples = document.getElementById("examples-search");
  if (!examples) return;
  const picked = document.getElementById("picked");
  const boxes = function (name) { return Array.from(document.querySelectorAll("input[form=examples-search][name=" + name + "]")); };
  function count() {
    const pos = boxes("positive").filter(function (b) { return b.checked; }).length;
    const neg = boxes("negative").filter(function (b) { return b.checked; }).length;
    if (picked) picked.textContent = pos || neg ? pos + " ✓ and " + neg + " ✗ selected" : "";
  }
  document.addEventListener("change", function (e) {
    const box = e.target;
    if (box.getAttribute("form") !== "examples-search" || box.type !== "checkbox") return;
    if (box.checked) {  // a tick clears the same result's cross, and a cross its tick
      boxes(box.name === "positive" ? "negative" : "positive").forEach(function (o) {
        if (o.value === box.value) o.checked = false;
      });
    }
    count();
  });
  examples.addEventListener("submit", function () { carryFilters(examples); });
  count();  // a page restored from the back-forward cache keeps its boxes
})();
