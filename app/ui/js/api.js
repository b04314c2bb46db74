// The REST client: bearer token from localStorage, JSON errors ({code, message, field, errors}) as ApiError.

const TOKEN_KEY = "llmjobs.token";

export const auth = {
  get token() { return localStorage.getItem(TOKEN_KEY) || ""; },
  set(token) { localStorage.setItem(TOKEN_KEY, token.trim()); },
  clear() { localStorage.removeItem(TOKEN_KEY); },
};

export class ApiError extends Error {
  constructor(status, body) {
    super(body && body.message ? body.message : `HTTP ${status}`);
    this.status = status;
    this.code = body && body.code;
    this.field = body && body.field;
    this.errors = (body && body.errors) || (body && body.message ? [{message: body.message, field: body.field}] : []);
  }
}

/** Listeners told when the API answers 401 (the app sends the user to the login page). */
const unauthorized = new Set();
export function onUnauthorized(fn) { unauthorized.add(fn); }

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const s = q.toString();
  return s ? `?${s}` : "";
}

export async function api(path, {method = "GET", body, params, headers = {}, token, signal} = {}) {
  const init = {method, signal, headers: {Accept: "application/json", ...headers}};
  const bearer = token ?? auth.token;
  if (bearer) init.headers.Authorization = `Bearer ${bearer}`;
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = typeof body === "string" ? body : JSON.stringify(body);
  }
  const response = await fetch(path + query(params), init);
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = {message: text}; }
  if (!response.ok) {
    const err = new ApiError(response.status, data);
    if (response.status === 401 && token === undefined) unauthorized.forEach((fn) => fn(err));
    throw err;
  }
  return data;
}

export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
export const STATES = ["queued", "starting", "running", "cancelling", "retrying", "succeeded", "failed", "cancelled"];
export const KINDS = ["preprocess", "convert", "train", "eval", "serve", "pipeline"];
