// The live fabric page (adapters/http/fabric_page.py serves it and its data).
// /events pushes the KV bucket (a snapshot, then each changed key), the event feed and
// utilization samples; /api/topology and /api/why ask the engine's queries. Everything shown
// is set as text, never as markup: ids, tenants and reasons come from clients.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
// Events after which the topology (nodes, links, health, circuits) is asked for again.
const TOPOLOGY_EVENTS = new Set([
  "TopologyImported", "NodeAdded", "LinkAdded", "ComponentRemoved", "ComponentDrained",
  "ComponentUndrained", "ComponentFaulted", "ComponentRecovered", "CircuitCreated",
  "CircuitRemoved",
]);
const BAD_EVENTS = new Set(["ComponentFaulted", "CompositionImpaired", "CompositionFailed", "CompositionRejected"]);
const FEED_KEPT = 200;
const MAX_NEST = 6;  // switch boxes nested deeper than this sit in their ancestor at this depth

const state = {
  values: new Map(),   // KV key -> value (adapters/nats/kv_state.py)
  utilization: {},     // domain -> [[t, gpus held, gpus, memory used GiB, memory GiB], ...]
  events: {},          // domain -> its recent events, oldest first (at most FEED_KEPT)
  domain: new URLSearchParams(location.search).get("domain") || "",
  topology: null,      // the topology query's result for state.domain
  layout: new Map(),   // node id -> {x, y, block, ...}: where layOut put it
  blocks: [],          // the top switches' blocks: {x, y, width, height}
  size: { width: 0, height: 0 },
  bus: 0,              // the y of the bus under the OCS band
  lane: new Map(),     // OCS id -> its lane's offset on the bus and in the gutters
  selected: "",
  colours: new Map(),  // tenant -> its colour (tenantColour)
};
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text = "") {
  const node = tag in SVG_TAGS ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}
const SVG_TAGS = { svg: 1, g: 1, line: 1, rect: 1, circle: 1, polygon: 1, polyline: 1, text: 1, title: 1 };

// Sixteen colours far apart from each other (CIE76 distance 34 at the least) and from the red
// and orange of faults (42), picked greedily from an sRGB grid of mid lightness.
const PALETTE = [
  "#1f77b4", "#00c000", "#0000e0", "#804000", "#e020a0", "#00c0a0", "#a0a000", "#e0a0c0",
  "#8060e0", "#006000", "#802040", "#808060", "#c000e0", "#00c0e0", "#604080", "#60c060",
];

// A tenant's colour: the palette's slot its name hashes to, or the next one no other tenant
// holds, so up to 16 tenants never share one. A tenant keeps its colour for the page's life;
// tenants are given theirs in the order of their names (snapshot), so a reload repeats it.
function tenantColour(tenant) {
  let colour = state.colours.get(tenant);
  if (colour) return colour;
  let hash = 0;
  for (const c of tenant) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  const taken = new Set(state.colours.values());
  let slot = hash % PALETTE.length;
  for (let tries = 0; tries < PALETTE.length && taken.has(PALETTE[slot]); tries++) {
    slot = (slot + 1) % PALETTE.length;
  }
  colour = PALETTE[slot];  // past 16 tenants, colours repeat
  state.colours.set(tenant, colour);
  return colour;
}

// What went wrong, by the part of the page it is about, shown above the fabric instead of a
// blank page; the rest keeps working, and a part that works again takes its problem away.
const problems = new Map();
function showProblem(part, text) {
  problems.set(part, text);
  showProblems();
}
function clearProblem(part) {
  if (problems.delete(part)) showProblems();
}
function showProblems() {
  const banner = $("problem");
  banner.textContent = [...problems.values()].join("\n");
  banner.hidden = problems.size === 0;
}

