// Sweeper console: refreshes [data-live] sections and counts down [data-until] closures.
// No framework and no inline script (the Content-Security-Policy allows only this file).
"use strict";
(function () {
  var REFRESH_MS = 2000;

  function countdowns(root) {
    var now = Date.now();
    root.querySelectorAll("[data-until]").forEach(function (el) {
      var left = Math.round((Date.parse(el.getAttribute("data-until")) - now) / 1000);
      el.textContent = left > 0 ? "(opens in " + left + " s)" : "(open now)";
    });
  }

  function refresh(section) {
    var url = section.getAttribute("data-live");
    fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) {
        if (response.redirected || !response.ok) { throw new Error("status " + response.status); }
        return response.text();
      })
      .then(function (html) {
        // the server escapes everything it renders; parse into an inert document first
        var parsed = new DOMParser().parseFromString(html, "text/html");
        var fresh = parsed.querySelector("main") || parsed.body;
        section.replaceChildren.apply(section, Array.from(fresh.childNodes));
        countdowns(section);
        section.removeAttribute("data-stale");
      })
      .catch(function () { section.setAttribute("data-stale", "true"); });
  }

  document.addEventListener("DOMContentLoaded", function () {
    countdowns(document);
    setInterval(function () { countdowns(document); }, 1000);
    document.querySelectorAll("[data-live]").forEach(function (section) {
      setInterval(function () { if (!document.hidden) { refresh(section); } }, REFRESH_MS);
    });
  });
})();
