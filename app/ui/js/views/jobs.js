// Job list: state / kind / exact-name / metadata filters, cursor paging, auto-refresh; columns for progress, the
// latest loss, chosen metadata keys and the run time; sorting; tick jobs to compare them. Columns the API sorts by
// (GET /v1/jobs?sort=) sort every page on the server, so paging follows the order; the others (progress, loss,
// metadata, run time) sort the page shown. Filters, columns, sort, the page and its size (?limit=, default 25) live
// in the URL.

import {api, KINDS, STATES} from "../api.js";
import {h, fill} from "../dom.js";
import {ago, num, runtime} from "../format.js";
import {go, setQuery} from "../router.js";
import {metaParams} from "./compare.js";
import {every, errorBox, stateBadge} from "./widgets.js";

const ACTIVE = "queued,starting,running,retrying,cancelling";
const PAGE = 25;
const LOSSES = ["lm_loss", "loss"];  // the "latest loss" column: the first of these a job reports
// Column -> the API's sort key (core.jobs.SORTS).
const SERVER_SORT = {name: "name", kind: "kind", state: "state", created: "created_at", host: "host", attempts: "attempt_count"};

/** "-created" -> "-created_at" for the API; "" for a sort done in the page (or none). */
export function serverSort(sort) {
  const key = SERVER_SORT[sort.replace(/^-/, "")];
  return key ? `${sort.startsWith("-") ? "-" : ""}${key}` : "";
}

/** Fraction done (0..1) or null: a train job's last step over train_iters, else its last progress event. */
export function progressOf(job, latest) {
  if (job.state === "succeeded") return 1;
  if (!latest) return null;
  if (job.kind === "train" && job.spec?.train_iters && latest.step !== null) return Math.min(1, latest.step / job.spec.train_iters);
  const p = latest.progress;
  return p && p.total ? Math.min(1, p.done / p.total) : null;
}

function seconds(job) {
  if (!job.started_at) return null;
  return ((job.finished_at ? new Date(job.finished_at) : new Date()) - new Date(job.started_at)) / 1000;
}

