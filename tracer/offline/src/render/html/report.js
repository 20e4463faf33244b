"use strict";
// Sorting: a click on a column header orders the rows by that column
// (numbers by their data-v, largest first; text A to Z); a second click
// reverses the order.
for (const table of document.querySelectorAll("table.sortable")) {
  const heads = table.tHead.rows[0].cells;
  for (let col = 0; col < heads.length; col++) {
    heads[col].addEventListener("click", () => {
      const th = heads[col];
      const numeric = th.classList.contains("num");
      const first = numeric ? "descending" : "ascending";
      const other = numeric ? "ascending" : "descending";
      const order = th.getAttribute("aria-sort") === first ? other : first;
      for (const h of heads) h.removeAttribute("aria-sort");
      th.setAttribute("aria-sort", order);
      const key = (row) => {
        const cell = row.cells[col];
        const v = cell.dataset.v !== undefined ? cell.dataset.v : cell.textContent;
        return numeric ? Number(v) : v;
      };
      const sign = order === "ascending" ? 1 : -1;
      const body = table.tBodies[0];
      const rows = Array.from(body.rows);
      rows.sort((a, b) => {
        const x = key(a), y = key(b);
        return sign * (x < y ? -1 : x > y ? 1 : 0);
      });
      body.append(...rows);
    });
  }
}
// The flame graph's weight: show the graph of the chosen one, loading it
// the first time.
const weights = document.querySelector("form.weights");
function showWeight(value) {
  for (const g of document.querySelectorAll(".flame[data-weight]")) {
    g.hidden = g.dataset.weight !== value;
    if (!g.hidden && g.dataset.src && !g.getAttribute("src")) g.src = g.dataset.src;
  }
}
if (weights) weights.addEventListener("change", (e) => showWeight(e.target.value));
// A link may choose both: report.html#weight=leaked&sort=bytes (a column
// of the table of stacks, by its header).
const wanted = new URLSearchParams(location.hash.slice(1));
const radio = weights && weights.querySelector(`input[value="${CSS.escape(wanted.get("weight") || "")}"]`);
if (radio) {
  radio.checked = true;
  showWeight(radio.value);
}
for (const th of document.querySelectorAll("table.stacks th")) {
  if (th.textContent === wanted.get("sort")) th.click();
}
