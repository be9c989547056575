// A small SVG line-chart renderer for the dashboard: axes with a few round ticks, grid lines, a
// legend with each series' latest value, and one <path class="series" data-points=N> per series.
// Everything is built with DOM calls (text goes through textContent), so no API data is ever
// parsed as markup.

const SVG_NS = "http://www.w3.org/2000/svg";
const MARGIN = { left: 56, right: 16, top: 28, bottom: 30 };
const TIME_STEPS_S = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

function svgElement(name, attributes = {}, text = null) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attributes)) el.setAttribute(key, String(value));
  if (text !== null) el.textContent = text;
  return el;
}

// The round step (1, 2 or 5 times a power of ten) that cuts `span` into about `count` parts.
function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / magnitude;
  return (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * magnitude;
}

function decimalsFor(step) {
  return Math.min(6, Math.max(0, -Math.floor(Math.log10(step) + 1e-9)));
}

// Ticks at multiples of `step` inside [lo, hi].
function ticksBetween(lo, hi, step) {
  const ticks = [];
  const first = Math.ceil(lo / step - 1e-9);
  for (let i = first; i * step <= hi + step * 1e-9; i++) ticks.push(i * step);
  return ticks;
}

// A linear axis; `nice` widens the domain to whole ticks (for y; x keeps the data's own range).
function numberAxis(lo, hi, count, zero, nice) {
  if (zero) lo = Math.min(0, lo);
  if (hi - lo < 1e-12) {
    const pad = Math.abs(hi) * 0.1 || 1;
    lo -= zero && lo === 0 ? 0 : pad;
    hi += pad;
  }
  const step = niceStep(hi - lo, count);
  if (nice) {
    lo = Math.floor(lo / step + 1e-9) * step;
    hi = Math.ceil(hi / step - 1e-9) * step;
  }
  const decimals = decimalsFor(step);
  return { lo, hi, ticks: ticksBetween(lo, hi, step), format: (v) => v.toFixed(decimals) };
}

function clock(t, seconds) {
  const d = new Date(t * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  const hm = `${pad(d.getHours())}:${pad(d.getMinutes())}`;
  return seconds ? `${hm}:${pad(d.getSeconds())}` : hm;
}

function timeAxis(lo, hi, count) {
  if (hi - lo < 1) hi = lo + 1;
  const wanted = (hi - lo) / count;
  const step = TIME_STEPS_S.find((s) => s >= wanted) ?? niceStep(hi - lo, count);
  return { lo, hi, ticks: ticksBetween(lo, hi, step), format: (t) => clock(t, step < 60) };
}

// At most `limit` points, evenly spread, always keeping the last one.
function thin(points, limit) {
  if (points.length <= limit) return points;
  const every = points.length / limit;
  const kept = [];
  for (let i = 0; i < limit - 1; i++) kept.push(points[Math.floor(i * every)]);
  kept.push(points[points.length - 1]);
  return kept;
}

/**
 * Draw a line chart into `svg` (its contents are replaced), sized to the element's box.
 *
 * options.series: [{name, className, points: [[x, y], ...], markers?: boolean}] (x ascending)
 * options.xAxis: "number" | "time" (x in unix seconds); options.yZero: start the y axis at 0
 * options.xLabel, options.yLabel: axis titles; options.format(y): the legend's latest value
 * options.empty: the text shown when no series has a point
 */
export function drawChart(svg, options) {
  const width = Math.max(240, Math.round(svg.clientWidth || 480));
  const height = Math.max(160, Math.round(svg.clientHeight || 260));
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();

  const left = MARGIN.left;
  const top = MARGIN.top;
  const plotW = width - MARGIN.left - MARGIN.right;
  const plotH = height - MARGIN.top - MARGIN.bottom;
  const all = options.series.flatMap((s) => s.points);
  if (all.length === 0) {
    svg.append(
      svgElement("rect", { class: "plot", x: left, y: top, width: plotW, height: plotH }),
      svgElement("text", { class: "empty", x: left + plotW / 2, y: top + plotH / 2 }, options.empty ?? "no data"),
    );
    return;
  }

  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  const xCount = Math.max(2, Math.floor(plotW / 110));
  const yCount = Math.max(2, Math.floor(plotH / 45));
  const xAxis =
    options.xAxis === "time"
      ? timeAxis(Math.min(...xs), Math.max(...xs), xCount)
      : numberAxis(Math.min(...xs), Math.max(...xs), xCount, false, false);
  const yAxis = numberAxis(Math.min(...ys), Math.max(...ys), yCount, Boolean(options.yZero), true);
  const sx = (x) => left + ((x - xAxis.lo) / (xAxis.hi - xAxis.lo)) * plotW;
  const sy = (y) => top + (1 - (y - yAxis.lo) / (yAxis.hi - yAxis.lo)) * plotH;

  const grid = svgElement("g", { class: "grid" });
  const labels = svgElement("g", { class: "ticks" });
  for (const y of yAxis.ticks) {
    grid.append(svgElement("line", { x1: left, x2: left + plotW, y1: sy(y), y2: sy(y) }));
    labels.append(svgElement("text", { class: "y", x: left - 6, y: sy(y) + 4 }, yAxis.format(y)));
  }
  for (const x of xAxis.ticks) {
    grid.append(svgElement("line", { x1: sx(x), x2: sx(x), y1: top, y2: top + plotH }));
    labels.append(svgElement("text", { class: "x", x: sx(x), y: top + plotH + 16 }, xAxis.format(x)));
  }
  svg.append(svgElement("rect", { class: "plot", x: left, y: top, width: plotW, height: plotH }), grid, labels);
  if (options.xLabel) {
    svg.append(svgElement("text", { class: "axis-label x", x: left + plotW, y: height - 2 }, options.xLabel));
  }
  if (options.yLabel) svg.append(svgElement("text", { class: "axis-label y", x: 4, y: 14 }, options.yLabel));

  const legend = svgElement("g", { class: "legend" });
  for (const series of [...options.series].reverse()) {
    const points = thin(series.points, Math.max(2, plotW));
    const d = points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    // A lone point is drawn as a dot (a zero-length segment with round caps).
    const path = svgElement("path", {
      class: `series ${series.className}`,
      d: points.length === 1 ? `${d}h0.01` : d,
      "data-points": points.length,
    });
    path.append(svgElement("title", {}, series.name));
    svg.append(path);
    if (series.markers && points.length <= 60) {
      for (const p of points) {
        svg.append(svgElement("circle", { class: `marker ${series.className}`, cx: sx(p[0]), cy: sy(p[1]), r: 3 }));
      }
    }
    const latest = series.points.length ? series.points[series.points.length - 1][1] : null;
    const label = latest === null ? series.name : `${series.name} ${options.format ? options.format(latest) : latest}`;
    legend.append(
      svgElement("text", { y: 16 }, label),
      svgElement("line", { class: `swatch ${series.className}`, y1: 12, y2: 12 }),
    );
  }
  svg.append(legend);
  layoutLegend(legend, left + plotW);
}

// Right-align the legend entries (text widths are only known once the text is in the document).
function layoutLegend(legend, right) {
  let x = right;
  const items = [...legend.children];
  for (let i = 0; i < items.length; i += 2) {
    const text = items[i];
    const swatch = items[i + 1];
    const width = text.getComputedTextLength();
    text.setAttribute("x", x - width);
    swatch.setAttribute("x1", x - width - 22);
    swatch.setAttribute("x2", x - width - 6);
    x -= width + 36;
  }
}
