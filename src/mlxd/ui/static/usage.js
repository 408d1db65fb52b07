// Usage: tokens, requests and errors per API key name and model over a period, from
// GET /v1/usage (kept by the server in $MLXD_HOME/mlxd.sqlite3). Admin keys only: any
// other key is told so.
import { html, useState, useEffect } from "./vendor/preact-htm.module.js";
import { call, NeedKey } from "./api.js";

const PERIODS = { "1d": 86400, "7d": 7 * 86400, "30d": 30 * 86400, "90d": 90 * 86400 };
const GROUPS = { "key,model": "key and model", key: "key", model: "model" };
const COUNTS = ["requests", "errors", "input_tokens", "output_tokens"];

// the period's day buckets summed per group, the most tokens first
function totals(rows, groups) {
  const out = new Map();
  for (const r of rows) {
    const id = JSON.stringify(groups.map((g) => r[g]));
    if (!out.has(id)) out.set(id, { ...Object.fromEntries(groups.map((g) => [g, r[g]])), requests: 0, errors: 0, input_tokens: 0, output_tokens: 0 });
    const t = out.get(id);
    for (const c of COUNTS) t[c] += r[c] || 0;
  }
  return [...out.values()].sort((a, b) => (b.input_tokens + b.output_tokens) - (a.input_tokens + a.output_tokens));
}

export function Usage({ onAuthError }) {
  const [period, setPeriod] = useState("7d");
  const [group, setGroup] = useState("key,model");
  const [rows, setRows] = useState(null);
  const [err, setErr] = useState("");

  const load = async () => {
    const end = Math.ceil(Date.now() / 1000) + 1;
    try {
      const got = await call(`/v1/usage?start=${end - PERIODS[period]}&end=${end}&group_by=${group}&bucket=day`);
      setRows(totals(got.data, got.group_by)); setErr("");
    } catch (e) { e instanceof NeedKey ? onAuthError() : setErr(String(e.message)); }
  };
  useEffect(() => { load(); }, [period, group]);

  const groups = group.split(",");
  const sum = (c) => (rows || []).reduce((n, r) => n + r[c], 0);
  return html`<div class="card">
    <div class="row" style="margin-bottom:.6rem">
      <select name="period" value=${period} onChange=${(e) => setPeriod(e.target.value)}>
        ${Object.keys(PERIODS).map((p) => html`<option value=${p}>last ${p}</option>`)}</select>
      <select name="group" value=${group} onChange=${(e) => setGroup(e.target.value)}>
        ${Object.entries(GROUPS).map(([v, label]) => html`<option value=${v}>by ${label}</option>`)}</select>
      <button onClick=${load}>Refresh</button>
    </div>
    ${err && html`<p class="err" data-testid="usage-error">${err}</p>`}
    ${rows && html`<table data-testid="usage"><tr>${groups.map((g) => html`<th>${g === "key" ? "Key" : "Model"}</th>`)}
      <th class="num">Requests</th><th class="num">Errors</th><th class="num">Input tokens</th><th class="num">Output tokens</th></tr>
      ${rows.map((r) => html`<tr data-key=${r.key ?? ""} data-model=${r.model ?? ""}>
        ${groups.map((g) => html`<td>${r[g] || html`<span class="muted">–</span>`}</td>`)}
        ${COUNTS.map((c) => html`<td class="num">${r[c]}</td>`)}</tr>`)}
      ${rows.length > 1 && html`<tr class="total"><td colspan=${groups.length}>total</td>
        ${COUNTS.map((c) => html`<td class="num">${sum(c)}</td>`)}</tr>`}
    </table>`}
    ${rows && !rows.length && html`<p class="muted">No usage in the last ${period}.</p>`}
  </div>`;
}