// `work`, with whatever it throws shown as the problem of `what` instead of stopping the
// page, and that problem gone once `work` runs through.
function guarded(work, what) {
  const failed = (e) => showProblem(what, `${what}: ${e && e.message ? e.message : e}`);
  const run = (...args) => {
    try {
      const result = work(...args);
      if (result && typeof result.then === "function") {
        return result.then(() => clearProblem(what), failed);
      }
      clearProblem(what);
      return result;
    } catch (e) {
      failed(e);
      return undefined;
    }
  };
  run.what = what;
  return run;
}
window.addEventListener("error", (e) => showProblem("the page", `the page failed: ${e.message}`));
window.addEventListener("unhandledrejection", (e) => showProblem("the page", `the page failed: ${e.reason}`));

function entries(kind) {
  const start = `${state.domain}.${kind}.`, found = [];
  for (const [key, value] of state.values) {
    if (key.startsWith(start) && value) found.push([key.slice(start.length), value]);
  }
  return found.sort((a, b) => (a[0] < b[0] ? -1 : 1));
}

// ---- the live feed ----

function connect() {
  const source = new EventSource("events");
  source.addEventListener("open", () => {
    setStatus("live");
    clearProblem("the live feed");
  });
  source.addEventListener("error", () => {
    setStatus("connecting");
    // The browser tries again by itself, unless the server answered with an error status:
    // then the stream stays closed, and the page asks why.
    if (source.readyState === EventSource.CLOSED) whyClosed();
  });
  source.addEventListener("snapshot", guarded((e) => {
    const snapshot = JSON.parse(e.data);
    state.values = new Map(Object.entries(snapshot.values));
    state.utilization = snapshot.utilization;
    state.events = snapshot.events;
    showEvents();
    const tenants = new Set();
    for (const [key, value] of state.values) {
      if (key.split(".")[1] === "composition" && value && typeof value.tenant === "string") {
        tenants.add(value.tenant);
      }
    }
    [...tenants].sort().forEach(tenantColour);
    domainsChanged();
    refreshTopology();
  }, "the snapshot"));
  source.addEventListener("kv", guarded((e) => {
    const { key, value } = JSON.parse(e.data);
    if (value === null || ["released", "failed"].includes(value.state)) state.values.delete(key);
    else state.values.set(key, value);
    if (!key.startsWith(`${state.domain}.`)) domainsChanged();
    later(render);
  }, "a change"));
  source.addEventListener("feed", guarded((e) => {
    const event = JSON.parse(e.data);
    const kept = (state.events[event.domain] ||= []);
    kept.push(event);
    if (kept.length > FEED_KEPT) kept.shift();
    if (event.domain !== state.domain) return;
    showEvent(event);
    if (TOPOLOGY_EVENTS.has(event.type)) later(refreshTopology, 200);
  }, "an event"));
  source.addEventListener("utilization", guarded((e) => {
    const { domain, sample } = JSON.parse(e.data);
    (state.utilization[domain] ||= []).push(sample);
    if (state.utilization[domain].length > 900) state.utilization[domain].shift();
    if (domain === state.domain) drawUtilization();
  }, "utilization"));
}

// A stream refused with 401: the token this page holds is not the server's. A new token is
// made at every start, so the engine restarted; only the address it printed has the new one.
async function whyClosed() {
  let status;
  try {
    status = (await fetch("events", { method: "HEAD", cache: "no-store" })).status;
  } catch (e) {
    status = 0;  // not there (yet): try again
  }
  if (status === 401) return tokenRefused();
  showProblem("the live feed", `the live feed closed${status ? ` (HTTP ${status})` : ""}: trying again`);
  setTimeout(connect, 2000);
}

function tokenRefused() {
  setStatus("engine restarted");
  showProblem("the live feed", "the engine restarted and no longer takes this page's token: "
    + "open the new address `trellis up` printed (fabric page: http://…/?token=…)");
}

function setStatus(text) {
  $("status").textContent = text;
  $("status").dataset.state = text;
}

