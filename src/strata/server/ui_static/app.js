// The strata web view: plain DOM code, no library, no inline script (the page's CSP
// forbids it). Everything from the server, names and file contents alike, is shown
// with textContent, never parsed as HTML.
"use strict";

// -- URL and query ------------------------------------------------------------------
// Paths stay in the percent-encoded form the server sent (`q`): a name that is not
// UTF-8 keeps its raw bytes that way, and the script never needs to decode one.
function params() {
  const out = {};
  for (const part of location.search.slice(1).split("&")) {
    if (!part) continue;
    const i = part.indexOf("=");
    const k = decodeURIComponent(i < 0 ? part : part.slice(0, i));
    const v = i < 0 ? "" : part.slice(i + 1);
    out[k] = k === "p" || k === "after" ? v : decodeURIComponent(v.replace(/\+/g, " "));
  }
  return out;
}

function query(args) {
  const parts = [];
  for (const [k, v] of Object.entries(args)) {
    if (v === undefined || v === null) continue;
    parts.push(k + "=" + (k === "p" || k === "after" ? v : encodeURIComponent(v)));
  }
  return parts.join("&");
}

function link(args) { return "/ui/?" + query(args); }

async function getJSON(path, args) {
  const r = await fetch(path + "?" + query(args), { credentials: "same-origin" });
  const body = await r.json().catch(() => ({ message: r.statusText }));
  if (!r.ok) throw new Error(body.message || r.statusText);
  return body;
}

// -- DOM helpers ---------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "href") e.setAttribute("href", v);
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return e;
}

const main = () => document.getElementById("main");
function show(...nodes) { main().replaceChildren(...nodes); }
function short(id) { return id ? id.slice(0, 12) : "-"; }
function when(t) { return new Date(t * 1000).toLocaleString(); }
function age(t) {
  if (!t) return "-";  // the empty snapshot every volume starts from
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 60) return Math.round(s) + "s ago";
  if (s < 3600) return Math.round(s / 60) + "m ago";
  if (s < 86400) return Math.round(s / 3600) + "h ago";
  return Math.round(s / 86400) + "d ago";
}
function counts(e) {
  return el("span", { class: "counts mono" },
    el("span", { class: "a" }, "+" + (e.added || 0)), " ",
    el("span", { class: "d" }, "-" + (e.deleted || 0)), " ",
    el("span", { class: "m" }, "M" + (e.modified || 0)), e.truncated ? "…" : "");
}
function crumbs(...items) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren();
  items.forEach((it, i) => {
    if (i) nav.append(el("span", { class: "sep" }, "/"));
    nav.append(it.href ? el("a", { href: it.href }, it.text) : el("span", {}, it.text));
  });
}
function fail(err) { show(el("p", { class: "error" }, String(err.message || err))); }

// -- views ---------------------------------------------------------------------------
const P = params();
let onEvent = () => {};

async function home() {
  crumbs({ text: "volumes" });
  const data = await getJSON("/ui/api/volumes", {});
  const out = [el("h1", {}, "Volumes and branches")];
  for (const vol of data.volumes) {
    const rows = vol.branches.map((b) => el("tr", { "data-branch": b.name },
      el("td", {}, el("a", { href: link(b.rejected ? { view: "rejected", v: vol.name, b: b.name }
                                                   : { view: "log", v: vol.name, b: b.name }) },
                     b.name), b.rejected ? el("span", { class: "tag rejected" }, " rejected") : null),
      el("td", { class: "mono" }, el("a", { href: link({ view: "tree", v: vol.name, s: b.head }) },
                                    short(b.head))),
      el("td", { title: when(b.time) }, age(b.time)),
      el("td", {}, b.message)));
    out.push(el("h2", {}, vol.name,
               vol.image ? el("span", { class: "tag image", title: vol.image.ref },
                              " image (" + vol.image.source + ")") : null),
      el("table", { class: "branches" },
        el("thead", {}, el("tr", {}, el("th", {}, vol.image ? "tag" : "branch"),
                           el("th", {}, "head"),
                           el("th", {}, "age"), el("th", {}, "last message"))),
        el("tbody", {}, ...rows)));
  }
  show(...out);
  onEvent = (ev) => { if (ev.type !== "hello" || ev.resync) home().catch(fail); };
}

