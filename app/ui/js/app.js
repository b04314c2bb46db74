// The dashboard shell: hash routes (so a refresh or a shared link reopens the same view with its filters), the
// token check, and one live view at a time (each view returns a cleanup that stops its timers and streams).

import {auth, onUnauthorized} from "./api.js";
import {h, fill} from "./dom.js";
import {go, parseHash} from "./router.js";
import {renderLogin} from "./views/login.js";
import {renderJobs} from "./views/jobs.js";
import {renderJob} from "./views/job.js";
import {renderSubmit} from "./views/submit.js";
import {renderHosts} from "./views/hosts.js";
import {renderCompare} from "./views/compare.js";
import {renderChat} from "./views/chat.js";
import {renderRuns} from "./views/runs.js";
import {renderSweeps} from "./views/sweeps.js";

const ROUTES = [
  [/^\/login$/, renderLogin, "login"],
  [/^\/jobs$/, renderJobs, "jobs"],
  [/^\/jobs\/([^/]+)$/, renderJob, "jobs"],
  [/^\/submit$/, renderSubmit, "submit"],
  [/^\/hosts$/, renderHosts, "hosts"],
  [/^\/compare$/, renderCompare, "compare"],
  [/^\/chat$/, renderChat, "chat"],
  [/^\/runs$/, renderRuns, "runs"],
  [/^\/sweeps$/, renderSweeps, "sweeps"],
  [/^\/sweeps\/([^/]+)$/, renderSweeps, "sweeps"],
];

let cleanup = null;

function route() {
  if (cleanup) { cleanup(); cleanup = null; }
  const {path, query} = parseHash();
  if (!auth.token && path !== "/login") {
    go(`#/login?next=${encodeURIComponent(location.hash || "#/jobs")}`);
    return;
  }
  const view = document.getElementById("view");
  const match = ROUTES.map(([re, fn, nav]) => [path.match(re), fn, nav]).find(([m]) => m);
  document.querySelectorAll("[data-nav]").forEach((a) => a.classList.toggle("active", match && a.dataset.nav === match[2]));
  renderWho();
  if (!match) {
    fill(view, h("section", {class: "card"}, h("h2", {}, "Not found"), h("a", {href: "#/jobs"}, "Back to the jobs")));
    return;
  }
  const [m, fn] = match;
  fill(view);
  cleanup = fn(view, {params: m.slice(1).map(decodeURIComponent), query}) || null;
}

function renderWho() {
  const who = document.getElementById("who");
  if (!auth.token) { fill(who); return; }
  fill(who, h("span", {class: "token", title: "your API token (kept in this browser's localStorage)"}, `${auth.token.slice(0, 12)}…`),
    h("button", {class: "link", onclick: () => { auth.clear(); go("#/login"); }}, "Sign out"));
}

onUnauthorized(() => {
  if (parseHash().path !== "/login") go(`#/login?expired=1&next=${encodeURIComponent(location.hash)}`);
});
window.addEventListener("hashchange", route);
route();