// Runs `work` once, `ms` from the first of a burst of calls.
const pending = new Map();
function later(work, ms = 50) {
  if (pending.has(work)) return;
  const run = work.what ? work : guarded(work, `drawing (${work.name})`);
  pending.set(work, setTimeout(() => { pending.delete(work); run(); }, ms));
}

function domainsChanged() {
  const domains = [...new Set([...state.values.keys()].map((k) => k.split(".")[0]))].sort();
  if (!state.domain && domains.length) {
    state.domain = domains[0];
    showEvents();
    later(refreshTopology, 0);
  }
  if (state.domain && !domains.includes(state.domain)) domains.unshift(state.domain);
  const select = $("domain");
  if ([...select.options].map((o) => o.value).join() === domains.join()) return;
  select.replaceChildren(...domains.map((d) => el("option", { value: d }, d)));
  select.value = state.domain;
}

async function ask(what, params) {
  const query = new URLSearchParams({ domain: state.domain, ...params });
  const response = await fetch(`api/${what}?${query}`);
  if (response.status === 401) {
    tokenRefused();
    throw new Error("the page's token was refused");
  }
  return response.json();
}

const refreshTopology = guarded(async function refreshTopology() {
  if (!state.domain) return render();
  const domain = state.domain;
  const reply = await ask("topology");
  if (domain !== state.domain) return;  // another domain was picked meanwhile; its own ask draws
  state.topology = reply.ok ? reply.result : null;
  // A domain not there yet is no problem: the page shows its "no topology" note until it is.
  if (reply.ok || reply.error?.code === "not_found") clearProblem("topology");
  else showProblem("topology", `topology of ${domain}: ${reply.error?.message}`);
  relayout();
}, "the topology");

// ---- the graph ----

// The layout follows the topology's own hierarchy, read from its links (never from ids):
// OCS in a band on top; below it one block per top switch (a switch linked to an OCS, or,
// where none is, the best-connected switch of its group), packed into as many columns as the
// page is wide. In a block: the switch, the hosts linked to it beside it, its devices as tiles
// in rows, then the switches beneath it (trays, leaves), each with its own tiles. A device
// hangs off its deepest switch; what fits nowhere goes to an "unattached" block.
// Links inside a block run down the parent's spine; links between blocks run up the gutter
// left of the block to a bus under the OCS band.
const BLOCK = 250, GAP = 20, MARGIN = 20, INDENT = 20, HEADER = 28, HOST_ROW = 30, TILE_ROW = 36;
const byName = (a, b) => a.localeCompare(b, undefined, { numeric: true });
const measurer = document.createElement("canvas").getContext("2d");
function textWidth(text, px) {
  measurer.font = `${px}px system-ui, sans-serif`;
  return measurer.measureText(text).width;
}