function logItem(v, e, fresh) {
  return el("li", { class: fresh ? "new" : "", "data-id": e.id },
    el("div", {},
      el("a", { class: "mono", href: link({ view: "tree", v, s: e.id }) }, short(e.id)), "  ",
      counts(e), "  ", el("span", { class: "muted", title: when(e.time) }, age(e.time))),
    el("div", {}, e.message || el("span", { class: "muted" }, "(no message)")),
    e.parent ? el("div", {}, el("a", { href: link({ view: "diff", v, a: e.parent, b: e.id }) },
                                "changes")) : null);
}

async function log() {
  const v = P.v, b = P.b || "live";
  crumbs({ text: "volumes", href: "/ui/" }, { text: v }, { text: b });
  const list = el("ol", { class: "timeline", id: "timeline" });
  const more = el("button", { id: "more" }, "older");
  let next = null;
  async function page(after) {
    const data = await getJSON("/ui/api/log", { v, b, after, limit: 50 });
    for (const e of data.entries) list.append(logItem(v, e, false));
    if (data.older_expired) {
      list.append(el("li", { class: "muted", id: "expired" },
                     "older history expired (retention policy)"));
    }
    next = data.next;
    more.hidden = !next;
  }
  more.addEventListener("click", () => page(next).catch(fail));
  show(el("h1", {}, "History of " + v + "@" + b), list, more);
  await page(undefined);
  onEvent = (ev) => {
    if (ev.type === "publish" && ev.volume === v && ev.branch === b &&
        !list.querySelector('[data-id="' + ev.snapshot + '"]')) {
      list.prepend(logItem(v, { id: ev.snapshot, parent: ev.parent, time: ev.snapshot_time,
                                message: ev.message, added: ev.added, deleted: ev.deleted,
                                modified: ev.modified, truncated: ev.truncated }, true));
    } else if (ev.type === "step" && ev.volume === v && ev.branch === b) {
      const why = ev.timed_out ? "timed out" : ev.oom ? "out of memory" : "exit " + ev.status;
      list.prepend(el("li", { class: "new failed", "data-run": ev.run },
        el("div", {}, el("span", { class: "mono" }, "run " + ev.run), "  ",
           el("strong", {}, "failed: " + why), "  ",
           el("span", { class: "muted", title: when(ev.time) }, age(ev.time))),
        el("div", { class: "muted" }, (ev.argv || []).join(" ") + " (nothing published)")));
    } else if (ev.type === "hello" && ev.resync) {
      log().catch(fail);
    }
  };
}

function pathCrumbs(v, s, p, isDir) {
  const items = [{ text: "volumes", href: "/ui/" }, { text: v },
                 { text: short(s), href: link({ view: "tree", v, s }) }];
  const segs = p ? p.split("/") : [];
  segs.forEach((seg, i) => {
    const sub = segs.slice(0, i + 1).join("/");
    const last = i === segs.length - 1;
    let text;
    try { text = decodeURIComponent(seg); } catch (_) { text = seg; }
    items.push(last && !isDir ? { text } : { text, href: link({ view: "tree", v, s, p: sub }) });
  });
  crumbs(...items);
}

async function tree() {
  const v = P.v, s = P.s, p = P.p || "";
  pathCrumbs(v, s, p, true);
  const body = el("tbody", {});
  const more = el("button", { id: "more" }, "more");
  const head = el("p", { class: "muted" });
  let next = null;
  async function page(after) {
    const data = await getJSON("/ui/api/tree", { v, s, p, after, limit: 200 });
    if (!data.dir) { location.replace(link({ view: "file", v, s, p })); return; }
    head.textContent = data.count + " entries";
    for (const e of data.entries) {
      const target = e.type === "dir" ? { view: "tree", v, s, p: e.q } : { view: "file", v, s, p: e.q };
      body.append(el("tr", {},
        el("td", {}, el("a", { href: link(target) }, e.name + (e.type === "dir" ? "/" : ""))),
        el("td", { class: "mono" }, e.type), el("td", { class: "mono" }, e.size),
        el("td", {}, when(e.mtime))));
    }
    next = data.next;
    more.hidden = !next;
  }
  more.addEventListener("click", () => page(next).catch(fail));
  show(el("h1", {}, "/" + (p ? safeDecode(p) : "")), head,
       el("table", { id: "listing" }, el("thead", {}, el("tr", {}, el("th", {}, "name"),
         el("th", {}, "type"), el("th", {}, "size"), el("th", {}, "modified"))), body), more);
  await page(undefined);
}

