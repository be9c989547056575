// The peer table, for thousands of peers: sorted by any column (click its header), filtered by the
// box above it, one page of PAGE_SIZE rows at a time. Only the rows of the page are in the DOM.
//
// A column is one entry of PEER_COLUMNS: its header, how to sort by it (`value`) and how to fill its
// cell (`text`, or `fill` for more than text). A new column is one more entry.

import { bannedTitle, el, fmtDuration, fmtInt, fmtRate, peerName, reconcile, volunteerHref } from "./format.js";

const PAGE_SIZE = 50;

// ctx: { now (coordinator clock, s), banned (peer id -> trainer names) }
export const PEER_COLUMNS = [
  {
    key: "name",
    label: "name",
    value: (p) => peerName(p).toLowerCase(),
    fill: (td, p) => {
      let link = td.firstElementChild;
      if (!link) td.append((link = el("a")));
      link.textContent = peerName(p);
      link.href = volunteerHref(peerName(p));
    },
  },
  { key: "device", label: "device", value: (p) => p.device, text: (p) => p.device },
  { key: "stage", label: "stage", num: true, value: (p) => p.stage, text: (p) => String(p.stage) },
  { key: "throughput", label: "samples/s", num: true, value: (p) => p.throughput, text: (p) => fmtRate(p.throughput) },
  { key: "queue", label: "queue", num: true, value: (p) => p.queue, text: (p) => String(p.queue) },
  {
    key: "state",
    label: "state",
    value: (p, ctx) => (ctx.banned.has(p.peer_id) ? "banned" : p.state),
    fill: (td, p, ctx) => {
      const bannedBy = ctx.banned.get(p.peer_id);
      td.replaceChildren(el("span", `state ${p.state}`, p.state));
      if (bannedBy) {
        const tag = el("span", "tag banned-tag", "banned");
        tag.title = bannedTitle(bannedBy);
        td.append(" ", tag);
      }
    },
  },
  // direct: the coordinator dialled it back; relayed: nobody can dial it, it serves through a relay;
  // unreachable: nobody can dial it and it has no relay (trainers send it nothing).
  { key: "reach", label: "reach", value: (p) => p.reach, text: (p) => p.reach },
  {
    key: "uptime",
    label: "uptime",
    num: true,
    value: (p, ctx) => (p.started > 0 ? ctx.now - p.started : -1),
    text: (p, ctx) => (p.started > 0 ? fmtDuration(ctx.now - p.started) : "–"),
  },
  { key: "version", label: "version", value: (p) => p.version, text: (p) => p.version },
  { key: "address", label: "address", value: (p) => p.address, text: (p) => p.address },
];

const table = {
  sort: { key: "stage", descending: false },
  query: "",
  page: 0,
  last: null, // the last [peers, ctx] drawn, to redraw at once on a click or a keystroke
};

// The filter: every word must match. `stage N` (or stage:N) matches the stage; state:W, device:W and
// name:W match that column; any other word matches a peer's name, device or state (its start, for
// the state), case apart.
export function parseFilter(query) {
  const words = query.toLowerCase().trim().split(/\s+/).filter(Boolean);
  const tests = [];
  for (let i = 0; i < words.length; i++) {
    let [key, value] = words[i].includes(":") ? words[i].split(/:(.*)/s) : [null, words[i]];
    if (key === null && value === "stage" && /^\d+$/.test(words[i + 1] ?? "")) {
      [key, value] = ["stage", words[++i]];
    }
    if (key === "stage") tests.push((p) => String(p.stage) === value);
    else if (key === "state") tests.push((p, banned) => (banned.has(p.peer_id) ? "banned" : p.state).startsWith(value));
    else if (key === "device") tests.push((p) => p.device.toLowerCase().includes(value));
    else if (key === "name") tests.push((p) => peerName(p).toLowerCase().includes(value));
    else {
      const word = key === null ? value : words[i];
      tests.push(
        (p, banned) =>
          peerName(p).toLowerCase().includes(word) ||
          p.device.toLowerCase().includes(word) ||
          p.state.startsWith(word) ||
          (word === "banned" && banned.has(p.peer_id)),
      );
    }
  }
  return (p, banned) => tests.every((test) => test(p, banned));
}

