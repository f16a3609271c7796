// Search page: an image dropped on (or chosen in) the drop zone is posted as a search by image.
"use strict";
(function () {
  const form = document.getElementById("image-search");
  if (!form) return;
  const input = document.getElementById("image-file");
  function submitWith(files) {
    if (!files.length) return;
    if (input.files !== files && window.DataTransfer) {
      const dt = new DataTransfer();
      dt.items.add(files[0]);
      input.files = dt.files;
    }
    form.submit();
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
  input.addEventListener("change", function () { if (input.files.length) form.submit(); });
})();
