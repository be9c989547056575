// The live dashboard: polls the coordinator's API every second and redraws the header, the
// pipeline, the charts, the peer table, the invites and the event log from what it returns.
//
// Only new history points (?since=) and new events (?after=) are fetched after the first poll.
// Every string that comes from the API (peer names are user input) reaches the page through
// textContent or an attribute, never as markup.

import { drawChart } from "./chart.js";

const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 5000;
const MAX_EVENTS = 500; // rows kept in the event log
const MAX_POINTS = 20000; // history points kept in memory
const EVENT_PAGE = 1000; // the API's largest page
const EVENT_PAGES_PER_POLL = 20;
const STALE_VIEW_S = 15; // the coordinator's view of the DHT is old: say so
const MISSING_RETRY_MS = 10000; // an endpoint this coordinator lacks (404) is asked again this rarely

const $ = (id) => document.getElementById(id);

const dash = {
  runId: null,
  points: [], // history points, oldest first
  lastPointT: null,
  historyMissing: false,
  historyRetryAt: 0,
  lastEventId: null,
  eventsMissing: false,
  eventsRetryAt: 0,
  invitesRetryAt: 0,
  dataRetryAt: 0,
  lastUpdate: null, // Date.now() of the last /api/v1/state that answered
  reachable: null,
  viewAge: 0,
  clockOffset: 0, // coordinator clock minus this browser's clock, seconds
};

// ---- fetching -------------------------------------------------------------------------------

class NotFound extends Error {}

async function getJSON(path, params = {}) {
  const url = new URL(path, document.baseURI);
  for (const [key, value] of Object.entries(params)) {
    if (value !== null && value !== undefined) url.searchParams.set(key, String(value));
  }
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
  try {
    const response = await fetch(url, { cache: "no-store", signal: controller.signal });
    if (response.status === 404) throw new NotFound(url.pathname);
    if (!response.ok) throw new Error(`${url.pathname}: HTTP ${response.status}`);
    return await response.json();
  } finally {
    clearTimeout(timer);
  }
}

async function pollState() {
  try {
    const state = await getJSON("api/v1/state");
    if (dash.runId !== null && state.run_id !== dash.runId) resetRun();
    dash.runId = state.run_id;
    dash.clockOffset = state.read_at + state.age_s - Date.now() / 1000;
    dash.viewAge = state.age_s;
    renderHeader(state);
    renderPipeline(state);
    renderPeerTable(state);
    dash.reachable = true;
    dash.lastUpdate = Date.now();
  } catch (err) {
    dash.reachable = false;
    console.warn("dashboard: /api/v1/state:", err);
  }
  renderFreshness();
}

async function pollHistory() {
  if (Date.now() < dash.historyRetryAt) return;
  let body;
  try {
    body = await getJSON("api/v1/history", { since: dash.lastPointT });
  } catch (err) {
    if (err instanceof NotFound) {
      dash.historyRetryAt = Date.now() + MISSING_RETRY_MS;
      if (!dash.historyMissing) {
        dash.historyMissing = true;
        drawCharts();
      }
    }
    return;
  }
  const wasMissing = dash.historyMissing;
  dash.historyMissing = false;
  const fresh = (body.points ?? []).filter((p) => dash.lastPointT === null || p.t > dash.lastPointT);
  if (fresh.length) {
    dash.points.push(...fresh);
    if (dash.points.length > MAX_POINTS) dash.points.splice(0, dash.points.length - MAX_POINTS);
    dash.lastPointT = dash.points[dash.points.length - 1].t;
  }
  if (fresh.length || wasMissing) drawCharts();
}

async function pollEvents() {
  if (Date.now() < dash.eventsRetryAt) return;
  for (let page = 0; page < EVENT_PAGES_PER_POLL; page++) {
    let body;
    try {
      body = await getJSON("api/v1/events", { after: dash.lastEventId, limit: EVENT_PAGE });
    } catch (err) {
      if (err instanceof NotFound) {
        dash.eventsMissing = true;
        dash.eventsRetryAt = Date.now() + MISSING_RETRY_MS;
      }
      renderEventPlaceholder();
      return;
    }
    dash.eventsMissing = false;
    const events = body.events ?? [];
    const fresh = events.filter((e) => dash.lastEventId === null || e.id > dash.lastEventId);
    addEvents(fresh.slice(-MAX_EVENTS));
    if (fresh.length) dash.lastEventId = fresh[fresh.length - 1].id;
    if (events.length < EVENT_PAGE) break;
  }
  renderEventPlaceholder();
}

async function pollInvites() {
  if (Date.now() < dash.invitesRetryAt) return;
  try {
    renderInvites(await getJSON("api/v1/invites"));
  } catch (err) {
    if (err instanceof NotFound) dash.invitesRetryAt = Date.now() + MISSING_RETRY_MS;
  }
}

