// qag Console: the live tail of runs (polls /console/runs/tail with the session cookie; no inline script).
(function () {
  "use strict";
  var tail = document.querySelector("#tail tbody");
  if (!tail) { return; }
  function cell(row, text) { var td = document.createElement("td"); td.textContent = text == null ? "" : String(text); row.appendChild(td); }
  function refresh() {
    fetch("/console/runs/tail", {credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (r) { return r.json(); })
      .then(function (body) {
        var items = body.items || [];
        while (tail.firstChild) { tail.removeChild(tail.firstChild); }
        items.forEach(function (r) {
          var tr = document.createElement("tr");
          tr.dataset.status = r.status;
          if (r.error) { tr.title = r.error; }  // the database's words (administrators only), as text
          [r.at, r.query, r.key_name || "(admin)", r.status, r.code, r.rows, r.duration_ms, r.request_id, r.served_by]
            .forEach(function (v) { cell(tr, v); });
          tail.appendChild(tr);
        });
      })
      .catch(function () { /* the next tick retries */ });
  }
  refresh();
  setInterval(refresh, 2000);
}());
