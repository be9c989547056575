// The live dashboard: polls the coordinator's API every second and redraws the header, the
// pipeline's stage summaries (stages.js), the charts, the peer table (peers.js), the invites, the
// event log and, at `?peer=NAME`, that volunteer's view (volunteer.js) from what it returns.
//
// Only new history points (?since=) and new events (?after=) are fetched after the first poll.
// Every string that comes from the API (peer names are user input) reaches the page through
// textContent or an attribute, never as markup (format.js). Each redraw from a new state is timed
// as the performance measure "dashboard-update", and counted in <body data-updates>.

import { drawChart } from "./chart.js";
import { el, fmtClock, fmtDuration, fmtInt, fmtLoss, fmtRate, isNumber, reconcile, spotBanned } from "./format.js";
import { renderPeerTable, setUpPeerTable } from "./peers.js";
import { renderPipeline } from "./stages.js";
import { renderVolunteer, requestedPeer, showVolunteerMessage, showVolunteerPanel } from "./volunteer.js";

const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 5000;
const MAX_EVENTS = 500; // rows kept in the event log
const MAX_POINTS = 20000; // history points kept in memory
const EVENT_PAGE = 1000; // the API's largest page
const EVENT_PAGES_PER_POLL = 20;
const STALE_VIEW_S = 15; // the coordinator's view of the DHT is old: say so
const MISSING_RETRY_MS = 10000; // an endpoint this coordinator lacks (404) is asked again this rarely
const UNKNOWN_PEER_RETRY_MS = 5000; // a volunteer the coordinator does not know (yet) is asked again this rarely
const MEASURES_KEPT = 3600; // "dashboard-update" measures kept before the oldest are dropped

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
  lastState: null,
  updates: 0, // redraws from a new state
  volunteer: requestedPeer(window.location.search), // null, {name} or {error}
  volunteerRetryAt: 0,
};

// ---- fetching -------------------------------------------------------------------------------

class HttpError extends Error {
  constructor(path, status, detail) {
    super(`${path}: HTTP ${status}${detail ? `: ${detail}` : ""}`);
    this.status = status;
    this.detail = detail;
  }
}

class NotFound extends HttpError {}

// The API's error message (FastAPI's {"detail": ...}), if the body has one.
async function detailOf(response) {
  try {
    const detail = (await response.json()).detail;
    return typeof detail === "string" ? detail : Array.isArray(detail) ? detail.map((d) => d.msg).join("; ") : null;
  } catch {
    return null;
  }
}

async function getJSON(path, params = {}) {
  const url = new URL(path, document.baseURI);
  for (const [key, value] of Object.entries(params)) {
    if (value !== null && value !== undefined) url.searchParams.set(key, String(value));
  }
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
  try {
    const response = await fetch(url, { cache: "no-store", signal: controller.signal });
    if (response.status === 404) throw new NotFound(url.pathname, 404, await detailOf(response));
    if (!response.ok) throw new HttpError(url.pathname, response.status, await detailOf(response));
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
    dash.lastState = state;
    const started = performance.now();
    render(state);
    performance.measure("dashboard-update", { start: started });
    dash.updates += 1;
    document.body.dataset.updates = String(dash.updates);
    if (dash.updates % MEASURES_KEPT === 0) performance.clearMeasures("dashboard-update");
    dash.reachable = true;
    dash.lastUpdate = Date.now();
  } catch (err) {
    dash.reachable = false;
    console.warn("dashboard: /api/v1/state:", err);
  }
  renderFreshness();
}

function render(state) {
  const banned = spotBanned(state);
  renderHeader(state);
  renderPipeline($("pipeline"), state, banned);
  renderPeerTable(
    state.stages.flatMap((s) => s.peers),
    { now: coordinatorNow(), banned },
  );
}

async function pollVolunteer() {
  const request = dash.volunteer;
  if (!request || request.error || Date.now() < dash.volunteerRetryAt) return;
  try {
    renderVolunteer(await getJSON(`api/v1/peers/${encodeURIComponent(request.name)}`), coordinatorNow());
  } catch (err) {
    if (err instanceof HttpError) {
      dash.volunteerRetryAt = Date.now() + UNKNOWN_PEER_RETRY_MS;
      showVolunteerMessage(err.detail ?? err.message);
    }
  }
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
    const ahead = c.ahead ? `; ${c.ahead} of epoch ${c.epoch + 1} begun` : "";
    $("data-shards").textContent = `epoch ${c.epoch}: ${c.done} done, ${c.leased} leased, ${c.free} free${ahead}`;
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
  await Promise.allSettled([pollState(), pollHistory(), pollEvents(), pollInvites(), pollData(), pollVolunteer()]);
  setTimeout(tick, Math.max(0, POLL_MS - (Date.now() - started)));
}

// ---- formatting -----------------------------------------------------------------------------

const coordinatorNow = () => Date.now() / 1000 + dash.clockOffset;

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
  const online = state.peers_online ?? state.stages.reduce((sum, s) => sum + s.online, 0);
  $("peers-online").textContent = fmtInt(online);
  $("bottleneck-throughput").textContent = fmtRate(state.bottleneck_throughput);
  $("policy-throughput").textContent = fmtRate(state.policy_throughput);
  const balanced = state.balanced_throughput;
  const gain = state.bottleneck_throughput > 0 ? balanced / state.bottleneck_throughput - 1 : null;
  $("balanced-throughput").textContent =
    isNumber(gain) && gain >= 0.0005 ? `${fmtRate(balanced)} (+${(100 * gain).toFixed(1)} %)` : fmtRate(balanced);
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
$("pipeline").addEventListener("expand", () => {
  if (dash.lastState) render(dash.lastState);
});
setUpPeerTable();
if (dash.volunteer) showVolunteerPanel(dash.volunteer);
$("show-steps").addEventListener("change", (e) => $("events").classList.toggle("hide-steps", !e.target.checked));
setInterval(renderFreshness, 500);
drawCharts();
tick();
