// What every part of the dashboard shares: building elements, formatting figures, matching a
// container's children to a list, and the trainers' spot-check bans.
//
// Every string that comes from the API (peer names are user input) reaches the page through
// textContent or an attribute, never as markup.

export function el(tag, className = null, text = null) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== null) node.textContent = text;
  return node;
}

export const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
export const fmtLoss = (v) => (isNumber(v) ? v.toFixed(3) : "–");
export const fmtRate = (v) => (isNumber(v) ? (v >= 100 ? Math.round(v).toLocaleString("en") : v.toFixed(1)) : "–");
export const fmtInt = (v) => (isNumber(v) ? Math.round(v).toLocaleString("en") : "–");
export const fmtShare = (v) => (isNumber(v) ? `${(100 * v).toFixed(v < 0.001 ? 3 : 1)} %` : "–");
export const peerName = (p) => p.public_name || p.peer_id.slice(-8);

export function fmtDuration(seconds) {
  if (!isNumber(seconds) || seconds < 0) return "–";
  const s = Math.floor(seconds);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

export function fmtClock(t) {
  return new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

// The dashboard's link to one volunteer's view (`?peer=NAME`); the name is encoded, never markup.
export function volunteerHref(name) {
  return `?${new URLSearchParams({ peer: name })}`;
}

// Make `container`'s children match `items` in order, reusing the element of each key.
export function reconcile(container, items, keyOf, create, update) {
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

// Peer id -> names of the trainers whose spot checks banned it (swarm/verify.py).
export function spotBanned(state) {
  const banned = new Map();
  for (const t of state.trainers) {
    for (const peerId of Object.keys(t.spot_banned ?? {})) {
      banned.set(peerId, [...(banned.get(peerId) ?? []), t.public_name || t.trainer_id.slice(0, 8)]);
    }
  }
  return banned;
}

export function bannedTitle(trainers) {
  return `banned by the spot checks of trainer ${trainers.join(", ")}: its outputs disagreed with two agreeing peers`;
}
