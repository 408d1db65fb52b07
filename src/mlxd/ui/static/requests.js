// Requests: the server's last finished requests (its access log, kept in memory),
// filterable; a request id opens its log line. A key that is not an admin key gets only
// its own requests (the server filters; "scope" says which), and the view says so.
import { html, useState, useEffect } from "./vendor/preact-htm.module.js";
import { call, NeedKey } from "./api.js";

const cls = (s) => `status-${String(s)[0]}xx`;

// A request id comes from the client (X-Request-ID): any text, "/" and "#" included, so
// it is percent-encoded in the link and decoded from everything after "#requests/".
export const requestLink = (rid) => `#requests/${encodeURIComponent(rid)}`;

function ridFromHash() {
  const h = location.hash.replace(/^#\/?/, "");
  const i = h.indexOf("/");
  if (i < 0 || i === h.length - 1) return null;
  try { return decodeURIComponent(h.slice(i + 1)); } catch { return h.slice(i + 1); }
}

export function Requests({ onAuthError }) {
  const [items, setItems] = useState([]);
  const [q, setQ] = useState("");
  const [status, setStatus] = useState("all");
  const [limit, setLimit] = useState(200);
  const [auto, setAuto] = useState(true);
  const [open, setOpen] = useState(ridFromHash());
  const [err, setErr] = useState("");
  const [scope, setScope] = useState("all");

  const load = async () => {
    try {
      const got = await call(`/ui/api/requests?limit=${limit}`);
      setItems(got.requests); setScope(got.scope || "all"); setErr("");
    } catch (e) { e instanceof NeedKey ? onAuthError() : setErr(String(e.message)); }
  };
  useEffect(() => {
    load();
    if (!auto) return undefined;
    const t = setInterval(load, 3000);
    return () => clearInterval(t);
  }, [limit, auto]);

  // a link followed while this view is shown (a reply's request link, a pasted URL)
  useEffect(() => {
    const onHash = () => setOpen(ridFromHash());
    window.addEventListener("hashchange", onHash);
    return () => window.removeEventListener("hashchange", onHash);
  }, []);

  const needle = q.trim().toLowerCase();
  const shown = items.filter((r) => (status === "all" || cls(r.status) === `status-${status}`)
    && (!needle || [r.request_id, r.route, r.path, r.model, r.key, r.method, r.status]
      .some((v) => v != null && String(v).toLowerCase().includes(needle))));
  const select = (id) => { const next = open === id ? null : id; setOpen(next); history.replaceState(null, "", next ? requestLink(next) : "#requests"); };

  return html`<div class="card">
    <div class="row" style="margin-bottom:.6rem">
      <input name="filter" placeholder="filter: id, route, model, key…" value=${q} onInput=${(e) => setQ(e.target.value)} style="flex:1" />
      <select name="status" value=${status} onChange=${(e) => setStatus(e.target.value)}>
        ${["all", "2xx", "4xx", "5xx"].map((s) => html`<option value=${s}>${s}</option>`)}</select>
      <select name="limit" value=${limit} onChange=${(e) => setLimit(Number(e.target.value))}>
        ${[50, 200, 500].map((n) => html`<option value=${n}>last ${n}</option>`)}</select>
      <label class="row" style="margin:0"><input type="checkbox" checked=${auto} onChange=${(e) => setAuto(e.target.checked)} /> live</label>
      <button onClick=${load}>Refresh</button>
    </div>
    ${err && html`<p class="err">${err}</p>`}
    ${scope === "own" && html`<p class="muted" data-testid="requests-scope">Only this key's requests are shown (an admin key sees every key's).</p>`}
    <table data-testid="requests"><tr><th>Time</th><th>Request id</th><th>Route</th><th>Model</th>
      <th class="num">Status</th><th class="num">Tokens</th><th class="num">Latency</th><th>Key</th></tr>
    ${shown.map((r) => html`
      <tr class=${open === r.request_id ? "sel" : ""} data-rid=${r.request_id}>
        <td>${new Date(r.time * 1000).toLocaleTimeString()}</td>
        <td><a href=${requestLink(r.request_id)} onClick=${(e) => { e.preventDefault(); select(r.request_id); }}>${r.request_id.slice(0, 12)}</a></td>
        <td>${r.method} ${r.route}</td><td>${r.model || ""}</td>
        <td class=${"num " + cls(r.status)}>${r.status}</td>
        <td class="num">${r.prompt_tokens != null ? `${r.prompt_tokens}+${r.completion_tokens || 0}` : ""}</td>
        <td class="num">${r.duration_ms} ms</td><td>${r.key || ""}</td></tr>
      ${open === r.request_id && html`<tr><td colspan="8"><pre data-testid="log-line">${r.line}</pre></td></tr>`}`)}
    </table>
    ${!shown.length && html`<p class="muted">No requests${items.length ? " match" : " yet"}.</p>`}
  </div>`;
}
