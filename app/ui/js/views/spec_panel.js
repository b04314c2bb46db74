// The Spec tab: the effective configuration of a job. The stored spec holds only what the user set (so the engine
// can tell an explicit flag from a default); here every field of the kind's schema (/openapi.json) is listed with
// the value the job runs with and where it comes from: set by the user, the schema default, or, for a model-shape
// field left unset on a job that loads a checkpoint, the checkpoint's own config (read by the engine at start).

import {api} from "../api.js";
import {h, fill} from "../dom.js";

let schemasOnce = null;
const LOADS = ["load", "load_dir"];

function schemaFor(schemas, kind) {
  return Object.values(schemas).find((s) => s.properties?.kind?.const === kind || s.properties?.kind?.default === kind);
}

/** [{field, value, source: "set" | "default" | "checkpoint" | "unset", description}] in schema order. */
export function effectiveRows(schema, spec) {
  const loads = LOADS.some((k) => spec[k]);
  return Object.entries(schema.properties || {}).map(([field, p]) => {
    if (field in spec) return {field, value: spec[field], source: "set", description: p.description || ""};
    if ("default" in p && p.default !== null) return {field, value: p.default, source: "default", description: p.description || ""};
    const fromCheckpoint = loads && /checkpoint|config/i.test(p.description || "");
    return {field, value: null, source: fromCheckpoint ? "checkpoint" : "unset", description: p.description || ""};
  });
}

const SOURCE_TEXT = {set: "set by you", default: "default", checkpoint: "from the checkpoint", unset: "not set"};

export async function renderSpec(el, job, actions) {
  let schema = null;
  try {
    schemasOnce = schemasOnce || api("/openapi.json").then((d) => d.components.schemas);
    schema = schemaFor(await schemasOnce, job.kind);
  } catch { /* shown below as the raw spec only */ }
  const onlySet = h("input", {type: "checkbox", id: "spec-only-set"});
  const table = h("table", {class: "summary-table spec-effective", id: "spec-effective"});
  const draw = () => {
    const rows = schema ? effectiveRows(schema, job.spec).filter((r) => !onlySet.checked || r.source === "set") : [];
    fill(table, h("caption", {}, "Effective configuration"),
      h("thead", {}, h("tr", {}, ["Field", "Value", "Source"].map((t) => h("th", {scope: "col"}, t)))),
      h("tbody", {}, rows.map((r) => h("tr", {dataset: {field: r.field, source: r.source}, class: `source-${r.source}`},
        h("th", {scope: "row", class: "mono", title: r.description}, r.field),
        h("td", {class: "mono small"}, r.value === null ? "—" : typeof r.value === "string" ? r.value : JSON.stringify(r.value)),
        h("td", {class: "small"}, SOURCE_TEXT[r.source])))));
  };
  onlySet.addEventListener("change", draw);
  draw();
  fill(el, h("div", {class: "toolbar"}, actions, h("label", {class: "inline", for: "spec-only-set"}, onlySet, " only what was set"),
    h("span", {class: "muted small"}, "Bold rows were set in the submitted spec; the rest are what the job runs with.")),
  schema ? table : null,
  h("details", {}, h("summary", {}, "Submitted spec (JSON)"), h("pre", {class: "json"}, JSON.stringify(job.spec, null, 2))));
}