export function setUpPeerTable() {
  const row = document.querySelector("#peers thead tr");
  for (const column of PEER_COLUMNS) {
    const th = el("th", column.num ? "num" : null);
    th.dataset.column = column.key;
    const button = el("button", "sort", column.label);
    button.type = "button";
    button.title = `sort by ${column.label}`;
    button.addEventListener("click", () => {
      const descending = table.sort.key === column.key ? !table.sort.descending : Boolean(column.num);
      table.sort = { key: column.key, descending };
      table.page = 0;
      redraw();
    });
    th.append(button);
    row.append(th);
  }
  document.getElementById("peer-filter").addEventListener("input", (e) => {
    table.query = e.target.value;
    table.page = 0;
    redraw();
  });
  document.getElementById("peers-prev").addEventListener("click", () => {
    table.page -= 1;
    redraw();
  });
  document.getElementById("peers-next").addEventListener("click", () => {
    table.page += 1;
    redraw();
  });
}

function redraw() {
  if (table.last) renderPeerTable(...table.last);
}

export function renderPeerTable(peers, ctx) {
  table.last = [peers, ctx];
  const keep = parseFilter(table.query);
  const column = PEER_COLUMNS.find((c) => c.key === table.sort.key);
  const sign = table.sort.descending ? -1 : 1;
  // Each value computed once; ties by stage, then name, so the order holds still between polls.
  const rows = peers
    .filter((p) => keep(p, ctx.banned))
    .map((p) => ({ p, v: column.value(p, ctx), name: peerName(p) }))
    .sort(
      (a, b) =>
        sign * (a.v < b.v ? -1 : a.v > b.v ? 1 : 0) || a.p.stage - b.p.stage || a.name.localeCompare(b.name),
    );
  const pages = Math.max(1, Math.ceil(rows.length / PAGE_SIZE));
  table.page = Math.min(Math.max(0, table.page), pages - 1);
  const first = table.page * PAGE_SIZE;
  const shown = rows.slice(first, first + PAGE_SIZE);
  reconcile(
    document.getElementById("peers").tBodies[0],
    shown,
    (r) => `${r.p.peer_id}/${r.p.stage}`,
    (r) => {
      const tr = el("tr");
      tr.dataset.peerId = r.p.peer_id;
      for (const c of PEER_COLUMNS) tr.append(el("td", c.num ? `${c.key} num` : c.key));
      return tr;
    },
    (tr, r) => {
      tr.dataset.state = r.p.state;
      tr.classList.toggle("banned", ctx.banned.has(r.p.peer_id));
      PEER_COLUMNS.forEach((c, i) => {
        if (c.fill) c.fill(tr.cells[i], r.p, ctx);
        else tr.cells[i].textContent = c.text(r.p, ctx);
      });
    },
  );
  for (const th of document.querySelectorAll("#peers thead th")) {
    const sorted = th.dataset.column === table.sort.key;
    th.setAttribute("aria-sort", sorted ? (table.sort.descending ? "descending" : "ascending") : "none");
  }
  const filtered = rows.length < peers.length ? ` (filter: ${fmtInt(rows.length)} of ${fmtInt(peers.length)})` : "";
  document.getElementById("peers-count").textContent = rows.length
    ? `${fmtInt(first + 1)}–${fmtInt(first + shown.length)} of ${fmtInt(rows.length)}${filtered}`
    : `none of ${fmtInt(peers.length)}`;
  document.getElementById("peers-prev").disabled = table.page === 0;
  document.getElementById("peers-next").disabled = table.page >= pages - 1;
  const placeholder = document.getElementById("no-peers");
  placeholder.hidden = rows.length > 0;
  placeholder.textContent = peers.length ? "no peer matches the filter" : "no peers yet";
}