async function pollData() {
  if (Date.now() < dash.dataRetryAt) return;
  try {
    const c = (await getJSON("api/v1/data")).count;
    $("data-shards").textContent = `epoch ${c.epoch}: ${c.done} done, ${c.leased} leased, ${c.free} free`;
  } catch (err) {
    // A coordinator that cannot list the run's data leases no shards: every trainer reads them all.
    if (err instanceof NotFound) dash.dataRetryAt = Date.now() + MISSING_RETRY_MS;
  }
}

function resetRun() {
  dash.points = [];
  dash.lastPointT = null;
  dash.lastEventId = null;
  $("events").tBodies[0].replaceChildren();
  $("pipeline").replaceChildren();
  drawCharts();
}

async function tick() {
  const started = Date.now();
  await Promise.allSettled([pollState(), pollHistory(), pollEvents(), pollInvites(), pollData()]);
  setTimeout(tick, Math.max(0, POLL_MS - (Date.now() - started)));
}

// ---- formatting -----------------------------------------------------------------------------

function el(tag, className = null, text = null) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== null) node.textContent = text;
  return node;
}

const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
const fmtLoss = (v) => (isNumber(v) ? v.toFixed(3) : "–");
const fmtRate = (v) => (isNumber(v) ? (v >= 100 ? Math.round(v).toLocaleString("en") : v.toFixed(1)) : "–");
const fmtInt = (v) => (isNumber(v) ? Math.round(v).toLocaleString("en") : "–");
const peerName = (p) => p.public_name || p.peer_id.slice(-8);