export function renderJobs(root, {query}) {
  const f = {
    state: query.get("state") || "", kind: query.get("kind") || "", name: query.get("name") || "", meta: query.get("meta") || "",
    cols: (query.get("cols") || "").split(",").map((c) => c.trim()).filter(Boolean), sort: query.get("sort") || "",
    after: query.get("after") || "", trail: query.get("trail") ? query.get("trail").split(",") : [],
    refresh: query.get("refresh") !== "off", limit: Math.min(200, Math.max(1, Number(query.get("limit")) || PAGE)),
  };
  const selected = new Set();
  let rows = [];  // [{job, latest}] of the page shown
  const stateSel = h("select", {id: "f-state", "aria-label": "State", onchange: () => update({state: stateSel.value})},
    h("option", {value: ""}, "all states"), h("option", {value: ACTIVE}, "active (not finished)"),
    STATES.map((s) => h("option", {value: s}, s)));
  stateSel.value = f.state;
  const kindSel = h("select", {id: "f-kind", "aria-label": "Kind", onchange: () => update({kind: kindSel.value})},
    h("option", {value: ""}, "all kinds"), KINDS.map((k) => h("option", {value: k}, k)));
  kindSel.value = f.kind;
  const nameIn = h("input", {id: "f-name", type: "search", placeholder: "exact job name", "aria-label": "Exact job name", value: f.name});
  nameIn.addEventListener("change", () => update({name: nameIn.value.trim()}));
  const metaIn = h("input", {id: "f-meta", type: "search", placeholder: "metadata key=value", "aria-label": "Metadata filter (key=value)", value: f.meta});
  metaIn.addEventListener("change", () => update({meta: metaIn.value.trim()}));
  const colsIn = h("input", {id: "f-cols", type: "text", placeholder: "metadata columns: a,b", "aria-label": "Metadata keys shown as columns",
    value: f.cols.join(",")});
  colsIn.addEventListener("change", () => { f.cols = colsIn.value.split(",").map((c) => c.trim()).filter(Boolean); save(); render(); });
  const refresh = h("input", {type: "checkbox", id: "f-refresh", checked: f.refresh,
    onchange: () => { f.refresh = refresh.checked; save(); }});
  const compareBtn = h("button", {id: "compare-selected", type: "button", disabled: true,
    onclick: () => go(`#/compare?ids=${[...selected].join(",")}`)}, "Compare selected");
  const compareMeta = h("a", {id: "compare-meta", class: "button", hidden: !f.meta}, "Compare the newest 5 with this metadata");
  const head = h("thead");
  const body = h("tbody");
  const status = h("div", {class: "status", role: "status"});
  const pager = h("div", {class: "pager"});

  function save() {
    setQuery({state: f.state, kind: f.kind, name: f.name, meta: f.meta, cols: f.cols.join(","), sort: f.sort, after: f.after,
      trail: f.trail.join(","), refresh: f.refresh ? "" : "off", limit: f.limit === PAGE ? "" : f.limit});
    compareMeta.hidden = !f.meta;
    compareMeta.href = `#/compare?meta=${encodeURIComponent(f.meta)}`;
  }

  function update(change) {
    Object.assign(f, change, {after: "", trail: []});  // a new filter starts at the first page
    save();
    render();  // the header (sort arrows) at once; the rows when the page arrives
    load();
  }

  const columns = () => [
    {key: "name", title: "Job", value: (r) => r.job.name || r.job.id},
    {key: "kind", title: "Kind", value: (r) => r.job.kind},
    {key: "state", title: "State", value: (r) => r.job.state},
    {key: "progress", title: "Progress", value: (r) => progressOf(r.job, r.latest)},
    {key: "loss", title: "Latest loss", value: (r) => latestLoss(r.latest)?.value ?? null},
    ...f.cols.map((c) => ({key: `meta:${c}`, title: c, meta: true, value: (r) => r.job.metadata?.[c] ?? null})),
    {key: "created", title: "Created", value: (r) => r.job.created_at},
    {key: "duration", title: "Run time", value: (r) => seconds(r.job)},
    {key: "host", title: "Host", value: (r) => r.job.host},
    {key: "attempts", title: "Attempts", value: (r) => r.job.attempt_count},
  ];

  function sorted() {
    if (!f.sort || serverSort(f.sort)) return rows;  // the server's order
    const desc = f.sort.startsWith("-"), key = f.sort.replace(/^-/, "");
    const col = columns().find((c) => c.key === key);
    if (!col) return rows;
    const cmp = (a, b) => {
      const x = col.value(a), y = col.value(b);
      if (x === y) return 0;
      if (x === null || x === undefined) return 1;  // blanks last either way
      if (y === null || y === undefined) return -1;
      const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y), "en", {numeric: true});
      return desc ? -order : order;
    };
    return [...rows].sort(cmp);
  }

  function sortBy(key) {
    const before = serverSort(f.sort);
    const sort = f.sort === key ? `-${key}` : f.sort === `-${key}` ? "" : key;
    if (before || serverSort(sort)) { update({sort}); return; }  // a new server order starts at the first page
    f.sort = sort;
    save();
    render();
  }

  /** The refresh redraws the table every 3 s: keep the keyboard focus on the same control of the same row. */
  function keepFocus(draw) {
    const focused = document.activeElement;
    const where = focused && (head.contains(focused) || body.contains(focused))
      ? {job: focused.closest("tr")?.dataset.job, col: focused.closest("th")?.dataset.col, tag: focused.tagName, cls: focused.className} : null;
    draw();
    if (!where) return;
    const scope = where.job ? body.querySelector(`tr[data-job="${where.job}"]`) : where.col ? head.querySelector(`th[data-col="${where.col}"]`) : null;
    const again = scope && [...scope.querySelectorAll(where.tag)].find((el) => el.className === where.cls);
    again?.focus();
  }

  function render() { keepFocus(draw); }

  function draw() {
    const cols = columns();
    const current = f.sort.replace(/^-/, "");
    fill(head, h("tr", {},
      h("th", {scope: "col"}, h("span", {class: "visually-hidden"}, "Select")),
      cols.map((c) => h("th", {scope: "col", "aria-sort": c.key === current ? (f.sort.startsWith("-") ? "descending" : "ascending") : "none",
        dataset: {col: c.key}}, h("button", {type: "button", class: "sort", onclick: () => sortBy(c.key)}, c.title,
        c.key === current ? (f.sort.startsWith("-") ? " ▼" : " ▲") : "")))));
    fill(body, rows.length ? sorted().map((r) => row(r, cols)) :
      h("tr", {}, h("td", {colspan: cols.length + 1, class: "muted empty"}, "No jobs match. ", h("a", {href: "#/submit"}, "Submit one"))));
    compareBtn.disabled = selected.size < 2;
    compareBtn.textContent = `Compare selected (${selected.size})`;
  }

  function row(r, cols) {
    const job = r.job;
    const note = job.state === "queued" && job.pending_reason ? job.pending_reason
      : job.error ? `${job.error.code}: ${job.error.message || ""}` : "";
    const tick = h("input", {type: "checkbox", class: "select-job", checked: selected.has(job.id), "aria-label": `Select ${job.name || job.id}`,
      onchange: () => { if (tick.checked) selected.add(job.id); else selected.delete(job.id); render(); }});
    const cells = {
      name: h("td", {}, h("a", {href: `#/jobs/${job.id}`}, job.name || job.id), job.name ? h("div", {class: "muted mono small"}, job.id) : null),
      kind: h("td", {}, job.kind),
      state: h("td", {}, stateBadge(job.state), note ? h("div", {class: "muted small clip", title: note}, note) : null),
      progress: progressCell(progressOf(job, r.latest)),
      loss: lossCell(latestLoss(r.latest)),
      created: h("td", {title: job.created_at}, ago(job.created_at)),
      duration: h("td", {}, runtime(job)),
      host: h("td", {}, job.host || "—"),
      attempts: h("td", {}, `${job.attempt_count}/${job.max_restarts + 1}`),
    };
    return h("tr", {dataset: {job: job.id, state: job.state}}, h("td", {}, tick),
      cols.map((c) => (c.meta ? h("td", {class: "mono small", dataset: {col: c.key}}, String(c.value(r) ?? "—")) : cells[c.key])));
  }

  async function load() {
    let page, latest = {data: []};
    try {
      page = await api("/v1/jobs", {params: {state: f.state, kind: f.kind, name: f.name, ...metaParams(f.meta), after: f.after,
        limit: f.limit, sort: serverSort(f.sort)}});
      if (page.data.length) latest = await api("/v1/metrics/latest", {params: {ids: page.data.map((j) => j.id).join(","), names: LOSSES.join(",")}});
    } catch (err) {
      fill(status, errorBox(err));
      return;
    }
    const byId = new Map(latest.data.map((l) => [l.job_id, l]));
    rows = page.data.map((job) => ({job, latest: byId.get(job.id) || null}));
    fill(status, h("span", {class: "muted"}, `updated ${new Date().toLocaleTimeString("sv-SE")}`, f.sort && !serverSort(f.sort) ? " · sorted within this page" : ""));
    render();
    const byTime = ["", "-created_at"].includes(serverSort(f.sort));  // newest first, unless the server sorts otherwise
    fill(pager,
      h("button", {id: "page-first", disabled: !f.after, onclick: () => { Object.assign(f, {after: "", trail: []}); save(); load(); }},
        byTime ? "« Newest" : "« First"),
      h("button", {id: "page-newer", disabled: !f.after, onclick: () => { f.after = f.trail.pop() || ""; save(); load(); }},
        byTime ? "‹ Newer" : "‹ Previous"),
      h("button", {id: "page-older", disabled: !page.has_more, onclick: () => { f.trail.push(f.after); f.after = page.last_id; save(); load(); }},
        byTime ? "Older ›" : "Next ›"));
  }

  save();
  root.append(h("section", {class: "card"},
    h("div", {class: "toolbar"}, h("h2", {}, "Jobs"),
      h("div", {class: "filters"}, stateSel, kindSel, nameIn, metaIn, colsIn,
        h("label", {class: "inline"}, refresh, " auto-refresh"),
        h("a", {class: "button primary", href: "#/submit"}, "Submit a job"))),
    h("div", {class: "toolbar"}, compareBtn, compareMeta, status),
    h("div", {class: "table-scroll"}, h("table", {class: "jobs"}, head, body)),
    pager));
  render();
  return every(3000, () => (f.refresh || !rows.length ? load() : null));
}

function latestLoss(latest) {
  if (!latest) return null;
  const name = LOSSES.find((n) => n in latest.values);
  return name ? {name, value: latest.values[name], step: latest.value_steps[name]} : null;
}

function progressCell(fraction) {
  if (fraction === null) return h("td", {class: "muted"}, "—");
  const pct = Math.round(fraction * 100);
  return h("td", {dataset: {progress: pct}}, h("div", {class: "mini-bar", role: "progressbar", "aria-valuenow": pct, "aria-valuemin": 0,
    "aria-valuemax": 100, "aria-label": "progress"}, h("div", {class: "fill", style: {width: `${pct}%`}})), h("span", {class: "small"}, `${pct}%`));
}

function lossCell(loss) {
  if (!loss) return h("td", {class: "muted"}, "—");
  return h("td", {title: `${loss.name} at step ${loss.step}`, dataset: {loss: loss.value ?? ""}}, num(loss.value));
}
