// The pipeline panel: the trainers, then one summary per stage, data flowing left to right.
//
// A stage shows its peers counted by state, its total and median samples/s, its queue pressure, a
// histogram of its peers' speeds (one stacked bar per speed range, coloured by state) and, on the
// bottleneck, why: fewest samples/s, most queue per peer. Peer cards only when the stage is
// expanded, and no more than fit one screen (the slowest first); the peer table lists every peer.

import { bannedTitle, el, fmtInt, fmtRate, isNumber, peerName, reconcile, volunteerHref } from "./format.js";

const BINS = 16; // speed ranges of the histogram, the same for every stage
const KINDS = ["online", "joining", "leaving", "banned"]; // a histogram bar's parts, bottom up
const CARD_PX = 68; // a peer card's height with its gap
const COLUMN_HEAD_PX = 360; // what a stage shows above its cards, and the page's header

const expanded = new Set(); // stage indexes whose peer cards are shown

// Peer cards one stage (or the trainers) may show: those that fit one screen under its summary.
export function maxCards() {
  return Math.max(3, Math.floor((window.innerHeight - COLUMN_HEAD_PX) / CARD_PX));
}

export function renderPipeline(container, state, banned) {
  const allPeers = state.stages.flatMap((s) => s.peers);
  const fastest = Math.max(0, ...allPeers.map((p) => p.throughput));
  const limit = maxCards();
  const columns = [{ kind: "trainers", trainers: state.trainers }, ...state.stages.map((s) => ({ kind: "stage", s }))];
  reconcile(
    container,
    columns,
    (c) => (c.kind === "trainers" ? "trainers" : `stage-${c.s.index}`),
    (c) => (c.kind === "trainers" ? createTrainerColumn() : createStageColumn(c.s)),
    (node, c) =>
      c.kind === "trainers"
        ? updateTrainerColumn(node, c.trainers, limit)
        : updateStageColumn(node, c.s, fastest, banned, limit),
  );
}

function createTrainerColumn() {
  const section = el("section", "trainers");
  const header = el("header");
  header.append(el("h3", null, "Trainers"), el("span", "meta"));
  section.append(header, el("div", "boxes"), el("p", "more"));
  return section;
}

function updateTrainerColumn(section, trainers, limit) {
  section.querySelector("header .meta").textContent = `${trainers.length} feeding data`;
  const sorted = [...trainers].sort((a, b) => a.public_name.localeCompare(b.public_name));
  reconcile(
    section.querySelector(".boxes"),
    sorted.slice(0, limit),
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
        `step ${fmtInt(t.steps)} · loss ${t.loss === null ? "–" : t.loss.toFixed(3)} · ${fmtRate(t.tokens_per_s)} tok/s`;
    },
  );
  const more = section.querySelector(".more");
  more.hidden = sorted.length <= limit;
  more.textContent = `${limit} of ${fmtInt(sorted.length)} shown`;
}

function createStageColumn(stage) {
  const section = el("section", "stage");
  section.dataset.stage = String(stage.index);
  const header = el("header");
  const reasons = el("span", "reasons");
  header.append(el("h3", null, `Stage ${stage.index}`), el("span", "layers"), reasons);

  const counts = el("div", "counts");
  for (const state of ["online", "joining", "leaving", "banned"]) {
    const count = el("span", `count ${state}`);
    count.dataset.state = state;
    counts.append(count);
  }

  const figures = el("dl", "stage-figures");
  for (const [key, label] of [
    ["total", "samples/s"],
    ["median", "median / peer"],
    ["queue", "queue / peer"],
  ]) {
    const item = el("div");
    item.dataset.figure = key;
    item.append(el("dt", null, label), el("dd"));
    figures.append(item);
  }

  const histogram = el("div", "histogram");
  histogram.setAttribute("role", "img");
  for (let i = 0; i < BINS; i++) {
    const bin = el("div", "bin");
    for (const kind of KINDS) bin.append(el("div", `part ${kind}`));
    histogram.append(bin);
  }
  const axis = el("div", "histogram-axis");
  axis.append(el("span", "lo", "0"), el("span", "hi"));

  const toggle = el("button", "expand");
  toggle.type = "button";
  toggle.addEventListener("click", () => {
    if (expanded.has(stage.index)) expanded.delete(stage.index);
    else expanded.add(stage.index);
    section.dispatchEvent(new CustomEvent("expand", { bubbles: true }));
  });
  section.append(header, counts, figures, histogram, axis, toggle, el("div", "boxes"), el("p", "more"));
  return section;
}

function setCount(section, state, n) {
  const node = section.querySelector(`.count[data-state="${state}"]`);
  node.dataset.count = String(n);
  node.textContent = `${fmtInt(n)} ${state}`;
  node.hidden = n === 0 && state !== "online";
}