function fmtDuration(seconds) {
  if (!isNumber(seconds) || seconds < 0) return "–";
  const s = Math.floor(seconds);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

function fmtClock(t) {
  return new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

const coordinatorNow = () => Date.now() / 1000 + dash.clockOffset;

// Make `container`'s children match `items` in order, reusing the element of each key.
function reconcile(container, items, keyOf, create, update) {
  const existing = new Map();
  for (const child of container.children) existing.set(child.dataset.key, child);
  let previous = null;
  for (const item of items) {
    const key = keyOf(item);
    let node = existing.get(key);
    if (node) {
      existing.delete(key);
    } else {
      node = create(item);
      node.dataset.key = key;
    }
    update(node, item);
    const expected = previous ? previous.nextSibling : container.firstChild;
    if (node !== expected) container.insertBefore(node, expected);
    previous = node;
  }
  for (const stale of existing.values()) stale.remove();
}

// ---- rendering ------------------------------------------------------------------------------

function renderHeader(state) {
  $("run-id").textContent = state.run_id;
  document.title = `swarm · ${state.run_id}`;
  const step = state.global_step ?? Math.max(0, ...state.trainers.map((t) => t.steps));
  $("global-step").textContent = fmtInt(step);
  $("loss").textContent = fmtLoss(state.loss);
  $("val-loss").textContent = fmtLoss(state.val_loss);
  const tokens = state.tokens_per_s ?? state.trainers.reduce((sum, t) => sum + t.tokens_per_s, 0);
  $("tokens-per-s").textContent = fmtRate(tokens);
  const spot = (field) => fmtInt(state.trainers.reduce((sum, t) => sum + (t[field] ?? 0), 0));
  $("spot-checks").textContent = `${spot("spot_checks")} / ${spot("spot_disagreements")} / ${spot("spot_bans")}`;
  $("paused").hidden = !state.paused;
}

// Peer id -> names of the trainers whose spot checks banned it (swarm/verify.py).
function spotBanned(state) {
  const banned = new Map();
  for (const t of state.trainers) {
    for (const peerId of Object.keys(t.spot_banned ?? {})) {
      banned.set(peerId, [...(banned.get(peerId) ?? []), t.public_name || t.trainer_id.slice(0, 8)]);
    }
  }
  return banned;
}

function bannedTitle(trainers) {
  return `banned by the spot checks of trainer ${trainers.join(", ")}: its outputs disagreed with two agreeing peers`;
}

function renderFreshness() {
  const node = $("freshness");
  const ago = dash.lastUpdate === null ? null : Math.floor((Date.now() - dash.lastUpdate) / 1000);
  if (dash.reachable === false) {
    node.textContent = ago === null ? "coordinator unreachable" : `coordinator unreachable · last update ${ago}s ago`;
    node.className = "freshness bad";
  } else if (dash.reachable === null) {
    node.textContent = "connecting…";
    node.className = "freshness";
  } else {
    const stale = dash.viewAge > STALE_VIEW_S ? ` · swarm view ${Math.round(dash.viewAge)}s old` : "";
    node.textContent = `updated ${ago}s ago${stale}`;
    node.className = stale ? "freshness warn" : "freshness ok";
  }
}

function renderPipeline(state) {
  const allPeers = state.stages.flatMap((s) => s.peers);
  const fastest = Math.max(0, ...allPeers.map((p) => p.throughput));
  const banned = spotBanned(state);
  const columns = [{ kind: "trainers", trainers: state.trainers }, ...state.stages.map((s) => ({ kind: "stage", s }))];
  reconcile(
    $("pipeline"),
    columns,
    (c) => (c.kind === "trainers" ? "trainers" : `stage-${c.s.index}`),
    (c) => (c.kind === "trainers" ? createTrainerColumn() : createStageColumn(c.s)),
    (node, c) =>
      c.kind === "trainers" ? updateTrainerColumn(node, c.trainers) : updateStageColumn(node, c.s, fastest, banned),
  );
}

function createTrainerColumn() {
  const section = el("section", "trainers");
  const header = el("header");
  header.append(el("h3", null, "Trainers"), el("span", "meta"));
  section.append(header, el("div", "boxes"));
  return section;
}

function updateTrainerColumn(section, trainers) {
  section.querySelector("header .meta").textContent = `${trainers.length} feeding data`;
  const sorted = [...trainers].sort((a, b) => a.public_name.localeCompare(b.public_name));
  reconcile(
    section.querySelector(".boxes"),
    sorted,
    (t) => t.trainer_id,
    (t) => {
      const box = el("div", "trainer");
      box.dataset.trainerId = t.trainer_id;
      box.append(el("div", "name"), el("div", "meta"));
      return box;
    },
    (box, t) => {
      box.querySelector(".name").textContent = t.public_name || t.trainer_id.slice(0, 8);
      box.querySelector(".meta").textContent =
        `step ${fmtInt(t.steps)} · loss ${fmtLoss(t.loss)} · ${fmtRate(t.tokens_per_s)} tok/s`;
    },
  );
}

function createStageColumn(stage) {
  const section = el("section", "stage");
  section.dataset.stage = String(stage.index);
  const header = el("header");
  const title = el("h3", null, `Stage ${stage.index}`);
  header.append(title, el("span", "layers"), el("span", "tag bottleneck-tag", "bottleneck"), el("span", "total"));
  section.append(header, el("div", "boxes"));
  return section;
}

function updateStageColumn(section, stage, fastest, banned) {
  section.classList.toggle("bottleneck", Boolean(stage.bottleneck));
  const [start, stop] = stage.layers;
  section.querySelector(".layers").textContent = stop - start === 1 ? `layer ${start}` : `layers ${start}–${stop - 1}`;
  section.querySelector(".total").textContent = `${fmtRate(stage.throughput)} samples/s · ${stage.online} online`;
  const peers = [...stage.peers].sort((a, b) => peerName(a).localeCompare(peerName(b)));
  reconcile(section.querySelector(".boxes"), peers, (p) => p.peer_id, createPeerBox, (box, p) =>
    updatePeerBox(box, p, fastest, banned.get(p.peer_id)),
  );
}

function createPeerBox(peer) {
  const box = el("div", "peer");
  box.dataset.peerId = peer.peer_id;
  const bar = el("div", "bar");
  bar.append(el("div", "fill"));
  box.append(el("div", "name"), el("div", "meta"), bar, el("div", "speed"));
  return box;
}

function updatePeerBox(box, peer, fastest, bannedBy) {
  box.dataset.state = peer.state;
  box.classList.toggle("banned", Boolean(bannedBy));
  const why = bannedBy ? `; ${bannedTitle(bannedBy)}` : "";
  box.title = `${peerName(peer)} (${peer.peer_id}) at ${peer.address}${why}`;
  box.querySelector(".name").textContent = peerName(peer);
  const moving = isNumber(peer.moving_to) ? ` · moving to stage ${peer.moving_to}` : "";
  const ban = bannedBy ? " · banned" : "";
  box.querySelector(".meta").textContent = `${peer.device || "?"} · ${peer.state}${ban} · queue ${peer.queue}${moving}`;
  const share = fastest > 0 ? peer.throughput / fastest : 0;
  box.querySelector(".fill").style.width = `${(100 * share).toFixed(1)}%`;
  box.querySelector(".speed").textContent = `${fmtRate(peer.throughput)} samples/s`;
}

const PEER_COLUMNS = ["name", "device", "stage num", "throughput num", "queue num", "state", "uptime num", "version", "address"];

function renderPeerTable(state) {
  const peers = state.stages
    .flatMap((s) => s.peers)
    .sort((a, b) => a.stage - b.stage || peerName(a).localeCompare(peerName(b)));
  const now = coordinatorNow();
  const banned = spotBanned(state);
  reconcile(
    $("peers").tBodies[0],
    peers,
    (p) => `${p.peer_id}/${p.stage}`,
    (p) => {
      const row = el("tr");
      row.dataset.peerId = p.peer_id;
      for (const column of PEER_COLUMNS) row.append(el("td", column));
      return row;
    },
    (row, p) => {
      row.dataset.state = p.state;
      const cells = row.cells;
      cells[0].textContent = peerName(p);
      cells[1].textContent = p.device;
      cells[2].textContent = String(p.stage);
      cells[3].textContent = fmtRate(p.throughput);
      cells[4].textContent = String(p.queue);
      const bannedBy = banned.get(p.peer_id);
      row.classList.toggle("banned", Boolean(bannedBy));
      cells[5].replaceChildren(el("span", `state ${p.state}`, p.state));
      if (bannedBy) {
        const tag = el("span", "tag banned-tag", "banned");
        tag.title = bannedTitle(bannedBy);
        cells[5].append(" ", tag);
      }
      cells[6].textContent = p.started > 0 ? fmtDuration(now - p.started) : "–";
      cells[7].textContent = p.version;
      cells[8].textContent = p.address;
    },
  );
  $("no-peers").hidden = peers.length > 0;
}

// Names, identity counts, expiry and revocation: the listing carries no token, and shows none.
function renderInvites(body) {
  const invites = body.invites ?? [];
  const now = coordinatorNow();
  reconcile(
    $("invites").tBodies[0],
    invites,
    (i) => i.name,
    () => {
      const row = el("tr");
      for (const column of ["name", "identities num", "expires", "state"]) row.append(el("td", column));
      return row;
    },
    (row, i) => {
      const expired = isNumber(i.expires) && i.expires <= now;
      const state = i.revoked ? "revoked" : expired ? "expired" : "active";
      row.dataset.state = state;
      const cells = row.cells;
      cells[0].textContent = i.name;
      cells[1].textContent = isNumber(i.max_peers) ? `${i.identities} / ${i.max_peers}` : String(i.identities);
      cells[2].textContent = !isNumber(i.expires) ? "never" : expired ? fmtClock(i.expires) : `in ${fmtDuration(i.expires - now)}`;
      cells[3].replaceChildren(el("span", `state ${state}`, state));
    },
  );
  const placeholder = $("no-invites");
  placeholder.hidden = invites.length > 0;
  placeholder.textContent = body.guarded ? "no invites yet" : "open run: anyone may join, no token needed";
}

function addEvents(events) {
  const body = $("events").tBodies[0];
  for (const event of events) {
    const row = el("tr");
    row.dataset.eventId = String(event.id);
    row.dataset.kind = event.kind;
    const kind = el("td", "kind");
    kind.append(el("span", `tag kind-${event.kind}`, event.kind));
    const where = [event.peer, isNumber(event.stage) ? `stage ${event.stage}` : null].filter(Boolean).join(" · ");
    row.append(el("td", "time", fmtClock(event.t)), kind, el("td", "who", where), el("td", "text", event.text));
    body.prepend(row);
  }
  while (body.rows.length > MAX_EVENTS) body.lastElementChild.remove();
}

function renderEventPlaceholder() {
  const placeholder = $("no-events");
  placeholder.hidden = $("events").tBodies[0].rows.length > 0;
  placeholder.textContent = dash.eventsMissing ? "no events yet (this coordinator keeps no event log)" : "no events yet";
}

// The last point of each step: the loss of a step does not change once it is reported.
function perStep(points, field) {
  const out = [];
  for (const p of points) {
    if (!isNumber(p[field])) continue;
    if (out.length && out[out.length - 1][0] === p.step) out[out.length - 1] = [p.step, p[field]];
    else out.push([p.step, p[field]]);
  }
  return out;
}

function drawCharts() {
  const empty = dash.historyMissing || dash.points.length === 0 ? "no history yet" : "no loss reported yet";
  drawChart($("loss-chart"), {
    series: [
      { name: "loss", className: "s-loss", points: perStep(dash.points, "loss") },
      { name: "val loss", className: "s-val", points: perStep(dash.points, "val_loss"), markers: true },
    ],
    xAxis: "number",
    xLabel: "step",
    format: (v) => v.toFixed(3),
    empty,
  });
  drawChart($("speed-chart"), {
    series: [
      {
        name: "tokens/s",
        className: "s-speed",
        points: dash.points.filter((p) => isNumber(p.tokens_per_s)).map((p) => [p.t, p.tokens_per_s]),
      },
    ],
    xAxis: "time",
    yZero: true,
    format: fmtRate,
    empty: "no history yet",
  });
}

// ---- start ----------------------------------------------------------------------------------

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(drawCharts, 150);
});
$("show-steps").addEventListener("change", (e) => $("events").classList.toggle("hide-steps", !e.target.checked));
setInterval(renderFreshness, 500);
drawCharts();
tick();