// The boxes: one per switch and per OCS, each with the hosts, devices and switches under it.
function hierarchy(topology) {
  const kind = new Map(topology.nodes.map((n) => [n.id, n.kind]));
  const near = new Map(topology.nodes.map((n) => [n.id, new Set()]));
  for (const link of topology.links) {
    if (!near.has(link.a) || !near.has(link.b) || link.a === link.b) continue;
    near.get(link.a).add(link.b);
    near.get(link.b).add(link.a);
  }
  const neighbours = (id, k) => [...near.get(id)].filter((o) => kind.get(o) === k).sort(byName);
  const ids = (k) => topology.nodes.filter((n) => n.kind === k).map((n) => n.id).sort(byName);
  const switches = ids("switch"), ocs = ids("ocs");
  // A switch's depth: 1 beside an OCS, one more for each switch in between.
  const depth = new Map();
  const spread = (roots) => {
    roots.forEach((id) => depth.set(id, 1));
    for (let frontier = roots; frontier.length;) {
      const next = [];
      for (const id of frontier) {
        for (const other of neighbours(id, "switch")) {
          if (depth.has(other)) continue;
          depth.set(other, depth.get(id) + 1);
          next.push(other);
        }
      }
      frontier = next;
    }
  };
  spread(switches.filter((id) => neighbours(id, "ocs").length));
  // No OCS reaches these: the one with most switches and hosts around tops its group.
  const reach = (id) => neighbours(id, "switch").length + neighbours(id, "host").length;
  for (let left; (left = switches.filter((id) => !depth.has(id))).length;) {
    spread([left.sort((a, b) => reach(b) - reach(a) || byName(a, b))[0]]);
  }
  const boxes = new Map();
  const box = (id) => boxes.get(id) || boxes.set(id, { id, hosts: [], devices: [], children: [] }).get(id);
  const other = box("");
  const tops = [], band = ocs.map(box);
  // Boxes nest at most MAX_NEST deep: a deeper switch sits in its ancestor at that depth, so a
  // chain of thousands of switches draws as a long box, not as thousands of nested ones.
  const parent = new Map();
  const byDepth = [...switches].sort((a, b) => depth.get(a) - depth.get(b));
  for (const id of byDepth) {
    if (depth.get(id) === 1) continue;
    const up = neighbours(id, "switch").find((o) => depth.get(o) === depth.get(id) - 1);
    parent.set(id, depth.get(up) > MAX_NEST ? parent.get(up) : up);
  }
  for (const id of byDepth) {
    if (depth.get(id) === 1) tops.push(box(id));
    else box(parent.get(id)).children.push(box(id));
  }
  const shallowFirst = (a, b) => depth.get(a) - depth.get(b) || byName(a, b);
  // A host sits with the switch nearest the OCS of those it is linked to.
  const hostBox = new Map();
  for (const id of ids("host")) {
    const up = neighbours(id, "switch").sort(shallowFirst)[0] || neighbours(id, "ocs")[0];
    hostBox.set(id, up ? box(up) : other);
    hostBox.get(id).hosts.push(id);
  }
  // A device sits with its deepest switch (its tray, not the rack's), else its OCS, else
  // beside its host.
  for (const node of topology.nodes) {
    if (["host", "switch", "ocs"].includes(node.kind)) continue;
    const up = neighbours(node.id, "switch").sort(shallowFirst).pop() || neighbours(node.id, "ocs")[0];
    const host = neighbours(node.id, "host")[0];
    (up ? box(up) : host ? hostBox.get(host) : other).devices.push(node);
  }
  const deviceOrder = (a, b) => byName(a.device_kind || "", b.device_kind || "") || byName(a.id, b.id);
  for (const b of boxes.values()) b.devices.sort(deviceOrder);
  // Blocks with hosts (racks) first, the rest (pools) after them.
  const hosted = (b) => (b.hosts.length || b.children.some(hosted) ? 0 : 1);  // MAX_NEST deep
  tops.sort((a, b) => hosted(a) - hosted(b) || byName(a.id, b.id));
  if (other.hosts.length || other.devices.length) tops.push(other);
  return { tops, band };
}

// Tile labels: what tells a device from its siblings (the common start of their ids cut at a
// separator: "1".."8" for gpu-r1-1-1..8), the whole id when that says nothing.
function shortLabels(devices) {
  const whole = devices.map((d) => d.id);
  if (whole.length < 2) return whole;
  let common = whole.reduce((a, b) => { let i = 0; while (i < a.length && a[i] === b[i]) i++; return a.slice(0, i); });
  common = common.slice(0, Math.max(...[..."-_.:/"].map((c) => common.lastIndexOf(c))) + 1);
  const rest = whole.map((id) => id.slice(common.length));
  return rest.every(Boolean) ? rest : whole;
}
function fit(text, px, room) {
  if (textWidth(text, px) <= room) return text;
  while (text.length > 1 && textWidth(`${text}…`, px) > room) text = text.slice(0, -1);
  return `${text}…`;
}

