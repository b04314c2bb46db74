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
