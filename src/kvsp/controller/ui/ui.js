// The live cluster page: GET ui/state every second, drawn as tables. The operator's token
// comes in the page's fragment (#token=...), which the browser never sends to a server; it is
// sent only as the bearer token of the state request.
"use strict";

const token = new URLSearchParams(location.hash.slice(1)).get("token");
const headers = token ? { authorization: "Bearer " + token } : {};

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function share(value) {
  if (value === null || value === undefined) return "-";
  return (100 * value).toFixed(1) + "%";
}

function usage(value) {
  const td = cell("");
  const bar = document.createElement("span");
  bar.className = "bar";
  bar.style.width = Math.round(60 * (value || 0)) + "px";
  td.append(bar, share(value));
  return td;
}

function fill(id, rows, draw) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows.map(draw));
}

function drawInstance(i) {
  const tr = document.createElement("tr");
  tr.className = "instance state-" + i.state;
  tr.dataset.instance = i.instance;
  tr.dataset.state = i.state;
  const cost = i.last_placement ? i.last_placement.cost_us.toFixed(0) + " µs" : "-";
  tr.append(cell(i.instance), cell(i.state, "state"), cell(i.epoch), usage(i.kv_utilization),
            usage(i.g2_utilization), cell(i.running), cell(i.queued), cell(cost));
  return tr;
}

function drawSession(s) {
  const tr = document.createElement("tr");
  tr.className = "session";
  tr.dataset.session = s.session;
  tr.append(cell(s.session), cell(s.instance), cell(s.epoch), cell(s.output_offset),
            cell(s.failovers), cell(s.turn_done ? "yes" : "no"));
  return tr;
}

function drawPlacement(p, now) {
  const tr = document.createElement("tr");
  tr.className = "placement";
  const candidates = cell("");
  for (const c of p.candidates) {
    const line = document.createElement("div");
    if (c.instance === p.instance) line.className = "chosen";
    const recompute = c.uses_cache ? c.recompute_unmatched_us : c.recompute_all_us;
    line.textContent = c.instance + ": " + c.cost_us.toFixed(0) + " = " + c.wait_us.toFixed(0) +
      " + " + c.fetch_us.toFixed(0) + " + " + recompute.toFixed(0) +
      " (" + c.reused_tokens + " tokens reused)";
    candidates.append(line);
  }
  // the controller's clock is its own: show how long ago, on that clock
  const ago = ((now - p.at_ms) / 1000).toFixed(1) + " s ago";
  tr.append(cell(ago), cell(p.tenant), cell(p.outcome),
            cell(p.blocks), cell(p.matched_blocks), cell(p.reused_blocks), candidates);
  return tr;
}

function drawRate([tenant, r]) {
  const tr = document.createElement("tr");
  tr.dataset.tenant = tenant;
  tr.append(cell(tenant), cell(r.blocks), cell(r.reused), cell(share(r.hit_rate)));
  return tr;
}

function drawHint(h) {
  const tr = document.createElement("tr");
  tr.append(cell(h.action), cell(h.outcome), cell(h.count));
  return tr;
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const answer = await fetch("state", { headers, cache: "no-store" });
    const doc = await answer.json();
    if (!answer.ok) throw new Error(doc.detail || answer.status);
    fill("instances", doc.instances, drawInstance);
    fill("sessions", doc.sessions, drawSession);
    fill("placements", doc.placements, (p) => drawPlacement(p, doc.at_ms));
    fill("hit-rates", Object.entries(doc.hit_rates), drawRate);
    fill("hints", doc.hints, drawHint);
    status.textContent = doc.controller + ", updated " + new Date().toLocaleTimeString();
    status.className = "status";
  } catch (error) {
    status.textContent = "no answer: " + error.message;
    status.className = "status error";
  }
}

refresh();
setInterval(refresh, 1000);
