// Search page: an image dropped on (or chosen in) the drop zone is posted as a search by image,
// with the job and metadata filter (m-<field> inputs) as they stand in the text form at that moment
// (without this script, the form carries those of the last search: hidden inputs from the server).
"use strict";
(function () {
  const form = document.getElementById("image-search");
  if (!form) return;
  const input = document.getElementById("image-file");
  const textForm = document.getElementById("text-search");
  function carryFilters() {
    if (!textForm) return;
    form.querySelectorAll("input[type=hidden]").forEach(function (h) {
      if (h.name === "job" || h.name.indexOf("m-") === 0) h.remove();
    });
    Array.from(textForm.elements).forEach(function (el) {
      if (!el.name || !(el.name === "job" || el.name.indexOf("m-") === 0)) return;
      if (el.name === "job" || el.value.trim()) {
        form.appendChild(Object.assign(document.createElement("input"), { type: "hidden", name: el.name, value: el.value }));
      }
    });
  }
  function send() { carryFilters(); form.submit(); }
  function submitWith(files) {
    if (!files.length) return;
    if (input.files !== files && window.DataTransfer) {
      const dt = new DataTransfer();
      dt.items.add(files[0]);
      input.files = dt.files;
    }
    send();
  }
  ["dragenter", "dragover"].forEach(function (t) {
    form.addEventListener(t, function (e) { e.preventDefault(); form.classList.add("over"); });
  });
  ["dragleave", "drop"].forEach(function (t) {
    form.addEventListener(t, function () { form.classList.remove("over"); });
  });
  form.addEventListener("drop", function (e) {
    e.preventDefault();
    if (e.dataTransfer && e.dataTransfer.files.length) submitWith(Array.from(e.dataTransfer.files));
  });
  input.addEventListener("change", function () { if (input.files.length) send(); });
})();
