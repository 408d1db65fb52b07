// The shell: API-key gate, header facts, and four views picked by the URL's hash.
import { html, render, useState, useEffect, useCallback } from "./vendor/preact-htm.module.js";
import { call, NeedKey, getKey, setKey, fmtDuration } from "./api.js";
import { Overview } from "./overview.js";
import { Playground } from "./playground.js";
import { Requests } from "./requests.js";
import { Usage } from "./usage.js";

const VIEWS = { overview: "Overview", playground: "Playground", requests: "Requests", usage: "Usage" };

function viewFromHash() {
  const v = location.hash.replace(/^#\/?/, "").split("/")[0];
  return VIEWS[v] ? v : "overview";
}

function KeyGate({ message, onKey }) {
  const [k, setK] = useState("");
  const submit = (e) => { e.preventDefault(); if (k.trim()) onKey(k.trim()); };
  return html`<main><div class="card" style="max-width:480px;margin:3rem auto">
    <h2>API key needed</h2>
    <p class="muted">This server has API keys configured. The key is kept in this browser
      tab's session storage only, and sent with each request the page makes.</p>
    ${message && html`<p class="err" data-testid="key-error">${message}</p>`}
    <form onSubmit=${submit} class="row">
      <input type="password" name="api-key" placeholder="API key" autocomplete="off"
        value=${k} onInput=${(e) => setK(e.target.value)} style="flex:1" />
      <button class="primary" type="submit">Use key</button>
    </form></div></main>`;
}

function App() {
  const [view, setView] = useState(viewFromHash());
  const [info, setInfo] = useState(null);
  const [needKey, setNeedKey] = useState(null);  // null: no; string: why
  const [error, setError] = useState("");

  const refresh = useCallback(async () => {
    try {
      setInfo(await call("/ui/api/overview"));
      setNeedKey(null); setError("");
    } catch (e) {
      if (e instanceof NeedKey) setNeedKey(getKey() ? "That key was refused." : "");
      else setError(String(e.message || e));
    }
  }, []);

  useEffect(() => {
    const onHash = () => setView(viewFromHash());
    window.addEventListener("hashchange", onHash);
    return () => window.removeEventListener("hashchange", onHash);
  }, []);
  useEffect(() => {
    refresh();
    const t = setInterval(() => { if (needKey === null) refresh(); }, 2000);
    return () => clearInterval(t);
  }, [refresh, needKey]);

  const onAuthError = useCallback(() => setNeedKey("That key was refused."), []);

  if (needKey !== null) {
    return html`<${Header} view=${view} info=${null} />
      <${KeyGate} message=${needKey} onKey=${(k) => { setKey(k); refresh(); }} />`;
  }
  return html`<${Header} view=${view} info=${info} />
    ${error && html`<p class="err pad" data-testid="app-error">${error}</p>`}
    <main>
      ${view === "overview" && html`<${Overview} info=${info} refresh=${refresh} onAuthError=${onAuthError} />`}
      ${view === "playground" && html`<${Playground} info=${info} onAuthError=${onAuthError} />`}
      ${view === "requests" && html`<${Requests} onAuthError=${onAuthError} />`}
      ${view === "usage" && html`<${Usage} onAuthError=${onAuthError} />`}
    </main>`;
}

function Header({ view, info }) {
  const h = info && info.health;
  // one string: htm drops whitespace that holds a line break, and with it the spaces
  // around the separators ("openblas· up 29s ·ok")
  const facts = info && [`v${info.version}`, `backend ${info.backend}`,
    `BLAS ${info.blas.split(" (")[0]}`, `up ${fmtDuration(h && h.uptime_s)}`].join(" · ");
  return html`<header>
    <h1>mlxd</h1>
    <nav>${Object.entries(VIEWS).map(([k, label]) =>
      html`<a href="#${k}" class=${view === k ? "active" : ""} data-view=${k}>${label}</a>`)}</nav>
    ${info && html`<span class="facts" data-testid="facts">${facts} · <span class=${h && h.status === "ok" ? "ok" : "err"}>${h ? h.status : "?"}</span>${getKey() && html` · <a href="#" onClick=${(e) => { e.preventDefault(); setKey(""); location.reload(); }}>forget key</a>`}</span>`}
  </header>`;
}

const root = document.getElementById("app");
root.textContent = "";  // the "Loading…" placeholder
render(html`<${App} />`, root);
