// Hash routes: "#/jobs?state=running", "#/jobs/<id>?tab=logs". The view state lives in the URL, so a refresh or a
// shared link reopens the same page with the same filters (the job itself always lives on the server).

export function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/jobs";
  const [path, search = ""] = raw.split("?");
  return {path, query: new URLSearchParams(search)};
}

/** Change the query part of the current route without re-rendering (filters, tabs, paging). */
export function setQuery(params) {
  const {path} = parseHash();
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const hash = `#${path}${q.toString() ? `?${q}` : ""}`;
  if (hash !== location.hash) history.replaceState(null, "", hash);
}

export function go(hash) { location.hash = hash; }
