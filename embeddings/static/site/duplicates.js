// Duplicates page, while a scan runs (duplicates.html loads this only then): re-reads the page
// every few seconds and swaps in its scan box, so the state and points scanned move; once the scan
// is no longer running the page reloads to show its groups. The groups and forms are left alone.
"use strict";
(function () {
  const box = document.getElementById("scan");
  const state = document.getElementById("scan-state");
  if (!box || !state || !box.dataset.running) return;
  const EVERY_MS = 3000;
  async function tick() {
    try {
      const r = await fetch(location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } });
      if (r.ok) {
        const fresh = new DOMParser().parseFromString(await r.text(), "text/html");
        const next = fresh.getElementById("scan");
        if (!next || !next.dataset.running) { location.reload(); return; }
        state.replaceChildren(...fresh.getElementById("scan-state").childNodes);
      }
    } catch (e) { /* offline for a moment: try again on the next tick */ }
    setTimeout(tick, EVERY_MS);
  }
  setTimeout(tick, EVERY_MS);
})();