// What a box holds, as its header says it: "8 gpu H100", "2 nic · 2 nvme · 1 memory"; with
// the model where all of a kind share one, and without (for a narrow header).
function summary(devices) {
  const kinds = new Map();
  for (const d of devices) {
    const k = d.device_kind || d.kind;
    kinds.set(k, [...(kinds.get(k) || []), d]);
  }
  const counts = [...kinds].map(([k, list]) => {
    const models = new Set(list.map((d) => d.model));
    return [`${list.length} ${k}`, models.size === 1 && list[0].model ? ` ${list[0].model}` : ""];
  });
  return [counts.map(([c, m]) => c + m).join(" · "), counts.map(([c]) => c).join(" · ")];
}

function layOut() {
  state.layout = new Map();
  state.blocks = [];
  state.size = { width: 0, height: 0 };
  const topology = state.topology;
  if (!topology) return;
  const { tops, band } = hierarchy(topology);
  const at = state.layout;
  const room = Math.max(BLOCK + 2 * MARGIN, $("fabric").parentElement.clientWidth - 2);
  const columns = Math.max(1, Math.floor((room - 2 * MARGIN + GAP) / (BLOCK + GAP)));
  const width = Math.floor((room - 2 * MARGIN - (columns - 1) * GAP) / columns);
  let bottom = 0;

  // Lays a box out at (x, y), `w` wide, in block `block`; answers its height.
  const place = (b, x, y, w, block) => {
    const spine = x + 12, put = (id, p) => at.set(id, { ...p, block, spine });
    let cy = y + HEADER;
    if (b.id) {
      const [long, short] = summary(b.devices), labelRoom = w - 30 - textWidth(b.id, 11) - 8;
      const said = [long, short].find((s) => s && textWidth(s, 10) <= labelRoom) || "";
      put(b.id, { x: spine, y: y + 14, summary: said, summaryX: 16 + textWidth(b.id, 11) + 8 });
    } else {
      put("", { x: spine, y: y + 14, title: "unattached" });
    }
    const left = x + INDENT + 10, right = x + w - 6;
    // Hosts beside the switch: cells in rows, each stub dropping from a channel above the row.
    let hx = left;
    for (const id of b.hosts) {
      const cell = 34 + textWidth(id, 11);
      if (hx > left && hx + cell > right) { hx = left; cy += HOST_ROW; }
      put(id, { x: hx + 12, y: cy + 17, channel: cy + 3, from: b.id });
      hx += cell + 8;
    }
    if (b.hosts.length) cy += HOST_ROW;
    // Devices as tiles, as many to a row as fit.
    const labels = shortLabels(b.devices);
    const pitch = Math.min(80, Math.max(24, 8 + Math.max(0, ...labels.map((l) => textWidth(l, 9)))));
    const fits = Math.max(1, Math.floor((right - left) / pitch));
    const perRow = Math.ceil(b.devices.length / Math.ceil(b.devices.length / fits)) || 1;  // rows as even as can be
    b.devices.forEach((d, i) => {
      const row = Math.floor(i / perRow), column = i % perRow, top = cy + row * TILE_ROW;
      put(d.id, { x: left + column * pitch + pitch / 2, y: top + 14, channel: top + 3, from: b.id,
        label: fit(labels[i], 9, pitch - 4) });
    });
    cy += Math.ceil(b.devices.length / perRow) * TILE_ROW;
    for (const child of b.children) {
      cy += place(child, x + INDENT, cy, w - INDENT, block);
      at.get(child.id).from = b.id;
    }
    return cy - y + 4;
  };

  // The OCS band, centred: an OCS with nothing under it takes only its label's room.
  const top = MARGIN;
  let rows = [[]], rowWidth = 0;
  for (const b of band) {
    const w = b.hosts.length || b.devices.length ? width : 44 + textWidth(b.id, 11);
    if (rows[rows.length - 1].length && rowWidth + w > room - 2 * MARGIN) { rows.push([]); rowWidth = 0; }
    rows[rows.length - 1].push([b, w]);
    rowWidth += w + GAP;
  }
  let y = top;
  for (const row of rows) {
    const used = row.reduce((sum, [, w]) => sum + w + GAP, -GAP);
    let x = Math.max(MARGIN, (room - used) / 2), tallest = 0;
    for (const [b, w] of row) {
      tallest = Math.max(tallest, place(b, x, y, w, "band"));
      x += w + GAP;
    }
    if (row.length) y += tallest + 6;
  }
  state.bus = y + 4;
  const lanes = Math.min(band.length, 4);
  const start = state.bus + 3 * lanes + 10;

  // The blocks, each into the column that is shortest so far.
  const heights = new Array(columns).fill(0);
  tops.forEach((b, i) => {
    const column = heights.indexOf(Math.min(...heights));
    const x = MARGIN + column * (width + GAP), by = start + heights[column];
    const h = place(b, x, by, width, i);
    state.blocks.push({ x, y: by, width, height: h });
    heights[column] += h + GAP;
    bottom = Math.max(bottom, by + h);
  });
  state.lane = new Map(band.map((b, i) => [b.id, (i % 4) * 3]));
  state.size = { width: room, height: Math.max(bottom, state.bus) + MARGIN };
}