function updateStageColumn(section, stage, fastest, banned, limit) {
  const bannedHere = stage.peers.filter((p) => banned.has(p.peer_id)).length;
  const bottleneck = Boolean(stage.bottleneck);
  section.classList.toggle("bottleneck", bottleneck);
  section.classList.toggle("most-queue", Boolean(stage.most_queue));
  section.dataset.peers = String(stage.peers.length);
  const [start, stop] = stage.layers;
  section.querySelector(".layers").textContent = stop - start === 1 ? `layer ${start}` : `layers ${start}–${stop - 1}`;
  const reasons = [bottleneck ? "fewest samples/s" : null, stage.most_queue ? "most queue" : null].filter(Boolean);
  reconcile(
    section.querySelector(".reasons"),
    reasons,
    (r) => r,
    (r) => el("span", "tag bottleneck-tag", r === "fewest samples/s" ? `bottleneck: ${r}` : r),
    () => {},
  );
  setCount(section, "online", stage.online);
  setCount(section, "joining", stage.joining ?? stage.peers.filter((p) => p.state === "joining").length);
  setCount(section, "leaving", stage.leaving ?? stage.peers.filter((p) => p.state === "leaving").length);
  setCount(section, "banned", bannedHere);
  const figure = (key, text) => {
    section.querySelector(`[data-figure="${key}"] dd`).textContent = text;
  };
  figure("total", fmtRate(stage.throughput));
  figure("median", fmtRate(stage.median_throughput));
  figure("queue", isNumber(stage.queue_per_peer) ? `${stage.queue_per_peer.toFixed(1)} (${fmtInt(stage.queue)})` : "–");
  updateHistogram(section, stage.peers, fastest, banned);

  const open = expanded.has(stage.index);
  const toggle = section.querySelector(".expand");
  toggle.textContent = open ? "hide peers" : `show peers (${fmtInt(stage.peers.length)})`;
  toggle.setAttribute("aria-expanded", String(open));
  toggle.hidden = stage.peers.length === 0;
  // Slowest first (a bottleneck's stragglers), banned before all.
  const cards = open
    ? [...stage.peers]
        .sort((a, b) => banned.has(b.peer_id) - banned.has(a.peer_id) || a.throughput - b.throughput || peerName(a).localeCompare(peerName(b)))
        .slice(0, limit)
    : [];
  reconcile(section.querySelector(".boxes"), cards, (p) => p.peer_id, createPeerBox, (box, p) =>
    updatePeerBox(box, p, fastest, banned.get(p.peer_id)),
  );
  const more = section.querySelector(".more");
  more.hidden = !open || stage.peers.length <= limit;
  more.textContent = `the ${limit} slowest of ${fmtInt(stage.peers.length)}; the peer table lists them all`;
}

// One bar per speed range [0, fastest]; each bar stacks the peers of that range by state.
function updateHistogram(section, peers, fastest, banned) {
  const counts = Array.from({ length: BINS }, () => Object.fromEntries(KINDS.map((k) => [k, 0])));
  for (const p of peers) {
    const bin = fastest > 0 ? Math.min(BINS - 1, Math.floor((p.throughput / fastest) * BINS)) : 0;
    counts[bin][banned.has(p.peer_id) ? "banned" : p.state] += 1;
  }
  const tallest = Math.max(1, ...counts.map((c) => KINDS.reduce((sum, k) => sum + c[k], 0)));
  const histogram = section.querySelector(".histogram");
  histogram.setAttribute("aria-label", `speeds of the stage's ${peers.length} peers, 0 to ${fmtRate(fastest)} samples/s`);
  const width = fastest / BINS;
  [...histogram.children].forEach((bin, i) => {
    const c = counts[i];
    const total = KINDS.reduce((sum, k) => sum + c[k], 0);
    bin.dataset.count = String(total);
    const parts = KINDS.filter((k) => c[k]).map((k) => `${c[k]} ${k}`);
    bin.title = `${fmtRate(i * width)}–${fmtRate((i + 1) * width)} samples/s: ${parts.join(", ") || "no peer"}`;
    KINDS.forEach((k, j) => {
      bin.children[j].style.height = `${(100 * c[k]) / tallest}%`;
    });
  });
  section.querySelector(".histogram-axis .hi").textContent = `${fmtRate(fastest)} samples/s`;
}

function createPeerBox(peer) {
  const box = el("div", "peer");
  box.dataset.peerId = peer.peer_id;
  const bar = el("div", "bar");
  bar.append(el("div", "fill"));
  const name = el("a", "name");
  box.append(name, el("div", "meta"), bar, el("div", "speed"));
  return box;
}

function updatePeerBox(box, peer, fastest, bannedBy) {
  box.dataset.state = peer.state;
  box.classList.toggle("banned", Boolean(bannedBy));
  const why = bannedBy ? `; ${bannedTitle(bannedBy)}` : "";
  box.title = `${peerName(peer)} (${peer.peer_id}) at ${peer.address}${why}`;
  const name = box.querySelector(".name");
  name.textContent = peerName(peer);
  name.href = volunteerHref(peerName(peer));
  const moving = isNumber(peer.moving_to) ? ` · moving to stage ${peer.moving_to}` : "";
  const ban = bannedBy ? " · banned" : "";
  box.querySelector(".meta").textContent = `${peer.device || "?"} · ${peer.state}${ban} · queue ${peer.queue}${moving}`;
  const share = fastest > 0 ? peer.throughput / fastest : 0;
  box.querySelector(".fill").style.width = `${(100 * share).toFixed(1)}%`;
  box.querySelector(".speed").textContent = `${fmtRate(peer.throughput)} samples/s`;
}
