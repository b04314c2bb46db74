// Small pieces shared by the views.

import {h} from "../dom.js";

export function stateBadge(state) {
  return h("span", {class: `badge state-${state}`, dataset: {state}}, state);
}

export function errorBox(err) {
  return h("p", {class: "error", role: "alert"}, err.field ? `${err.message} (field ${err.field})` : err.message);
}

/** Run fn now and every `ms` while the page is visible; returns a stop function. */
export function every(ms, fn) {
  let timer = 0, stopped = false;
  const tick = async () => {
    if (stopped) return;
    if (!document.hidden) {
      try { await fn(); } catch { /* the view shows its own errors */ }
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

export function keyValues(obj, format = (v) => v, cls = "") {
  return h("dl", {class: `kv ${cls}`}, Object.entries(obj).flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, format(v, k))]));
}

/** Chart controls from the URL: ?smooth=0.6&x=relative&logy=Loss,Grad%20norm (a shared link shows the same view). */
export function viewFromQuery(query) {
  const smooth = Math.min(0.99, Math.max(0, Number(query.get("smooth")) || 0));
  const xMode = ["step", "wall", "relative", "tokens"].includes(query.get("x")) ? query.get("x") : "step";
  return {smooth, xMode, logY: new Set((query.get("logy") || "").split(",").filter(Boolean))};
}

export function viewToQuery(view) {
  return {smooth: view.smooth || "", x: view.xMode === "step" ? "" : view.xMode, logy: [...view.logY].join(",")};
}