// A link's route, as the points of a polyline: down the parent's spine inside a box, by the
// gutters and the bus between blocks, straight otherwise.
function route(a, b) {
  const at = state.layout, p = at.get(a), q = at.get(b);
  if (!p || !q) return null;
  if (p.block === q.block) {
    const [up, down] = q.from === a ? [p, q] : p.from === b ? [q, p] : [null, null];
    if (!up) return [[p.x, p.y], [q.x, q.y]];
    const channel = down.channel ?? down.y;
    return [[up.x, up.y], [up.x, channel], [down.x, channel], [down.x, down.y]];
  }
  const lane = state.lane.get(a) ?? state.lane.get(b) ?? 0, bus = state.bus + lane;
  const toBus = (n) => {
    if (n.block === "band") return [[n.x, n.y], [n.x, bus]];
    const gutter = state.blocks[n.block].x - 14 + lane;
    return [[n.x, n.y], [gutter, n.y], [gutter, bus]];
  };
  return [...toBus(p), ...toBus(q).reverse()];
}
const points = (route) => route.map(([x, y]) => `${Math.round(x)},${Math.round(y)}`).join(" ");

// Each part on its own: one that cannot draw (said in the banner) does not stop the others.
const render = (() => {
  const parts = [renderGraph, renderCompositions, renderFaults, drawUtilization].map(
    (part) => guarded(part, `drawing (${part.name})`));
  return function render() { parts.forEach((part) => part()); };
})();

// A node's health and drain as of the freshest source: its KV value, else the topology.
function marks(node) {
  const value = state.values.get(`${state.domain}.${node.kind === "host" ? "host" : "device"}.${node.id}`);
  return value && (node.kind === "host" || node.kind === "device") ? value : node;
}