function safeDecode(q) { try { return decodeURIComponent(q); } catch (_) { return q; } }

async function file() {
  const v = P.v, s = P.s, p = P.p || "";
  pathCrumbs(v, s, p, false);
  const f = await getJSON("/ui/api/file", { v, s, p });
  const meta = el("p", { class: "muted mono" }, f.type + ", " + f.size + " bytes, mode " + f.mode +
                  (f.blake3 ? ", blake3 " + f.blake3 : ""));
  const raw = el("a", { href: "/ui/raw?" + query({ v, s, p }) }, "download");
  let body;
  if (f.view === "text") {
    body = el("div", {}, el("pre", { class: "lines", id: "text" },
                            ...f.lines.map((l) => el("span", { class: "l" }, l))),
              f.truncated ? el("p", { class: "muted" }, "(truncated)") : null);
  } else if (f.view === "image") {
    body = el("img", { class: "view", id: "image", alt: f.name, src: "/ui/raw?" + query({ v, s, p }) });
  } else if (f.view === "sqlite") {
    body = sqliteView(f.tables);
  } else if (f.view === "symlink") {
    body = el("p", {}, "symlink to ", el("code", {}, f.target));
  } else if (f.view === "dir") {
    location.replace(link({ view: "tree", v, s, p })); return;
  } else {
    body = el("p", { id: "binary" }, "binary file: " + f.size + " bytes, blake3 ",
              el("code", {}, f.blake3 || "-"));
  }
  show(el("h1", {}, f.path), meta, el("p", {}, raw), body);
}

function sqliteView(t) {
  if (t.error) return el("p", { class: "error" }, t.error);
  const out = el("div", { id: "sqlite" });
  for (const tab of t.tables) {
    out.append(el("h2", {}, tab.name + (tab.count !== undefined ? " (" + tab.count + " rows)" : "")));
    if (tab.error) { out.append(el("p", { class: "error" }, tab.error)); continue; }
    out.append(el("table", { class: "sqlite" },
      el("thead", {}, el("tr", {}, ...tab.columns.map((c) => el("th", {}, c)))),
      el("tbody", {}, ...tab.rows.map((r) => el("tr", {}, ...r.map((c) => el("td", {}, c === null ? "NULL" : String(c))))))));
    if (tab.count > tab.rows.length) out.append(el("p", { class: "muted" }, "first " + tab.rows.length + " rows"));
  }
  return out;
}

async function diff() {
  const v = P.v, a = P.a, b = P.b;
  crumbs({ text: "volumes", href: "/ui/" }, { text: v }, { text: short(a) + " → " + short(b) });
  const body = el("tbody", {});
  const status = el("p", { class: "muted" }, "reading…");
  const detail = el("div", { id: "filediff" });
  show(el("h1", {}, "Changes " + short(a) + " → " + short(b)), status,
       el("table", { id: "diff" }, body), detail);
  if (P.p) fileDiff(v, a, b, P.p, detail).catch(fail);
  // The answer streams one JSON line per path: rows appear as the trees are walked.
  const r = await fetch("/ui/api/diff?" + query({ v, a, b }), { credentials: "same-origin" });
  if (!r.ok) { const e = await r.json().catch(() => ({})); throw new Error(e.message || r.statusText); }
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i); buf = buf.slice(i + 1);
      if (!line) continue;
      const d = JSON.parse(line);
      if (d.end) { status.textContent = d.total + " paths changed" + (d.truncated ? " (first 10000 shown)" : ""); continue; }
      const name = d.type === "file"
        ? el("a", { href: link({ view: "diff", v, a, b, p: d.q }) }, d.path) : d.path;
      body.append(el("tr", { class: "change-" + d.change },
        el("td", { class: "mono" }, d.change[0].toUpperCase()), el("td", { class: "mono" }, name),
        el("td", { class: "mono" }, d.type)));
    }
  }
}

