// Hosts: devices, the job holding each with its newest telemetry (utilisation, memory), heartbeat health.
// Refreshed every 5 s.

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
    const telemetry = await deviceTelemetry(page.data);
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
        }, String(d.id), deviceStats(telemetry, host, d))))))))) : h("p", {class: "muted"}, "No host has registered yet (start a worker: llmjobs worker)."));
  }
  return every(5000, load);
}

/** job id -> {device index: {sys_*: value}} for the jobs holding devices (GET /v1/metrics/latest?devices=true). */
async function deviceTelemetry(hosts) {
  const ids = [...new Set(hosts.flatMap((host) => host.devices.map((d) => d.job_id)).filter(Boolean))];
  if (!ids.length) return new Map();
  try {
    const got = await api("/v1/metrics/latest", {params: {ids: ids.join(","), names: "", devices: "true"}});
    return new Map(got.data.map((j) => [j.job_id, j.devices || {}]));
  } catch {
    return new Map();  // telemetry is extra: the hosts table shows without it
  }
}

/** "87% · 1.2/64 GB" under a held device: the job's telemetry row whose sys_device_id is this device on this node. */
function deviceStats(telemetry, host, d) {
  const rows = telemetry.get(d.job_id);
  if (!rows) return null;
  const perNode = host.devices.filter((x) => x.job_id === d.job_id && x.node_rank === d.node_rank).length || 1;
  const row = Object.entries(rows).find(([index, r]) => r.sys_device_id === d.id && Math.floor(Number(index) / perNode) === (d.node_rank ?? 0));
  if (!row) return null;
  const r = row[1], parts = [];
  if (r.sys_util_pct !== undefined && r.sys_util_pct !== null) parts.push(`${r.sys_util_pct.toFixed(0)}%`);
  if (r.sys_mem_used_mb !== undefined && r.sys_mem_used_mb !== null) {
    parts.push(`${(r.sys_mem_used_mb / 1024).toFixed(1)}${r.sys_mem_total_mb ? `/${(r.sys_mem_total_mb / 1024).toFixed(0)}` : ""} GB`);
  }
  if (r.sys_temp_c) parts.push(`${r.sys_temp_c.toFixed(0)}°C`);
  if (r.sys_power_w) parts.push(`${r.sys_power_w.toFixed(0)} W`);
  return parts.length ? h("span", {class: "device-stats", dataset: {device: d.id}}, parts.join(" · ")) : null;
}