function renderGraph() {
  const svg = $("fabric");
  const topology = state.topology;
  $("empty").hidden = Boolean(topology && topology.nodes.length);
  if (!topology) return svg.replaceChildren();
  const at = state.layout;
  svg.setAttribute("width", state.size.width);
  svg.setAttribute("height", state.size.height);
  const blocks = el("g", { class: "blocks" });
  for (const b of state.blocks) {
    blocks.append(el("rect", { x: b.x, y: b.y, width: b.width, height: b.height, rx: 4, class: "block" }));
  }
  const unattached = at.get("");
  if (unattached) blocks.append(el("text", { x: unattached.x - 4, y: unattached.y + 4, class: "block-title" }, unattached.title));
  const links = el("g", { class: "links" }), held = el("g", { class: "paths" }), nodes = el("g");
  // Faulty links are drawn over the held paths, which run along the same spines: a fault is
  // never hidden under a tenant's colour.
  const faulty = el("g", { class: "faulty-links" });
  for (const link of topology.links) {
    const way = route(link.a, link.b);
    if (!way) continue;
    const line = el("polyline", { points: points(way), "data-link": link.id,
      class: `link health-${link.drained ? "drained" : link.health}` });
    line.append(el("title", {}, `${link.id}: ${link.a} - ${link.b}, ${link.free_gbps} of ${link.capacity_gbps} Gb/s free, ${link.health}`));
    (link.health === "healthy" || link.drained ? links : faulty).append(line);
  }
  const holder = new Map(); // device id -> tenant colour
  for (const [id, composition] of entries("composition")) {
    const colour = tenantColour(composition.tenant);
    for (const device of composition.devices) {
      holder.set(device.id, colour);
      for (let i = 1; i < device.path.length; i++) {
        const way = route(device.path[i - 1], device.path[i]);
        if (!way) continue;
        held.append(el("polyline", { points: points(way), stroke: colour, class: "held", "data-composition": id }));
      }
    }
  }
  for (const node of topology.nodes) {
    const p = at.get(node.id);
    if (!p) continue;
    const m = marks(node);
    const g = el("g", { class: `node kind-${node.kind} health-${m.health}${m.drained ? " drained" : ""}${node.id === state.selected ? " selected" : ""}`,
      "data-id": node.id, "data-health": m.health, transform: `translate(${p.x},${p.y})` });
    if (node.kind === "host") g.append(el("rect", { x: -12, y: -8, width: 24, height: 16, rx: 3 }));
    else if (node.kind === "device") g.append(el("circle", { r: 8 }));
    else g.append(el("polygon", { points: node.kind === "ocs" ? "0,-11 11,0 0,11 -11,0" : "-9,-8 10,-8 10,8 -9,8 -12,0" }));
    const colour = holder.get(node.id);
    if (colour && m.health !== "failed") g.firstChild.setAttribute("style", `fill: ${colour}`);
    if (node.kind === "device") g.append(el("text", { y: 19, class: "tile" }, p.label ?? node.id));
    else g.append(el("text", { x: 16, y: 4 }, node.id));
    if (p.summary) g.append(el("text", { x: p.summaryX, y: 4, class: "model" }, p.summary));
    const model = node.model ? ` ${node.model}` : "";
    g.append(el("title", {}, `${node.id}: ${node.kind}${node.device_kind ? " " + node.device_kind : ""}${model}, ${m.health}${m.drained ? ", drained" : ""}${node.detail ? " (" + node.detail + ")" : ""}`));
    g.addEventListener("click", () => why(node.id));
    nodes.append(g);
  }
  svg.replaceChildren(blocks, links, held, faulty, nodes);
}

function renderCompositions() {
  const items = entries("composition").map(([id, c]) => {
    const li = el("li", { class: `composition state-${c.state}`, "data-id": id, "data-tenant": c.tenant });
    li.append(el("span", { class: "swatch", style: `background: ${tenantColour(c.tenant)}` }));
    const devices = c.devices.map((d) => d.capacity_gib ? `${d.id} (${d.capacity_gib} GiB)` : d.id).join(", ");
    li.append(document.createTextNode(`${id} · ${c.tenant} · ${c.host}: ${devices} · ${c.state}`));
    if (c.impaired_by.length) li.append(document.createTextNode(` by ${c.impaired_by.join(", ")}`));
    li.addEventListener("click", () => why(id));
    return li;
  });
  $("compositions").replaceChildren(...(items.length ? items : [el("li", { class: "note" }, "none")]));
}

