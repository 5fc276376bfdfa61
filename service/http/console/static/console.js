// Sweeper console: refreshes [data-live] sections, counts down [data-until] closures and
// draws [data-chart] figures with uPlot (vendored: static/vendor/uplot), fetching each
// chart's series again every CHART_REFRESH_MS while the page is visible.
// No framework and no inline script (the Content-Security-Policy allows only these files).
"use strict";
(function () {
  var REFRESH_MS = 2000;
  var CHART_REFRESH_MS = 10000;
  var CHART_HEIGHT = 220;

  function countdowns(root) {
    var now = Date.now();
    root.querySelectorAll("[data-until]").forEach(function (el) {
      var left = Math.round((Date.parse(el.getAttribute("data-until")) - now) / 1000);
      el.textContent = left > 0 ? "(opens in " + left + " s)" : "(open now)";
    });
  }

  // a signed-out session is redirected to sign in: that answer is no refresh either
  function fetched(url, accept) {
    return fetch(url, { credentials: "same-origin", headers: { "Accept": accept } })
      .then(function (response) {
        if (response.redirected || !response.ok) { throw new Error("status " + response.status); }
        return response;
      });
  }

  function refresh(section) {
    fetched(section.getAttribute("data-live"), "text/html")
      .then(function (response) { return response.text(); })
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

  function number(value) {
    if (value === null || value === undefined) { return "–"; }
    var abs = Math.abs(value);
    return abs >= 100 ? value.toFixed(0) : abs >= 1 ? value.toFixed(1) : value.toFixed(2);
  }

  function options(figure, spec) {
    return {
      width: Math.max(figure.clientWidth, 280), height: CHART_HEIGHT,
      scales: { x: { time: true }, y: { range: function (u, min, max) {
        return [0, max > 0 ? max * 1.1 : 1]; } } },
      axes: [{}, { label: spec.unit, size: 60, values: function (u, ticks) {
        return ticks.map(number); } }],
      series: [{}].concat(spec.series.map(function (line) {
        // points too: a backlog sampled in a few buckets of a long window is dots, not lines
        return { label: line.label, stroke: line.colour, width: 2, spanGaps: false,
                 points: { show: true, size: 4, fill: line.colour },
                 dash: line.dash ? [6, 4] : undefined,
                 value: function (u, v) { return number(v); } };
      })),
      legend: { live: true }
    };
  }

  function draw(figure) {
    fetched(figure.getAttribute("data-chart"), "application/json")
      .then(function (response) { return response.json(); })
      .then(function (spec) {
        var data = [spec.x].concat(spec.series.map(function (line) { return line.values; }));
        var empty = !spec.series.some(function (line) {
          return line.values.some(function (v) { return v !== null; });
        });
        figure.querySelector(".chart-empty").hidden = !empty;
        var labels = spec.series.map(function (line) { return line.label; }).join("|");
        if (figure.plot && figure.plotLabels === labels) {
          figure.plot.setData(data);
        } else {  // first drawing, or the series changed (a policy appeared): draw anew
          if (figure.plot) { figure.plot.destroy(); }
          figure.plot = new uPlot(options(figure, spec), data, figure.querySelector(".plot"));
          figure.plotLabels = labels;
        }
        figure.removeAttribute("data-stale");
        figure.setAttribute("data-drawn", String(spec.series.length));
        figure.setAttribute("data-bucket-s", String(spec.bucket_s));
      })
      .catch(function () { figure.setAttribute("data-stale", "true"); });
  }

  function charts() {
    var figures = Array.from(document.querySelectorAll("[data-chart]"));
    if (!figures.length || typeof uPlot === "undefined") { return; }
    figures.forEach(draw);
    setInterval(function () { if (!document.hidden) { figures.forEach(draw); } },
                CHART_REFRESH_MS);
    window.addEventListener("resize", function () {
      figures.forEach(function (figure) {
        if (figure.plot) {
          figure.plot.setSize({ width: Math.max(figure.clientWidth, 280), height: CHART_HEIGHT });
        }
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    charts();
    countdowns(document);
    setInterval(function () { countdowns(document); }, 1000);
    document.querySelectorAll("[data-live]").forEach(function (section) {
      setInterval(function () { if (!document.hidden) { refresh(section); } }, REFRESH_MS);
    });
  });
})();
