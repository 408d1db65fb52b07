// Talking to mlxd from the page: the API key (sessionStorage only: gone with the tab),
// JSON calls, and the two streaming formats the page reads (SSE and NDJSON).

const KEY = "mlxd-api-key";

export class NeedKey extends Error {}

export function getKey() { return sessionStorage.getItem(KEY) || ""; }
export function setKey(k) { k ? sessionStorage.setItem(KEY, k) : sessionStorage.removeItem(KEY); }

export function headers(extra = {}) {
  const h = { ...extra };
  const k = getKey();
  if (k) h["Authorization"] = `Bearer ${k}`;
  return h;
}

async function errorText(r) {
  const text = await r.text();
  try {
    const j = JSON.parse(text);
    return (j.error && (j.error.message || j.error)) || j.detail || text;
  } catch { return text || r.statusText; }
}

export async function call(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  if (r.status === 401) throw new NeedKey(await errorText(r));
  if (!r.ok) throw new Error(`${r.status}: ${await errorText(r)}`);
  const ct = r.headers.get("content-type") || "";
  return ct.includes("json") ? r.json() : r.text();
}

// POST and read the answer as a stream of lines; `onLine` gets each non-empty line, and
// `onResponse` the response before its body (its headers: the request id).
export async function streamLines(path, body, onLine, signal, onResponse) {
  const r = await fetch(path, { method: "POST", signal, body: JSON.stringify(body),
    headers: headers({ "Content-Type": "application/json" }) });
  if (onResponse) onResponse(r);
  if (r.status === 401) throw new NeedKey(await errorText(r));
  if (!r.ok) throw new Error(`${r.status}: ${await errorText(r)}`);
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i).replace(/\r$/, "");
      buf = buf.slice(i + 1);
      if (line.trim()) onLine(line);
    }
  }
  if (buf.trim()) onLine(buf);
}

// Server-sent events from the OpenAI-compatible API: `onEvent` gets each parsed `data:`.
export async function streamSSE(path, body, onEvent, signal, onResponse) {
  await streamLines(path, body, (line) => {
    if (!line.startsWith("data:")) return;
    const data = line.slice(5).trim();
    if (data === "[DONE]") return;
    onEvent(JSON.parse(data));
  }, signal, onResponse);
}

export function fmtBytes(n) {
  if (n == null) return "–";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${u[i]}`;
}

export function fmtDuration(s) {
  if (s == null) return "–";
  s = Math.max(0, Math.round(s));
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${s % 60}s`;
  return `${s}s`;
}

export async function copyText(text) {
  try { await navigator.clipboard.writeText(text); return true; } catch { /* not a secure context */ }
  const ta = document.createElement("textarea");
  ta.value = text; document.body.appendChild(ta); ta.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch { ok = false; }
  ta.remove();
  return ok;
}
