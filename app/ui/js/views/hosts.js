// Hosts: devices, the job holding each, heartbeat health. Refreshed every 5 s.

import {api} from "../api.js";
import {h, fill} from "../dom.js";
import {every, errorBox} from "./widgets.js";

export function renderHosts(root) {
  const body = h("div", {class: "hosts"});
  const status = h("div", {class: "status"});
  root.append(h("section", {class: "card"}, h("h2", {}, "Hosts"), status, body));

  async function load() {
    let page;
    try {
      page = await api("/v1/hosts");
    } catch (err) {
      fill(status, err.status === 404 ? h("p", {class: "muted"}, "This server has no hosts endpoint.") : errorBox(err));
      return;
    }
    fill(status, h("span", {class: "muted"}, `${page.data.length} host${page.data.length === 1 ? "" : "s"} · updated ${new Date().toLocaleTimeString("sv-SE")}`));
    fill(body, page.data.length ? h("table", {class: "hosts"},
      h("thead", {}, h("tr", {}, ["Host", "Type", "Health", "Heartbeat", "Free", "Devices"].map((t) => h("th", {}, t)))),
      h("tbody", {}, page.data.map((host) => h("tr", {dataset: {host: host.name}},
        h("td", {}, host.name, host.address ? h("div", {class: "muted small"}, host.address) : null),
        h("td", {}, host.device_type),
        h("td", {}, h("span", {class: `badge health-${host.health}`}, host.health)),
        h("td", {}, `${host.heartbeat_age_s.toFixed(0)} s ago`),
        h("td", {}, `${host.free} / ${host.devices.length}`),
        h("td", {}, h("div", {class: "devices"}, host.devices.map((d) => h(d.job_id ? "a" : "span", {
          class: `device ${d.held ? "held" : "free"}`, href: d.job_id ? `#/jobs/${d.job_id}` : undefined,
          title: d.held ? (d.job_id ? `job ${d.job_id}${d.node_rank !== null ? ` (node ${d.node_rank})` : ""}` : "held by another team's job") : "free",
        }, String(d.id))))))))) : h("p", {class: "muted"}, "No host has registered yet (start a worker: llmjobs worker)."));
  }
  return every(5000, load);
}
