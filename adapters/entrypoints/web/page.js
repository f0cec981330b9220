// The live fabric page (adapters/entrypoints/fabric_page.py serves it and its data).
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
const COLUMN = 190, ROW = 34, MARGIN = 24;

const state = {
  values: new Map(),   // KV key -> value (adapters/nats/kv_state.py)
  utilization: {},     // domain -> [[t, gpus held, gpus, memory used GiB, memory GiB], ...]
  domain: new URLSearchParams(location.search).get("domain") || "",
  topology: null,      // the topology query's result for state.domain
  layout: new Map(),   // node id -> {x, y}
  selected: "",
};
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text = "") {
  const node = tag in SVG_TAGS ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}
const SVG_TAGS = { svg: 1, g: 1, line: 1, rect: 1, circle: 1, polygon: 1, text: 1, title: 1 };

// A tenant's colour: a hue from its name, the same on every page load, never near the red
// and orange of faults.
function tenantColour(tenant) {
  let hash = 0;
  for (const c of tenant) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${60 + (hash % 260)}, 60%, 42%)`;
}

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
  source.addEventListener("open", () => setStatus("live"));
  source.addEventListener("error", () => setStatus("connecting"));
  source.addEventListener("snapshot", (e) => {
    const snapshot = JSON.parse(e.data);
    state.values = new Map(Object.entries(snapshot.values));
    state.utilization = snapshot.utilization;
    domainsChanged();
    refreshTopology();
  });
  source.addEventListener("kv", (e) => {
    const { key, value } = JSON.parse(e.data);
    if (value === null || ["released", "failed"].includes(value.state)) state.values.delete(key);
    else state.values.set(key, value);
    if (!key.startsWith(`${state.domain}.`)) domainsChanged();
    later(render);
  });
  source.addEventListener("feed", (e) => {
    const event = JSON.parse(e.data);
    if (event.domain !== state.domain) return;
    showEvent(event);
    if (TOPOLOGY_EVENTS.has(event.type)) later(refreshTopology, 200);
  });
  source.addEventListener("utilization", (e) => {
    const { domain, sample } = JSON.parse(e.data);
    (state.utilization[domain] ||= []).push(sample);
    if (state.utilization[domain].length > 900) state.utilization[domain].shift();
    if (domain === state.domain) drawUtilization();
  });
}

function setStatus(text) {
  $("status").textContent = text;
  $("status").dataset.state = text;
}

// Runs `work` once, `ms` from the first of a burst of calls.
const pending = new Map();
function later(work, ms = 50) {
  if (pending.has(work)) return;
  pending.set(work, setTimeout(() => { pending.delete(work); work(); }, ms));
}

function domainsChanged() {
  const domains = [...new Set([...state.values.keys()].map((k) => k.split(".")[0]))].sort();
  if (!state.domain && domains.length) {
    state.domain = domains[0];
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
  return response.json();
}

async function refreshTopology() {
  if (!state.domain) return render();
  const domain = state.domain;
  const reply = await ask("topology");
  if (domain !== state.domain) return;  // another domain was picked meanwhile; its own ask draws
  state.topology = reply.ok ? reply.result : null;
  layOut();
  render();
}

// ---- the graph ----

// Columns: hosts first, then switches and OCS by their distance in links from the nearest
// host, then every device in one column, beside the switch it hangs off.
function layOut() {
  state.layout = new Map();
  const topology = state.topology;
  if (!topology) return;
  const kind = new Map(topology.nodes.map((n) => [n.id, n.kind]));
  const near = new Map(topology.nodes.map((n) => [n.id, []]));
  for (const link of topology.links) {
    near.get(link.a)?.push(link.b);
    near.get(link.b)?.push(link.a);
  }
  const layer = new Map();
  let frontier = topology.nodes.filter((n) => n.kind === "host").map((n) => n.id);
  frontier.forEach((id) => layer.set(id, 0));
  for (let depth = 1; frontier.length; depth++) {
    const next = [];
    for (const id of frontier) {
      if (kind.get(id) === "device") continue;
      for (const other of near.get(id)) {
        if (layer.has(other) || kind.get(other) === "device" || kind.get(other) === "host") continue;
        layer.set(other, depth);
        next.push(other);
      }
    }
    frontier = next;
  }
  const fabricLayers = Math.max(0, ...[...layer.values()]);
  const columns = [];
  const place = (id, column) => (columns[column] ||= []).push(id);
  for (const node of topology.nodes) {
    if (node.kind === "device") continue;
    place(node.id, layer.has(node.id) ? layer.get(node.id) : fabricLayers + 1);
  }
  columns.forEach((ids) => ids.sort());
  const rowOf = new Map();
  columns.forEach((ids) => ids.forEach((id, row) => rowOf.set(id, row)));
  const parent = (id) => (near.get(id) || []).filter((o) => kind.get(o) !== "device").sort()[0] || "";
  const devices = topology.nodes.filter((n) => n.kind === "device").map((n) => n.id);
  const deviceColumn = Math.max(columns.length, fabricLayers + 1);
  devices.sort((a, b) => {
    const pa = parent(a), pb = parent(b);
    const ra = (layer.get(pa) ?? 99) * 1000 + (rowOf.get(pa) ?? 0);
    const rb = (layer.get(pb) ?? 99) * 1000 + (rowOf.get(pb) ?? 0);
    return ra - rb || (a < b ? -1 : 1);
  });
  columns[deviceColumn] = devices;
  const tallest = Math.max(...columns.filter(Boolean).map((ids) => ids.length));
  columns.forEach((ids, column) => {
    if (!ids) return;
    const offset = ((tallest - ids.length) * ROW) / 2;
    ids.forEach((id, row) => state.layout.set(id, { x: MARGIN + 40 + column * COLUMN, y: MARGIN + offset + row * ROW }));
  });
}

function render() {
  renderGraph();
  renderCompositions();
  renderFaults();
  drawUtilization();
}

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
  let width = 0, height = 0;
  for (const { x, y } of at.values()) { width = Math.max(width, x); height = Math.max(height, y); }
  svg.setAttribute("width", width + COLUMN);
  svg.setAttribute("height", height + MARGIN * 2);
  const links = el("g", { class: "links" }), held = el("g", { class: "paths" }), nodes = el("g");
  const linkBetween = new Map();
  for (const link of topology.links) {
    const a = at.get(link.a), b = at.get(link.b);
    if (!a || !b) continue;
    const line = el("line", { x1: a.x, y1: a.y, x2: b.x, y2: b.y, "data-link": link.id,
      class: `link health-${link.drained ? "drained" : link.health}` });
    line.append(el("title", {}, `${link.id}: ${link.a} - ${link.b}, ${link.free_gbps} of ${link.capacity_gbps} Gb/s free, ${link.health}`));
    links.append(line);
    linkBetween.set([link.a, link.b].sort().join(" "), link);
  }
  const holder = new Map(); // device id -> tenant colour
  for (const [id, composition] of entries("composition")) {
    const colour = tenantColour(composition.tenant);
    for (const device of composition.devices) {
      holder.set(device.id, colour);
      for (let i = 1; i < device.path.length; i++) {
        const a = at.get(device.path[i - 1]), b = at.get(device.path[i]);
        if (!a || !b) continue;
        held.append(el("line", { x1: a.x, y1: a.y, x2: b.x, y2: b.y, stroke: colour,
          class: "held", "data-composition": id }));
      }
    }
  }
  for (const node of topology.nodes) {
    const p = at.get(node.id);
    if (!p) continue;
    const m = marks(node);
    const g = el("g", { class: `node kind-${node.kind} health-${m.health}${m.drained ? " drained" : ""}${node.id === state.selected ? " selected" : ""}`,
      "data-id": node.id, "data-health": m.health, transform: `translate(${p.x},${p.y})` });
    if (node.kind === "host") g.append(el("rect", { x: -14, y: -10, width: 28, height: 20, rx: 3 }));
    else if (node.kind === "device") g.append(el("circle", { r: 10 }));
    else g.append(el("polygon", { points: node.kind === "ocs" ? "0,-13 13,0 0,13 -13,0" : "-12,-10 12,-10 12,10 -12,10 -16,0" }));
    const colour = holder.get(node.id);
    if (colour && m.health !== "failed") g.firstChild.setAttribute("style", `fill: ${colour}`);
    const label = node.kind === "device" ? [node.id, node.model || node.device_kind] : [node.id];
    g.append(el("text", { x: 18, y: label.length > 1 ? -1 : 4 }, label[0]));
    if (label[1]) g.append(el("text", { x: 18, y: 11, class: "model" }, label[1]));
    g.append(el("title", {}, `${node.id}: ${node.kind}${node.device_kind ? " " + node.device_kind : ""}, ${m.health}${m.drained ? ", drained" : ""}${node.detail ? " (" + node.detail + ")" : ""}`));
    g.addEventListener("click", () => why(node.id));
    nodes.append(g);
  }
  svg.replaceChildren(links, held, nodes);
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
  $("feed").replaceChildren();
  refreshTopology();
});
setInterval(drawUtilization, 5000);
connect();