function renderFaults() {
  const bad = [];
  for (const node of state.topology?.nodes || []) {
    const m = marks(node);
    if (m.health !== "healthy") bad.push([node.id, m.health, node.detail]);
  }
  for (const link of state.topology?.links || []) {
    if (link.health !== "healthy") bad.push([link.id, link.health, link.detail]);
  }
  $("faults").replaceChildren(...(bad.length
    ? bad.map(([id, health, detail]) => el("li", { "data-id": id }, `${id}: ${health}${detail ? " — " + detail : ""}`))
    : [el("li", { class: "note" }, "none")]));
}

// The domain's recent events, as the server kept them and the feed added since.
function showEvents() {
  $("feed").replaceChildren();
  (state.events[state.domain] || []).forEach(showEvent);
}

function showEvent(event) {
  const feed = $("feed");
  const time = event.recorded_at.slice(11, 19);
  feed.prepend(el("li", { class: BAD_EVENTS.has(event.type) ? "bad" : "" }, `${time} #${event.position} ${event.type} by ${event.actor}`));
  while (feed.children.length > FEED_KEPT) feed.lastChild.remove();
}

// ---- why ----

async function why(id) {
  state.selected = id;
  later(renderGraph, 0);
  const panel = $("why");
  panel.replaceChildren(el("span", { class: "note" }, `asking why ${id}…`));
  const reply = await ask("why", { id }).catch((e) => ({ ok: false, error: { message: String(e) } }));
  if (state.selected !== id) return;
  if (!reply.ok) {
    panel.replaceChildren(el("p", { class: "error" }, `${id}: ${reply.error.message}`));
    return;
  }
  const chain = el("ol");
  for (const link of reply.result.chain) {
    chain.append(el("li", {}, `#${link.position} ${link.type} by ${link.actor} (${link.request_id})`));
  }
  panel.replaceChildren(el("p", { class: "text", "data-id": id }, reply.result.text), chain);
}

// ---- utilization ----

function drawUtilization() {
  const canvas = $("utilization"), g = canvas.getContext("2d");
  const samples = state.utilization[state.domain] || [];
  const w = canvas.width, h = canvas.height, pad = 20;
  g.clearRect(0, 0, w, h);
  g.strokeStyle = "#dde";
  g.strokeRect(pad, 4, w - pad - 4, h - pad - 4);
  g.fillStyle = "#667";
  g.font = "10px system-ui";
  g.fillText("100%", 0, 12);
  g.fillText("0", 8, h - pad);
  if (!samples.length) return;
  const now = Date.now() / 1000, start = Math.min(samples[0][0], now - 60);
  const x = (t) => pad + ((t - start) / Math.max(1, now - start)) * (w - pad - 4);
  const y = (f) => h - pad - f * (h - pad - 8);
  g.fillText(`${Math.round(now - start)} s`, pad, h - 6);
  const line = (colour, fraction) => {
    g.strokeStyle = colour;
    g.lineWidth = 2;
    g.beginPath();
    samples.forEach((s, i) => {
      const value = fraction(s);
      if (i) g.lineTo(x(s[0]), y(fraction(samples[i - 1])));  // a step: held until it changes
      g[i ? "lineTo" : "moveTo"](x(s[0]), y(value));
    });
    g.lineTo(x(now), y(fraction(samples[samples.length - 1])));
    g.stroke();
  };
  line("#2b6cd4", (s) => (s[2] ? s[1] / s[2] : 0));
  line("#2a9d6f", (s) => (s[4] ? s[3] / s[4] : 0));
  const last = samples[samples.length - 1];
  canvas.dataset.gpusHeld = last[1];
  canvas.dataset.memoryUsedGib = last[3];
}

$("domain").addEventListener("change", (e) => {
  state.domain = e.target.value;
  history.replaceState(null, "", `?domain=${encodeURIComponent(state.domain)}`);
  showEvents();
  refreshTopology();
});
// The number of block columns follows the page's width.
const relayout = guarded(function relayout() { layOut(); render(); }, "drawing (relayout)");
window.addEventListener("resize", () => later(relayout, 150));
setInterval(drawUtilization, 5000);
connect();
