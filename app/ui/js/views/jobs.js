// Job list: state / kind / exact-name filters, cursor paging, auto-refresh. Filters, the page and its size
// (?limit=, default 25) live in the URL.

import {api, KINDS, STATES} from "../api.js";
import {h, fill} from "../dom.js";
import {ago, runtime} from "../format.js";
import {setQuery} from "../router.js";
import {every, errorBox, stateBadge} from "./widgets.js";

const ACTIVE = "queued,starting,running,retrying,cancelling";
const PAGE = 25;

export function renderJobs(root, {query}) {
  const f = {
    state: query.get("state") || "", kind: query.get("kind") || "", name: query.get("name") || "",
    after: query.get("after") || "", trail: query.get("trail") ? query.get("trail").split(",") : [],
    refresh: query.get("refresh") !== "off", limit: Math.min(200, Math.max(1, Number(query.get("limit")) || PAGE)),
  };
  const stateSel = h("select", {id: "f-state", onchange: () => update({state: stateSel.value})},
    h("option", {value: ""}, "all states"), h("option", {value: ACTIVE}, "active (not finished)"),
    STATES.map((s) => h("option", {value: s}, s)));
  stateSel.value = f.state;
  const kindSel = h("select", {id: "f-kind", onchange: () => update({kind: kindSel.value})},
    h("option", {value: ""}, "all kinds"), KINDS.map((k) => h("option", {value: k}, k)));
  kindSel.value = f.kind;
  const nameIn = h("input", {id: "f-name", type: "search", placeholder: "exact job name", value: f.name});
  nameIn.addEventListener("change", () => update({name: nameIn.value.trim()}));
  const refresh = h("input", {type: "checkbox", id: "f-refresh", checked: f.refresh,
    onchange: () => { f.refresh = refresh.checked; save(); }});
  const body = h("tbody");
  const status = h("div", {class: "status"});
  const pager = h("div", {class: "pager"});

  function save() {
    setQuery({state: f.state, kind: f.kind, name: f.name, after: f.after, trail: f.trail.join(","), refresh: f.refresh ? "" : "off",
      limit: f.limit === PAGE ? "" : f.limit});
  }

  function update(change) {
    Object.assign(f, change, {after: "", trail: []});  // a new filter starts at the first page
    save();
    load();
  }

  async function load() {
    let page;
    try {
      page = await api("/v1/jobs", {params: {state: f.state, kind: f.kind, name: f.name, after: f.after, limit: f.limit}});
    } catch (err) {
      fill(status, errorBox(err));
      return;
    }
    fill(status, h("span", {class: "muted"}, `updated ${new Date().toLocaleTimeString("sv-SE")}`));
    fill(body, page.data.length ? page.data.map(row) :
      h("tr", {}, h("td", {colspan: 7, class: "muted empty"}, "No jobs match. ", h("a", {href: "#/submit"}, "Submit one"))));
    fill(pager,
      h("button", {id: "page-first", disabled: !f.after, onclick: () => { Object.assign(f, {after: "", trail: []}); save(); load(); }}, "« Newest"),
      h("button", {id: "page-newer", disabled: !f.after, onclick: () => { f.after = f.trail.pop() || ""; save(); load(); }}, "‹ Newer"),
      h("button", {id: "page-older", disabled: !page.has_more, onclick: () => { f.trail.push(f.after); f.after = page.last_id; save(); load(); }}, "Older ›"));
  }

  root.append(h("section", {class: "card"},
    h("div", {class: "toolbar"}, h("h2", {}, "Jobs"),
      h("div", {class: "filters"}, stateSel, kindSel, nameIn,
        h("label", {class: "inline"}, refresh, " auto-refresh"),
        h("a", {class: "button primary", href: "#/submit"}, "Submit a job"))),
    status,
    h("table", {class: "jobs"},
      h("thead", {}, h("tr", {}, ["Job", "Kind", "State", "Created", "Run time", "Host", "Attempts"].map((t) => h("th", {}, t)))),
      body),
    pager));
  return every(3000, () => (f.refresh || !body.children.length ? load() : null));
}

function row(job) {
  const note = job.state === "queued" && job.pending_reason ? job.pending_reason
    : job.error ? `${job.error.code}: ${job.error.message || ""}` : "";
  return h("tr", {dataset: {job: job.id, state: job.state}},
    h("td", {}, h("a", {href: `#/jobs/${job.id}`}, job.name || job.id), job.name ? h("div", {class: "muted mono small"}, job.id) : null),
    h("td", {}, job.kind),
    h("td", {}, stateBadge(job.state), note ? h("div", {class: "muted small clip", title: note}, note) : null),
    h("td", {title: job.created_at}, ago(job.created_at)),
    h("td", {}, runtime(job)),
    h("td", {}, job.host || "—"),
    h("td", {}, `${job.attempt_count}/${job.max_restarts + 1}`));
}
