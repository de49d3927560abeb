// The fleet page: reads /fleet/ui/api/status every second and shows it. Plain DOM
// code, no library, no inline script (the CSP forbids it); everything from the
// server is set with textContent, never parsed as HTML.
"use strict";

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return e;
}

function secs(v) { return typeof v === "number" ? v.toFixed(2) + " s" : "-"; }
function bytes(v) {
  if (typeof v !== "number") return "-";
  return v < 1024 ? v + " B" : v < 1048576 ? (v / 1024).toFixed(1) + " KiB"
    : (v / 1048576).toFixed(1) + " MiB";
}

function table(cls, heads, rows) {
  return el("table", { class: cls },
    el("thead", {}, el("tr", {}, ...heads.map(h => el("th", {}, h)))),
    el("tbody", {}, ...rows));
}

function membersTable(members) {
  const rows = Object.entries(members).map(([name, m]) => el("tr", { "data-member": name },
    el("td", { class: "mono" }, name), el("td", { class: "mono" }, m.addr || "-"),
    el("td", {}, secs(m.heartbeat_age) + " ago"),
    el("td", {}, m.leaving ? "leaving" : (m.heartbeat_age > 3 ? "silent" : "live"))));
  return table("members", ["member", "address", "heartbeat", "state"], rows);
}

function storesTable(stores) {
  const rows = Object.entries(stores).map(([name, s]) => el("tr", { "data-store": name },
    el("td", { class: "mono" }, name), el("td", { class: "mono owner" }, s.owner || "-"),
    el("td", { class: "state" }, s.state), el("td", { class: "epoch" }, s.epoch ?? "-"),
    el("td", {}, secs(s.lease_age)), el("td", {}, s.sync || "-"), el("td", {}, secs(s.lag)),
    el("td", {}, bytes(s.unshipped_bytes)), el("td", { class: "muted" }, s.loss_window || "")));
  return table("stores", ["store", "owner", "state", "epoch", "lease age", "sync",
                          "lag to bucket", "unshipped", "loss window"], rows);
}

let last = null;

function noteChanges(stores) {
  const feed = document.getElementById("feed");
  for (const [name, s] of Object.entries(stores)) {
    const was = last && last[name];
    if (was && (was.owner !== s.owner || was.epoch !== s.epoch || was.state !== s.state)) {
      feed.prepend(el("li", { "data-store": name },
        el("span", { class: "tag publish" }, name), " ",
        `${was.owner || "-"} → ${s.owner || "-"} (${s.state}, epoch ${s.epoch ?? "-"})`, " ",
        el("span", { class: "muted" }, new Date().toLocaleTimeString())));
    }
  }
  last = stores;
}

async function refresh() {
  const live = document.getElementById("live");
  try {
    const r = await fetch("/fleet/ui/api/status", { credentials: "same-origin" });
    const body = await r.json().catch(() => ({ message: r.statusText }));
    if (!r.ok) {
      live.className = "live off";
      document.getElementById("main").replaceChildren(el("h1", {}, "strata fleet"),
        el("p", { class: "error", id: "refused" }, body.message || r.statusText));
      return r.status !== 403;  // a refusal will not change by asking again
    }
    live.className = "live on";
    document.getElementById("served-by").textContent = "served by " + body.served_by;
    document.getElementById("main").replaceChildren(
      el("h1", {}, "members"), membersTable(body.members),
      el("h1", {}, "stores"), storesTable(body.stores));
    noteChanges(body.stores);
  } catch (e) {
    live.className = "live off";
  }
  return true;
}

async function loop() {
  if (await refresh()) setTimeout(loop, 1000);
}

loop();
