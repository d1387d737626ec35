// The Fleet console's live updates (fleet/console/routes.py): no library, no inline script.
//  - An element with data-live="URL" gets URL's HTML fragment every data-every ms (3 s),
//    while the page is visible. The fragment is the server's own escaped template output.
//  - An element with data-stream="URL" gets each server-sent event's row prepended.
(function () {
  "use strict";
  function refresh(el) {
    if (document.hidden) return;
    fetch(el.dataset.live, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) {
        if (r.status === 401) { window.location.assign("/ui/login"); return null; }
        return r.ok ? r.text() : null;
      })
      .then(function (html) { if (html !== null && html !== undefined) el.innerHTML = html; })
      .catch(function () { /* the next tick tries again */ });
  }
  function stream(el) {
    var source = new EventSource(el.dataset.stream);
    source.onmessage = function (e) {
      el.insertAdjacentHTML("afterbegin", e.data);
      while (el.rows.length > 500) el.deleteRow(el.rows.length - 1);
    };
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-live]").forEach(function (el) {
      var every = parseInt(el.dataset.every || "3000", 10);
      setInterval(function () { refresh(el); }, every);
    });
    document.querySelectorAll("[data-stream]").forEach(stream);
  });
})();
