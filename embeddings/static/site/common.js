// Shared by the site's pages: the API through the session (Django's CSRF token in X-CSRFToken),
// and reason codes in words (rendered into the page by the server from embeddings/site/words.py).
"use strict";
window.Site = (function () {
  function csrfToken() {
    const input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }
  const wordsNode = document.getElementById("reason-words");
  const words = wordsNode ? JSON.parse(wordsNode.textContent) : {};
  function reasonWords(code) {
    if (!code) return "";
    return words[code] || (code.charAt(0).toUpperCase() + code.slice(1).replace(/_/g, " ") + ".");
  }
  async function api(method, url, body) {
    const opts = { method: method, headers: { "X-CSRFToken": csrfToken(), "Accept": "application/json" },
                   credentials: "same-origin" };
    if (body !== undefined) opts.body = body;
    const r = await fetch(url, opts);
    let data = null;
    try { data = await r.json(); } catch (e) { data = null; }
    return { status: r.status, data: data, headers: r.headers };
  }
  function el(tag, attrs, text) {
    const n = document.createElement(tag);
    for (const k in (attrs || {})) n.setAttribute(k, attrs[k]);
    if (text !== undefined) n.textContent = text;
    return n;
  }
  function dropZone(zone, input, onFiles) {
    // Drag and drop onto a zone whose <input type=file> also takes clicks and the keyboard.
    ["dragenter", "dragover"].forEach(function (t) {
      zone.addEventListener(t, function (e) { e.preventDefault(); zone.classList.add("over"); });
    });
    ["dragleave", "drop"].forEach(function (t) {
      zone.addEventListener(t, function () { zone.classList.remove("over"); });
    });
    zone.addEventListener("drop", function (e) {
      e.preventDefault();
      if (e.dataTransfer && e.dataTransfer.files.length) onFiles(Array.from(e.dataTransfer.files));
    });
    input.addEventListener("change", function () {
      if (input.files.length) onFiles(Array.from(input.files));
    });
  }
  return { api: api, el: el, reasonWords: reasonWords, dropZone: dropZone, csrfToken: csrfToken };
})();
