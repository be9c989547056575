// One volunteer's view, `/?peer=NAME` (a public name or a peer id): what /api/v1/peers/{peer}
// returns, drawn above the swarm: its stage and state now, samples served over all its stints and
// its share of the swarm's, uptime, the trainers' receipts, bans and spot checks, its speed over
// time and its history (joins, moves, leaves, failures, bans).

import { drawChart } from "./chart.js";
import { el, fmtClock, fmtDuration, fmtInt, fmtRate, fmtShare, isNumber, reconcile } from "./format.js";

const MAX_NAME = 256; // the API's limit (coordinator/api_peers.py)

const $ = (id) => document.getElementById(id);

// The peer the address names, or {error} saying why it names none; null without ?peer=.
export function requestedPeer(search) {
  const params = new URLSearchParams(search);
  const given = params.getAll("peer");
  if (given.length === 0) return null;
  if (given.length > 1) return { error: `the address names ${given.length} peers (?peer= more than once): name one` };
  const name = given[0];
  if (!name.trim()) return { error: "?peer= names no peer: add a public name or a peer id, e.g. ?peer=alice" };
  if (name.length > MAX_NAME) return { error: `?peer= is ${name.length} characters long: names and peer ids have at most ${MAX_NAME}` };
  return { name };
}

export function showVolunteerPanel(request) {
  $("volunteer").hidden = false;
  $("volunteer-name").textContent = request.name ?? "–";
  if (request.error) showVolunteerMessage(request.error);
}

export function showVolunteerMessage(text) {
  const message = $("volunteer-message");
  message.textContent = text;
  message.hidden = !text;
  $("volunteer-body").hidden = Boolean(text);
}

export function renderVolunteer(v, now) {
  showVolunteerMessage("");
  $("volunteer-name").textContent = v.name;
  document.title = `swarm · ${v.name}`;
  const state = v.records.find((r) => r.state === "online")?.state ?? v.records[0]?.state ?? "gone";
  const figure = (id, text) => {
    $(id).textContent = text;
  };
  figure("v-state", v.banned_by.length ? `${state}, banned` : state);
  $("v-state").dataset.state = state;
  figure("v-stage", String(v.stage));
  figure("v-samples", fmtInt(v.samples_served));
  figure("v-share", fmtShare(v.share));
  $("v-share").title = `${fmtInt(v.samples_served)} of the ${fmtInt(v.swarm_samples_served)} samples all peers served`;
  figure("v-uptime", isNumber(v.uptime_s) ? fmtDuration(v.uptime_s) : "offline");
  figure("v-seen", `${fmtDuration(now - v.first_seen)} ago`);
  figure("v-receipts", fmtInt(v.receipts));
  figure("v-bans", fmtInt(v.bans.length));
  figure("v-spot", v.banned_by.length ? `banned by ${v.banned_by.join(", ")}` : "not banned");
  const speed = v.speed.map((p) => [p.t, p.throughput]);
  drawChart($("volunteer-speed"), {
    series: [{ name: "samples/s", className: "s-speed", points: speed, markers: true }],
    xAxis: "time",
    yZero: true,
    format: fmtRate,
    empty: "no speed read yet",
  });
  const events = [...v.stage_history, ...v.bans].sort((a, b) => a.id - b.id).reverse();
  reconcile(
    $("volunteer-events").tBodies[0],
    events,
    (e) => String(e.id),
    (e) => {
      const row = el("tr");
      row.dataset.kind = e.kind;
      const kind = el("td", "kind");
      kind.append(el("span", `tag kind-${e.kind}`, e.kind));
      row.append(
        el("td", "time", fmtClock(e.t)),
        kind,
        el("td", "who", isNumber(e.stage) ? `stage ${e.stage}` : ""),
        el("td", "text", e.text),
      );
      return row;
    },
    () => {},
  );
  $("no-volunteer-events").hidden = events.length > 0;
}
