// Login: paste an API token; it is checked against the API, then kept in localStorage.

import {api, auth} from "../api.js";
import {h} from "../dom.js";
import {go} from "../router.js";

export function renderLogin(root, {query}) {
  const input = h("input", {type: "password", id: "token", name: "token", autocomplete: "off", placeholder: "llmj_…", required: true});
  const error = h("p", {class: "error", role: "alert"});
  if (query.get("expired")) error.textContent = "The token was refused (revoked or wrong server). Paste a valid one.";
  const next = query.get("next") || "#/jobs";

  async function submit(event) {
    event.preventDefault();
    const token = input.value.trim();
    error.textContent = "";
    try {
      await api("/v1/jobs", {params: {limit: 1}, token});
    } catch (err) {
      error.textContent = err.status === 401 ? "Invalid or revoked token." : `Cannot check the token: ${err.message}`;
      return;
    }
    auth.set(token);
    go(next.startsWith("#/login") ? "#/jobs" : next);
  }

  root.append(h("section", {class: "card narrow"},
    h("h2", {}, "Sign in"),
    h("p", {class: "muted"}, "Paste an API token. `make run` prints an admin token (also in var/admin_token); ",
      "`llmjobs token create --team T` makes one for a team. It is kept in this browser only."),
    h("form", {onsubmit: submit, class: "stack"},
      h("label", {for: "token"}, "API token"), input,
      h("button", {type: "submit", class: "primary"}, "Sign in"), error)));
  input.focus();
}
