// Overview: server facts, memory against the budget, loaded models, the store (pull with
// progress, remove), and the live charts.
import { html, useState } from "./vendor/preact-htm.module.js";
import { call, streamLines, NeedKey, fmtBytes, fmtDuration } from "./api.js";
import { Charts } from "./charts.js";

function Facts({ info }) {
  const h = info.health;
  const rows = [
    ["Version", info.version], ["Backend", info.backend], ["BLAS", info.blas],
    ["Uptime", fmtDuration(h.uptime_s)], ["Status", h.status],
    ["Requests in flight", h.requests_in_flight], ["Engine core", `pid ${h.engine_core.pid}, epoch ${h.engine_core.epoch}`],
    ["Worker restarts", h.worker_restarts], ["Default model", h.default_model || "–"],
  ];
  return html`<div class="card"><h2>Server</h2><table data-testid="server-facts">
    ${rows.map(([k, v]) => html`<tr><th>${k}</th><td>${v}</td></tr>`)}</table></div>`;
}

function Memory({ mem }) {
  const used = (mem.models_bytes || 0) + (mem.caches_bytes || 0);
  const budget = mem.budget_bytes || 0;
  const pct = budget ? Math.min(100, (100 * used) / budget) : 0;
  return html`<div class="card"><h2>Memory</h2>
    <div class="bar" title="${pct.toFixed(2)}% of the budget"><div style="width:${pct}%"></div></div>
    <p data-testid="memory">${fmtBytes(used)} of ${fmtBytes(budget)} budget
      (${pct < 0.1 && used ? "<0.1" : pct.toFixed(1)}%): weights ${fmtBytes(mem.models_bytes)},
      caches ${fmtBytes(mem.caches_bytes)}</p>
    <p class="muted">MLX active ${fmtBytes(mem.active_bytes)}, cache ${fmtBytes(mem.cache_bytes)},
      peak ${fmtBytes(mem.peak_bytes)}</p></div>`;
}

function Loaded({ models, refresh, onAuthError }) {
  const [err, setErr] = useState("");
  const unload = async (name) => {
    try { await call("/unload", { method: "POST", body: { model: name } }); refresh(); }
    catch (e) { e instanceof NeedKey ? onAuthError() : setErr(String(e.message)); }
  };
  const now = Date.now() / 1000;
  return html`<div class="card"><h2>Loaded models</h2>
    ${err && html`<p class="err">${err}</p>`}
    <table data-testid="loaded"><tr><th>Model</th><th>Kind</th><th class="num">Memory</th>
      <th>Pinned</th><th>Expires</th><th class="num">Running</th><th class="num">Waiting</th><th></th></tr>
    ${models.map((m) => html`<tr data-model=${m.name}><td>${m.name}</td><td>${m.kind}</td>
      <td class="num">${fmtBytes(m.size)}</td><td>${m.pinned ? "yes" : "no"}</td>
      <td>${m.pinned || m.expires_at == null ? "never" : "in " + fmtDuration(m.expires_at - now)}</td>
      <td class="num">${m.running ?? m.active_requests}</td><td class="num">${m.waiting ?? 0}</td>
      <td><button onClick=${() => unload(m.name)}>Unload</button></td></tr>`)}
    </table>${!models.length && html`<p class="muted">No model loaded.</p>`}</div>`;
}

function Store({ store, refresh, onAuthError }) {
  const [name, setName] = useState("");
  const [pull, setPull] = useState(null);  // {status, completed, total, error, done}
  const [err, setErr] = useState("");
  const doPull = async (e) => {
    e.preventDefault();
    if (!name.trim()) return;
    setPull({ status: "starting" });
    try {
      await streamLines("/api/pull", { model: name.trim(), stream: true }, (line) => {
        const ev = JSON.parse(line);
        setPull((p) => ({ ...p, ...ev, done: ev.status === "success" }));
      });
      refresh();
    } catch (e2) {
      if (e2 instanceof NeedKey) onAuthError();
      setPull((p) => ({ ...p, error: String(e2.message || e2) }));
    }
  };
  const remove = async (m) => {
    if (!confirm(`Remove ${m} from the store?`)) return;
    try { await call("/api/delete", { method: "DELETE", body: { model: m } }); refresh(); }
    catch (e2) { e2 instanceof NeedKey ? onAuthError() : setErr(String(e2.message)); }
  };
  const pct = pull && pull.total ? (100 * (pull.completed || 0)) / pull.total : null;
  return html`<div class="card"><h2>Store</h2>
    <form class="row" onSubmit=${doPull}>
      <input name="pull" placeholder="model to pull (hub repo, alias, path)" value=${name}
        onInput=${(e) => setName(e.target.value)} style="flex:1" />
      <button class="primary" type="submit" disabled=${pull && !pull.done && !pull.error}>Pull</button>
    </form>
    ${pull && html`<div data-testid="pull-progress">
      <div class="row"><span>${pull.status}${pull.digest ? " " + pull.digest.slice(0, 19) : ""}</span>
        ${pct != null && html`<span class="muted">${fmtBytes(pull.completed)} / ${fmtBytes(pull.total)}</span>`}</div>
      <progress max="100" value=${pct ?? (pull.done ? 100 : undefined)}></progress>
      ${pull.error && html`<p class="err">${pull.error}</p>`}</div>`}
    ${err && html`<p class="err">${err}</p>`}
    <table data-testid="store"><tr><th>Model</th><th>Kind</th><th class="num">Size</th><th>Source</th><th></th></tr>
    ${store.map((m) => html`<tr data-model=${m.name}><td>${m.name}</td><td>${m.kind}</td>
      <td class="num">${fmtBytes(m.size)}</td><td class="muted">${m.source}</td>
      <td><button onClick=${() => remove(m.name)}>Remove</button></td></tr>`)}
    </table>${!store.length && html`<p class="muted">The store is empty.</p>`}</div>`;
}

export function Overview({ info, refresh, onAuthError }) {
  if (!info) return html`<p class="muted">Loading…</p>`;
  const h = info.health;
  return html`<div class="grid">
      <${Facts} info=${info} />
      <${Memory} mem=${h.memory || {}} />
    </div>
    <h2>Activity</h2>
    <${Charts} onAuthError=${onAuthError} />
    <h2>Models</h2>
    <div class="grid">
      <${Loaded} models=${h.models || []} refresh=${refresh} onAuthError=${onAuthError} />
      <${Store} store=${info.store} refresh=${refresh} onAuthError=${onAuthError} />
    </div>`;
}
