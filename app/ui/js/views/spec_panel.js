// The Spec tab: the effective configuration of a job. The stored spec holds only what the user set (so the engine
// can tell an explicit flag from a default); here every field of the kind's schema (/openapi.json) is listed with
// the value the job runs with and where it comes from: set by the user, the schema default, or, for a model-shape
// field left unset on a job that loads a checkpoint, the checkpoint's own config. The engine reads that at start and
// records it (a `config` event: engine.train.model_setup.checkpoint_flags); until then such a field reads "from
// the checkpoint" without a value.

import {api} from "../api.js";
import {h, fill} from "../dom.js";

let schemasOnce = null;
const LOADS = ["load", "load_dir"];

function schemaFor(schemas, kind) {
  return Object.values(schemas).find((s) => s.properties?.kind?.const === kind || s.properties?.kind?.default === kind);
}

/** [{field, value, source: "set" | "checkpoint" | "default" | "checkpoint-unread" | "unset", description}] in schema
 * order. `recorded`: the values the run took from its checkpoint ({field: value}), or null before it read them. */
export function effectiveRows(schema, spec, recorded = null) {
  const loads = LOADS.some((k) => spec[k]);
  return Object.entries(schema.properties || {}).map(([field, p]) => {
    const description = p.description || "";
    if (field in spec) return {field, value: spec[field], source: "set", description};
    if (recorded && field in recorded) return {field, value: recorded[field], source: "checkpoint", description};
    if ("default" in p && p.default !== null) return {field, value: p.default, source: "default", description};
    const fromCheckpoint = loads && !recorded && /checkpoint|config/i.test(description);
    return {field, value: null, source: fromCheckpoint ? "checkpoint-unread" : "unset", description};
  });
}

const SOURCE_TEXT = {set: "set by you", checkpoint: "from the checkpoint", default: "default",
  "checkpoint-unread": "from the checkpoint (read when the job starts)", engine: "what the engine builds (Qwen3)",
  unset: "not set"};

/** The API's effective spec (GET /v1/jobs/{id}/effective-spec: the spec model's defaults, the checkpoint's values
 * read at the request, the engine's fixed Qwen3 choices), with what the run recorded from its checkpoint on top; null
 * when the API does not answer (the rows then come from the schema). */
async function serverRows(job, recorded) {
  let rows;
  try {
    rows = (await api(`/v1/jobs/${encodeURIComponent(job.id)}/effective-spec`)).data;
  } catch {
    return null;
  }
  return rows.map((r) => r.source !== "set" && recorded && r.field in recorded
    ? {...r, value: recorded[r.field], source: "checkpoint"} : r);
}

/** {values, from} of the run's last `config` event from its checkpoint, or null (no load, not started yet). */
async function recordedConfig(job) {
  if (!LOADS.some((k) => job.spec?.[k])) return null;
  try {
    const got = await api(`/v1/jobs/${encodeURIComponent(job.id)}/events`, {params: {type: "config", limit: 1000}});
    const last = got.data.filter((e) => e.data?.source === "checkpoint").pop();
    return last ? {values: last.data.values || {}, from: `${last.data.load} (${last.data.format})`} : null;
  } catch {
    return null;
  }
}

export async function renderSpec(el, job, actions) {
  let schema = null;
  try {
    schemasOnce = schemasOnce || api("/openapi.json").then((d) => d.components.schemas);
    schema = schemaFor(await schemasOnce, job.kind);
  } catch { /* shown below as the raw spec only */ }
  const recorded = await recordedConfig(job);
  const fromServer = await serverRows(job, recorded?.values);
  const onlySet = h("input", {type: "checkbox", id: "spec-only-set"});
  const table = h("table", {class: "summary-table spec-effective", id: "spec-effective"});
  const draw = () => {
    const all = fromServer || (schema ? effectiveRows(schema, job.spec, recorded?.values) : []);
    const rows = all.filter((r) => !onlySet.checked || r.source === "set");
    fill(table, h("caption", {}, "Effective configuration"),
      h("thead", {}, h("tr", {}, ["Field", "Value", "Source"].map((t) => h("th", {scope: "col"}, t)))),
      h("tbody", {}, rows.map((r) => h("tr", {dataset: {field: r.field, source: r.source}, class: `source-${r.source}`},
        h("th", {scope: "row", class: "mono", title: r.description}, r.field),
        h("td", {class: "mono small"}, r.value === null ? "—" : typeof r.value === "string" ? r.value : JSON.stringify(r.value)),
        h("td", {class: "small", title: r.source === "checkpoint" && recorded ? recorded.from : ""}, SOURCE_TEXT[r.source])))));
  };
  onlySet.addEventListener("change", draw);
  draw();
  fill(el, h("div", {class: "toolbar"}, actions, h("label", {class: "inline", for: "spec-only-set"}, onlySet, " only what was set"),
    h("span", {class: "muted small"}, "Bold rows were set in the submitted spec, ", h("span", {class: "from-checkpoint"}, "marked rows"),
      recorded ? ` were read from the checkpoint ${recorded.from}` : " come from the checkpoint", "; the rest are defaults.")),
  schema || fromServer ? table : null,
  h("details", {}, h("summary", {}, "Submitted spec (JSON)"), h("pre", {class: "json"}, JSON.stringify(job.spec, null, 2))));
}
