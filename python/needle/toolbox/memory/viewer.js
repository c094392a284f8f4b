// needle's memory timeline viewer: plain JavaScript drawing SVG, inlined into the page by html.py.
//
// Every allocation is one <path class="alloc" data-block="id">, stacked in allocation order above the bytes that
// were live before recording began: a block's lower edge is the baseline plus the bytes of every older block still
// alive, so it falls when one of those is freed (memory_viz's "active memory timeline"). The stacking is a plan
// computed once per snapshot (a sweep over the events); zooming only re-maps that plan to pixels.
"use strict";
(function () {
  const started = performance.now();
  const MB = 1 << 20;  // a MiB: the labels say so
  const CATEGORY_COLORS = {
    parameter: "#4e79a7", gradient: "#f28e2b", optimizer_state: "#b07aa1", activation_kept: "#59a14f",
    activation_recomputed: "#edc948", workspace: "#bab0ac", input: "#76b7b2", other: "#9c755f", host: "#ff9da7",
  };
  const PHASE_COLORS = { forward: "#e6effc", backward: "#fce9e7", recompute: "#fdf5d3", optimizer: "#e6f4e4" };
  const FIELDS = ["op", "module", "shape", "dtype", "bytes", "category", "phase", "reason"];
  const MARGIN = { left: 56, right: 20, top: 22, bottom: 34 };
  const HEIGHT = 440;

  const data = JSON.parse(document.getElementById("needle-snapshots").textContent);
  const tooltip = document.getElementById("tooltip");
  const alivePanel = document.getElementById("alive");
  const xmodeSelect = document.getElementById("xmode");

  function esc(value) {
    return String(value).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  }
  function colorOf(category) { return CATEGORY_COLORS[category] || CATEGORY_COLORS.other; }
  function megabytes(bytes, digits) { return (bytes / MB).toFixed(digits === undefined ? 2 : digits); }
  function fieldText(block, field) {
    const value = block[field];
    if (value === null || value === undefined) return "—";
    if (field === "shape") return "(" + value.join(", ") + ")";
    if (field === "bytes") return value.toLocaleString("en-US") + " B (" + megabytes(value) + " MiB)";
    return String(value);
  }

  // ----- the plan: where every block sits at every event --------------------------------------------------------
  // block.steps = [event, offset, event, offset, ...]: the block's lower edge (bytes) from each event on.
  function stackBlocks(snapshot) {
    const blocks = snapshot.blocks.map((b) => Object.assign({}, b, { steps: [], pos: -1, offset: 0 }));
    const n = snapshot.events.length;
    // Blocks alive before recording began (alloc null) sit at the bottom from the first event on.
    // Host copies of offloaded values are not device memory: listed when alive, never stacked.
    const device = blocks.filter((b) => b.category !== "host");
    const byAlloc = device.filter((b) => b.alloc !== null).sort((a, b) => a.alloc - b.alloc);
    const byFree = device.filter((b) => b.free !== null).sort((a, b) => a.free - b.free);
    const stack = [];
    let top = snapshot.baseline_bytes, nextAlloc = 0, nextFree = 0;
    for (const block of device.filter((b) => b.alloc === null)) {
      block.pos = stack.length;
      block.offset = top;
      block.steps.push(0, top);
      stack.push(block);
      top += block.bytes;
    }
    for (let t = 0; t < n; t++) {
      while (nextFree < byFree.length && byFree[nextFree].free === t) {
        const gone = byFree[nextFree++];
        stack.splice(gone.pos, 1);
        top -= gone.bytes;
        for (let j = gone.pos; j < stack.length; j++) {  // everything above falls by the freed bytes
          const above = stack[j];
          above.pos = j;
          above.offset -= gone.bytes;
          above.steps.push(t, above.offset);
        }
      }
      while (nextAlloc < byAlloc.length && byAlloc[nextAlloc].alloc === t) {
        const block = byAlloc[nextAlloc++];
        block.pos = stack.length;
        block.offset = top;
        block.steps.push(t, top);
        stack.push(block);
        top += block.bytes;
      }
    }
    return blocks;
  }

  // Event i is drawn over [xs[i], xs[i + 1]): its index, or its time with the last event as long as the one before.
  function eventPositions(snapshot, mode) {
    const events = snapshot.events, n = events.length, xs = new Float64Array(n + 1);
    for (let i = 0; i <= n; i++) xs[i] = i;
    if (mode === "time" && n > 0) {
      for (let i = 0; i < n; i++) xs[i] = events[i].time;
      xs[n] = n > 1 ? 2 * xs[n - 1] - xs[n - 2] : xs[n - 1] + 1;
      if (!(xs[n] > xs[n - 1])) xs[n] = xs[n - 1] + 1e-9;
    }
    return xs;
  }
  function hasTimes(snapshot) { return snapshot.events.every((e) => typeof e.time === "number"); }

  function makePanel(entry, index) {
    const snapshot = entry.snapshot;
    const panel = { index, label: entry.label, snapshot, blocks: stackBlocks(snapshot), byId: new Map() };
    for (const b of panel.blocks) panel.byId.set(String(b.id), b);
    const div = document.createElement("div");
    div.className = "panel";
    div.innerHTML = (entry.label ? "<h2>" + esc(entry.label) + "</h2>" : "") + "<svg></svg>";
    document.getElementById("panels").appendChild(div);
    panel.svg = div.querySelector("svg");
    return panel;
  }

  // ----- drawing ---------------------------------------------------------------------------------------------
  function niceStep(span, count) {
    const raw = span / count, power = Math.pow(10, Math.floor(Math.log10(raw))), unit = raw / power;
    return power * (unit < 1.5 ? 1 : unit < 3 ? 2 : unit < 7 ? 5 : 10);
  }

  // The step path of one block: its lower edge left to right, its upper edge back. Steps closer than half a pixel
  // merge (the later one wins), so a zoomed-out path has at most one vertex pair per pixel column.
  function blockPath(block, g) {
    const n = g.xs.length - 1, end = block.free === null ? n : block.free;
    if (g.xs[end] <= g.x0 || g.xs[block.alloc === null ? 0 : block.alloc] >= g.x1) return "";
    const px = [], lower = [], steps = block.steps;
    for (let k = 0; k < steps.length; k += 2) {
      const x = g.X(g.xs[steps[k]]), y = steps[k + 1];
      if (px.length && x - px[px.length - 1] < 0.5) lower[lower.length - 1] = y;
      else { px.push(x); lower.push(y); }
    }
    const xEnd = g.X(g.xs[end]).toFixed(1);
    let d = "M" + px[0].toFixed(1) + " " + g.Y(lower[0]).toFixed(1);
    for (let k = 1; k < px.length; k++) d += "H" + px[k].toFixed(1) + "V" + g.Y(lower[k]).toFixed(1);
    d += "H" + xEnd + "V" + g.Y(lower[lower.length - 1] + block.bytes).toFixed(1);
    for (let k = px.length - 1; k > 0; k--) d += "H" + px[k].toFixed(1) + "V" + g.Y(lower[k - 1] + block.bytes).toFixed(1);
    return d + "H" + px[0].toFixed(1) + "Z";
  }

  function geometry(panel, yMax) {
    const width = Math.max(panel.svg.getBoundingClientRect().width, 200);
    const left = MARGIN.left, right = width - MARGIN.right, top = MARGIN.top, bottom = HEIGHT - MARGIN.bottom;
    const v = panel.view, g = { width, left, right, top, bottom, xs: panel.xs, x0: v.x0, x1: v.x1 };
    const scale = (right - left) / (v.x1 - v.x0);
    g.X = (x) => Math.min(right + 2, Math.max(left - 2, left + (x - v.x0) * scale));
    g.Y = (bytes) => bottom - (bytes / yMax) * (bottom - top);
    g.eventAt = (pixel) => {  // the event drawn under this pixel column (binary search over xs)
      const x = v.x0 + (pixel - left) / scale;
      let lo = 0, hi = panel.xs.length - 2;
      while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (panel.xs[mid] <= x) lo = mid; else hi = mid - 1; }
      return lo;
    };
    return g;
  }

  function axesSvg(g, yMax, mode) {
    let out = '<g class="axis">';
    const yStep = niceStep(yMax / MB, 6) * MB;
    for (let b = 0; b <= yMax; b += yStep) {
      const y = g.Y(b).toFixed(1);
      out += '<line x1="' + g.left + '" x2="' + g.right + '" y1="' + y + '" y2="' + y + '" stroke-opacity="0.35"/>';
      out += '<text x="' + (g.left - 4) + '" y="' + y + '" dy="0.32em" text-anchor="end">' + megabytes(b, yStep < MB ? 2 : 0) + "</text>";
    }
    const xStep = niceStep(g.x1 - g.x0, 8), digits = xStep < 1 ? Math.ceil(-Math.log10(xStep)) : 0;
    for (let x = Math.ceil(g.x0 / xStep) * xStep; x <= g.x1; x += xStep) {
      out += '<text x="' + g.X(x).toFixed(1) + '" y="' + (g.bottom + 14) + '" text-anchor="middle">' + x.toFixed(digits) + "</text>";
    }
    out += '<text x="' + ((g.left + g.right) / 2) + '" y="' + (HEIGHT - 4) + '" text-anchor="middle">'
      + (mode === "time" ? "time (s)" : "event") + "</text>";
    out += '<text transform="rotate(-90)" x="' + (-(g.top + g.bottom) / 2) + '" y="12" text-anchor="middle">live memory (MiB)</text>';
    return out + "</g>";
  }

  function phasesSvg(panel, g) {
    let out = "";
    for (const phase of panel.snapshot.phases) {
      const a = g.X(g.xs[phase.start]), b = g.X(g.xs[Math.min(phase.end, g.xs.length - 1)]);
      if (b - a < 0.5) continue;
      out += '<g class="phase-band" data-phase="' + esc(phase.phase) + '"><rect x="' + a.toFixed(1) + '" y="' + g.top
        + '" width="' + (b - a).toFixed(1) + '" height="' + (g.bottom - g.top) + '" fill="'
        + (PHASE_COLORS[phase.phase] || "#f2f2f2") + '"/>';
      if (b - a > 40) out += '<text x="' + ((a + b) / 2).toFixed(1) + '" y="' + (g.top - 6) + '" text-anchor="middle">' + esc(phase.phase) + "</text>";
      out += "</g>";
    }
    return out;
  }

  // The live bytes the recorder wrote, as a thin line over the stack: where it leaves the stack's top edge the
  // snapshot's blocks and its live_bytes disagree.
  function liveLineSvg(panel, g) {
    const d = stepPath(panel.snapshot.events, "live_bytes", g);
    return d ? '<path class="live-line" d="' + d + '"/>' : "";
  }

  // What the allocator holds resident (live + cached for reuse), where the backend reports it: a dashed line above
  // the stack; the gap between them is the allocator's cache and fragmentation.
  function reservedLineSvg(panel, g) {
    const d = stepPath(panel.snapshot.events, "reserved_bytes", g);
    return d ? '<path class="reserved-line" d="' + d + '"><title>reserved: live + cached for reuse</title></path>' : "";
  }

  // A step line through events[i][key] over the visible range (events without the key skipped), as an SVG path's
  // d: steps closer than half a pixel merge into one vertical move; "" when nothing is visible.
  function stepPath(events, key, g) {
    let d = "", lastX = -1;
    for (let i = 0; i < events.length; i++) {
      if (g.xs[i + 1] < g.x0 || g.xs[i] > g.x1 || typeof events[i][key] !== "number") continue;
      const x = g.X(g.xs[i]), y = g.Y(events[i][key]).toFixed(1);
      d += (d ? (x - lastX < 0.5 ? "V" + y : "H" + x.toFixed(1) + "V" + y) : "M" + x.toFixed(1) + " " + y);
      if (x - lastX >= 0.5) lastX = x;
    }
    return d ? d + "H" + g.X(g.x1).toFixed(1) : "";
  }

  function peakSvg(panel, g) {
    const peak = panel.snapshot.peak;
    if (!peak || typeof peak.event !== "number" || typeof peak.bytes !== "number") return "";
    const x = g.X((g.xs[peak.event] + g.xs[peak.event + 1]) / 2), y = g.Y(peak.bytes);
    if (x < g.left || x > g.right) return "";
    const anchor = x > (g.left + g.right) / 2 ? "end" : "start", dx = anchor === "end" ? -6 : 6;
    return '<g class="peak"><line x1="' + x.toFixed(1) + '" x2="' + x.toFixed(1) + '" y1="' + y.toFixed(1) + '" y2="' + g.bottom
      + '"/><circle cx="' + x.toFixed(1) + '" cy="' + y.toFixed(1) + '" r="3.5" fill="#c00"/><text x="' + (x + dx).toFixed(1)
      + '" y="' + (y - 6).toFixed(1) + '" text-anchor="' + anchor + '">peak ' + megabytes(peak.bytes) + " MiB (event "
      + esc(peak.event) + ")</text></g>";
  }

  function drawPanel(panel, yMax, mode) {
    const g = geometry(panel, yMax);
    panel.geometry = g;
    panel.svg.setAttribute("viewBox", "0 0 " + g.width.toFixed(0) + " " + HEIGHT);
    const baseline = g.Y(panel.snapshot.baseline_bytes);
    let out = phasesSvg(panel, g) + axesSvg(g, yMax, mode);
    out += '<rect class="baseline" x="' + g.left + '" y="' + baseline.toFixed(1) + '" width="' + (g.right - g.left)
      + '" height="' + (g.bottom - baseline).toFixed(1) + '"><title>live before recording began</title></rect>';
    // Blocks at least 3 px tall get a white edge to tell neighbours apart; on thinner ones it would only wash the
    // colours out.
    const parts = [], edgeBytes = 3 * yMax / (g.bottom - g.top);
    for (const b of panel.blocks.filter((b) => b.category !== "host")) {
      parts.push('<path class="alloc' + (b.bytes >= edgeBytes ? " edged" : "") + '" data-block="' + esc(b.id)
        + '" fill="' + colorOf(b.category) + '" d="' + blockPath(b, g) + '"/>');
    }
    out += parts.join("") + liveLineSvg(panel, g) + reservedLineSvg(panel, g) + peakSvg(panel, g);
    if (panel.instant !== undefined) {
      const x = g.X((g.xs[panel.instant] + g.xs[panel.instant + 1]) / 2).toFixed(1);
      out += '<line class="instant" x1="' + x + '" x2="' + x + '" y1="' + g.top + '" y2="' + g.bottom + '"/>';
    }
    if (!panel.snapshot.events.length) out += '<text x="' + g.left + '" y="' + g.top + '">no events recorded</text>';
    panel.svg.innerHTML = out + '<rect class="selection" visibility="hidden" y="' + g.top + '" height="' + (g.bottom - g.top) + '"/>';
  }

  // ----- interaction -------------------------------------------------------------------------------------------
  function showTooltip(panel, block, event) {
    let rows = "";
    for (const field of FIELDS) rows += "<tr><th>" + field + "</th><td>" + esc(fieldText(block, field)) + "</td></tr>";
    rows += "<tr><th>alive</th><td>events " + (block.alloc === null ? "(before recording)" : esc(block.alloc)) + " – " + (block.free === null ? "end" : esc(block.free)) + "</td></tr>";
    tooltip.innerHTML = "<b>block " + esc(block.id) + "</b><table>" + rows + "</table>";
    tooltip.style.display = "block";
    tooltip.style.left = Math.min(event.clientX + 14, window.innerWidth - tooltip.offsetWidth - 4) + "px";
    tooltip.style.top = Math.min(event.clientY + 14, window.innerHeight - tooltip.offsetHeight - 4) + "px";
  }

  let pickedPanel = null;  // the panel whose instant the alive list shows (its line is the only one drawn)
  function showAlive(panel, t) {
    if (pickedPanel && pickedPanel !== panel) pickedPanel.instant = undefined;
    pickedPanel = panel;
    const alive = panel.blocks.filter((b) => (b.alloc === null || b.alloc <= t) && (b.free === null || t < b.free));
    alive.sort((a, b) => b.bytes - a.bytes);
    const total = alive.reduce((sum, b) => sum + b.bytes, 0);
    let rows = "<tr>" + FIELDS.map((f) => "<th>" + f + "</th>").join("") + "</tr>";
    for (const b of alive) {
      rows += '<tr data-block="' + esc(b.id) + '">' + FIELDS.map((f) => f === "bytes"
        ? '<td class="bytes">' + esc(fieldText(b, f)) + "</td>"
        : "<td>" + (f === "category" ? '<i style="background:' + colorOf(b.category) + '"></i>' : "")
          + esc(fieldText(b, f)) + "</td>").join("") + "</tr>";
    }
    const where = panel.label ? " of " + esc(panel.label) : "";
    alivePanel.innerHTML = "<h2>Alive at event " + t + where + ": " + alive.length + " blocks, " + megabytes(total)
      + " MiB (+ " + megabytes(panel.snapshot.baseline_bytes) + " MiB from before recording)</h2><table>" + rows + "</table>";
    panel.instant = t;
  }

  function attachInteraction(panel, redraw) {
    const svg = panel.svg;
    const pixelX = (event) => {
      const box = svg.getBoundingClientRect();
      return (event.clientX - box.left) * (panel.geometry.width / box.width);
    };
    svg.addEventListener("mouseover", (event) => {
      const block = event.target.classList.contains("alloc") && panel.byId.get(event.target.dataset.block);
      if (block) showTooltip(panel, block, event); else tooltip.style.display = "none";
    });
    svg.addEventListener("mouseleave", () => { tooltip.style.display = "none"; });
    svg.addEventListener("wheel", (event) => {
      event.preventDefault();
      const g = panel.geometry, at = g.x0 + (pixelX(event) - g.left) / (g.right - g.left) * (g.x1 - g.x0);
      const factor = event.deltaY < 0 ? 0.8 : 1.25;
      zoomTo(panel, at - (at - g.x0) * factor, at + (g.x1 - at) * factor);
      redraw();
    }, { passive: false });
    let dragFrom = null;
    svg.addEventListener("mousedown", (event) => { dragFrom = pixelX(event); event.preventDefault(); });
    svg.addEventListener("mousemove", (event) => {
      if (tooltip.style.display === "block" && event.target.classList.contains("alloc")) {
        showTooltip(panel, panel.byId.get(event.target.dataset.block), event);  // follow the mouse
      }
      if (dragFrom === null) return;
      const now = pixelX(event), rect = svg.querySelector(".selection");
      rect.setAttribute("x", Math.min(dragFrom, now));
      rect.setAttribute("width", Math.abs(now - dragFrom));
      rect.setAttribute("visibility", "visible");
    });
    window.addEventListener("mouseup", (event) => {
      if (dragFrom === null) return;
      const from = dragFrom, to = pixelX(event), g = panel.geometry;
      dragFrom = null;
      if (Math.abs(to - from) > 4) {
        const toX = (p) => g.x0 + (p - g.left) / (g.right - g.left) * (g.x1 - g.x0);
        zoomTo(panel, toX(Math.min(from, to)), toX(Math.max(from, to)));
      } else if (event.target.closest && event.target.closest("svg") === svg && panel.snapshot.events.length) {
        showAlive(panel, g.eventAt(to));
      }
      redraw();
    });
  }

  function fullView(panel) {  // (an empty snapshot still gets an x axis one event wide)
    const x0 = panel.xs[0], x1 = panel.xs[panel.xs.length - 1];
    panel.view = { x0, x1: x1 > x0 ? x1 : x0 + 1 };
  }
  function zoomTo(panel, x0, x1) {
    if (panel.xs.length < 2) return;  // nothing recorded: nothing to zoom into
    const lo = panel.xs[0], hi = panel.xs[panel.xs.length - 1], minSpan = (panel.xs[1] - panel.xs[0]) * 4 || 1e-9;
    x0 = Math.max(lo, x0); x1 = Math.min(hi, x1);
    if (x1 - x0 < minSpan) { const mid = (x0 + x1) / 2; x0 = Math.max(lo, mid - minSpan / 2); x1 = Math.min(hi, x0 + minSpan); }
    panel.view = { x0, x1 };
  }

  // ----- the page ---------------------------------------------------------------------------------------------
  function main() {
    document.getElementById("legend").innerHTML = Object.keys(CATEGORY_COLORS).map((c) =>
      '<span><i style="background:' + CATEGORY_COLORS[c] + '"></i>' + c + "</span>").join("")
      + '<span><i class="baseline"></i>before recording</span><span><i class="reserved"></i>reserved (live + cached)</span><span>phases:</span>'
      + Object.keys(PHASE_COLORS).map((p) => '<span><i style="background:' + PHASE_COLORS[p] + '"></i>' + p + "</span>").join("");
    const panels = data.snapshots.map(makePanel);
    // One y axis for every panel, so that gc off and gc on compare by eye.
    let yMax = 1;
    for (const p of panels) {
      yMax = Math.max(yMax, p.snapshot.peak ? p.snapshot.peak.bytes : 0, p.snapshot.baseline_bytes);
      for (const e of p.snapshot.events) yMax = Math.max(yMax, e.live_bytes || 0, e.reserved_bytes || 0);
    }
    yMax *= 1.08;
    if (!panels.every((p) => hasTimes(p.snapshot))) xmodeSelect.disabled = true;
    const setMode = () => {
      for (const p of panels) { p.xs = eventPositions(p.snapshot, xmodeSelect.value); fullView(p); }
    };
    const redraw = () => { for (const p of panels) drawPanel(p, yMax, xmodeSelect.value); };
    setMode();
    redraw();
    for (const p of panels) attachInteraction(p, redraw);
    document.getElementById("reset").addEventListener("click", () => { for (const p of panels) fullView(p); redraw(); });
    xmodeSelect.addEventListener("change", () => { setMode(); redraw(); });
    window.addEventListener("resize", redraw);
    window.needleMemoryPanels = panels;  // for a console user (and the tests) to poke at
  }

  main();
  document.body.getBoundingClientRect();  // force layout, so the time below includes it
  document.body.dataset.renderMs = (performance.now() - started).toFixed(1);
})();