async function fileDiff(v, a, b, p, into) {
  const d = await getJSON("/ui/api/filediff", { v, a, b, p });
  if (d.kind !== "text") {
    into.replaceChildren(el("h2", {}, d.path), el("p", {}, "binary: " + (d.old_size ?? "-") +
      " → " + (d.new_size ?? "-") + " bytes"));
    return;
  }
  const pre = el("pre", { class: "diff", id: "unified" }, ...d.diff.map((l) => el("span", {
    class: l.startsWith("@@") ? "hunk" : l.startsWith("+") && !l.startsWith("+++") ? "add"
      : l.startsWith("-") && !l.startsWith("---") ? "del" : "" }, l)));
  into.replaceChildren(el("h2", {}, d.path), pre);
}

async function rejected() {
  const v = P.v, b = P.b;
  crumbs({ text: "volumes", href: "/ui/" }, { text: v }, { text: b });
  const d = await getJSON("/ui/api/rejected", { v, b });
  const mine = el("div", {}, el("h2", {}, "refused change set"),
    el("p", {}, d.message), el("p", { class: "mono" }, "on ", d.base ? el("a", {
      href: link({ view: "tree", v, s: d.base }) }, short(d.base)) : "-", " ",
      d.base ? el("a", { href: link({ view: "diff", v, a: d.base, b: d.head }) }, "diff") : null),
    el("table", {}, el("tbody", {}, ...d.changes.map((c) => el("tr", { class: "change-" + c.change },
      el("td", { class: "mono" }, c.change[0].toUpperCase()), el("td", { class: "mono" }, c.path))))));
  const theirs = el("div", {}, el("h2", {}, "conflicted with"));
  if (!d.conflicts_with.length) theirs.append(el("p", { class: "muted" }, "no branch holds a conflicting change now"));
  for (const o of d.conflicts_with) {
    for (const s of o.snapshots) {
      theirs.append(el("div", {}, el("p", {}, el("span", { class: "tag" }, o.branch), " ",
        el("a", { class: "mono", href: link({ view: "diff", v, a: s.parent, b: s.id }) }, short(s.id)),
        " ", s.message), el("ul", {}, ...s.paths.map((x) => el("li", { class: "mono" }, x.path)))));
    }
  }
  show(el("h1", {}, "Rejected: " + b), el("div", { class: "grid2" }, mine, theirs));
}

// -- live updates ----------------------------------------------------------------------
function feedItem(ev) {
  const ref = ev.volume + "@" + ev.branch;
  const item = el("li", { class: "ev-" + ev.type },
    el("span", { class: "tag " + ev.type }, ev.type.replace("_", " ")), " ",
    ev.type === "publish" || ev.type === "fork"
      ? el("a", { href: link({ view: "log", v: ev.volume, b: ev.branch }) }, ref) : ref, " ",
    ev.snapshot ? el("span", { class: "mono" }, short(ev.snapshot)) : null, " ",
    ev.type === "publish" ? counts(ev) : null,
    ev.type === "conflict" ? el("div", { class: "mono" }, (ev.paths || []).join(", ")) : null,
    ev.message ? el("div", { class: "muted" }, ev.message) : null);
  return item;
}

function live() {
  const args = P.v ? { ref: P.v } : {};
  const es = new EventSource("/ui/events?" + query(args));
  const badge = document.getElementById("live");
  es.onopen = () => { badge.className = "live on"; };
  es.onerror = () => { badge.className = "live off"; };
  es.onmessage = (m) => {
    const ev = JSON.parse(m.data);
    if (ev.type !== "hello" && ev.type !== "resync") {
      document.getElementById("feed").prepend(feedItem(ev));
    }
    try { onEvent(ev); } catch (e) { console.error(e); }
  };
}

const VIEWS = { log, tree, file, diff, rejected };
document.addEventListener("DOMContentLoaded", () => {
  (VIEWS[P.view] || home)().catch(fail);
  live();
});
