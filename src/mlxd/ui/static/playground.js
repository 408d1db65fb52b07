// Playground: streaming chat (OpenAI-compatible endpoint), images for vision models,
// reasoning and tool calls, JSON-schema mode, per-reply speed, "copy as"; embeddings and
// rerank try-outs.
import { html, useState, useRef, useEffect } from "./vendor/preact-htm.module.js";
import { call, streamSSE, NeedKey, getKey, copyText } from "./api.js";
import { asCurl, asPython, asOllama } from "./snippets.js";
import { requestLink } from "./requests.js";

// The models a picker offers: the store's, loaded ones the store does not list (a
// directory given to `mlxd serve --model`), and LoRA adapters (named for their base).
function byKind(info, kinds) {
  if (!info) return [];
  const seen = new Set(info.store.map((m) => m.name));
  const loaded = (info.health.models || []).filter((m) => !seen.has(m.name));
  return [...info.store, ...loaded, ...(info.adapters || [])].filter((m) => kinds.includes(m.kind));
}

function ModelPicker({ models, value, onChange, name }) {
  return html`<select name=${name} value=${value} onChange=${(e) => onChange(e.target.value)}>
    ${models.map((m) => html`<option value=${m.name}>${m.name} (${m.parent ? `adapter of ${m.parent}` : m.kind})</option>`)}</select>`;
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

function Reply({ m }) {
  return html`<div class="msg assistant" data-testid="reply">
    ${m.reasoning && html`<details data-testid="reasoning" open=${!m.content}><summary>reasoning</summary><span class="reasoning">${m.reasoning}</span></details>`}
    <span class="content">${m.content}</span>
    ${m.tool_calls && m.tool_calls.length > 0 && html`<div data-testid="tool-calls">
      ${m.tool_calls.map((t) => html`<pre>tool call: ${t.function.name}(${t.function.arguments})</pre>`)}</div>`}
    ${m.error && html`<p class="err">${m.error}</p>`}
    ${m.stats && html`<div class="meta" data-testid="reply-stats">
      ${m.stats.prompt_tokens ?? "?"} prompt + ${m.stats.completion_tokens ?? "?"} completion tokens
      · first token ${m.stats.ttft_ms} ms · ${m.stats.tok_s} tok/s · ${m.stats.finish || ""}${m.rid && html` · <a href=${requestLink(m.rid)} data-testid="reply-request">request ${m.rid.slice(0, 12)}</a>`}</div>`}
  </div>`;
}

function Chat({ info, onAuthError }) {
  const models = byKind(info, ["chat", "vision"]);
  const [model, setModel] = useState("");
  const [system, setSystem] = useState("");
  const [params, setParams] = useState({ temperature: 0.7, top_p: 1, max_tokens: 256, seed: "", priority: "" });
  const [stop, setStop] = useState("");
  const [schemaOn, setSchemaOn] = useState(false);
  const [schema, setSchema] = useState('{\n  "type": "object",\n  "properties": {"answer": {"type": "string"}},\n  "required": ["answer"]\n}');
  const [toolsOn, setToolsOn] = useState(false);
  const [toolChoice, setToolChoice] = useState("auto");
  const [parallel, setParallel] = useState(true);
  const [tools, setTools] = useState('[{"type": "function", "function": {"name": "get_weather",\n  "description": "Weather for a city",\n  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]');
  const [messages, setMessages] = useState([]);
  const [input, setInput] = useState("");
  const [images, setImages] = useState([]);
  const [busy, setBusy] = useState(false);
  const [drag, setDrag] = useState(false);
  const [snippet, setSnippet] = useState(null);
  const [err, setErr] = useState("");
  const abort = useRef(null);
  const list = useRef(null);
  const current = model || (models[0] && models[0].name) || "";
  const kind = (models.find((m) => m.name === current) || {}).kind;

  useEffect(() => { if (list.current) list.current.scrollTop = list.current.scrollHeight; }, [messages]);

  const addFiles = async (files) => {
    const imgs = [...files].filter((f) => f.type.startsWith("image/"));
    const urls = await Promise.all(imgs.map(readImage));
    setImages((old) => [...old, ...urls]);
  };

  const wire = (m) => m.images && m.images.length
    ? { role: m.role, content: [...m.images.map((u) => ({ type: "image_url", image_url: { url: u } })),
        { type: "text", text: m.content }] }
    : { role: m.role, content: m.content, ...(m.tool_calls ? { tool_calls: m.tool_calls } : {}) };

  const requestBody = (history) => {
    const body = { model: current, messages: [], stream: true, stream_options: { include_usage: true } };
    if (system.trim()) body.messages.push({ role: "system", content: system });
    body.messages.push(...history.map(wire));
    for (const k of ["temperature", "top_p", "max_tokens", "seed", "priority"]) {
      if (params[k] !== "" && params[k] != null && !Number.isNaN(Number(params[k]))) body[k] = Number(params[k]);
    }
    const stops = stop.split("\n").filter((s) => s.length);
    if (stops.length) body.stop = stops;
    if (schemaOn) body.response_format = { type: "json_schema", json_schema: { name: "output", schema: JSON.parse(schema) } };
    if (toolsOn) {
      body.tools = JSON.parse(tools);
      body.tool_choice = toolChoice;
      if (!parallel) body.parallel_tool_calls = false;
    }
    return body;
  };

  const send = async () => {
    if (busy || (!input.trim() && !images.length)) return;
    setErr("");
    const user = { role: "user", content: input, images };
    const history = [...messages.filter((m) => !m.error), user];
    let body;
    try { body = requestBody(history); } catch (e) { setErr(`bad JSON: ${e.message}`); return; }
    const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
    setMessages([...history, reply]);
    setInput(""); setImages([]); setBusy(true);
    const ctl = new AbortController(); abort.current = ctl;
    const t0 = performance.now();
    let tFirst = null, usage = null, finish = null, chunks = 0;
    const update = () => setMessages([...history, { ...reply }]);
    try {
      await streamSSE("/v1/chat/completions", body, (ev) => {
        if (ev.error) { reply.error = ev.error.message || JSON.stringify(ev.error); return; }
        if (ev.usage) usage = ev.usage;
        for (const c of ev.choices || []) {
          const d = c.delta || {};
          if (d.content || d.reasoning_content || d.tool_calls) { tFirst ??= performance.now(); chunks++; }
          if (d.content) reply.content += d.content;
          if (d.reasoning_content) reply.reasoning += d.reasoning_content;
          for (const tc of d.tool_calls || []) {
            const slot = reply.tool_calls[tc.index ?? 0] ||= { id: tc.id, type: "function", function: { name: "", arguments: "" } };
            if (tc.id) slot.id = tc.id;
            if (tc.function && tc.function.name) slot.function.name += tc.function.name;
            if (tc.function && tc.function.arguments) slot.function.arguments += tc.function.arguments;
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
        update();
      }, ctl.signal, (r) => {
        // the server's record of this request (its log line, its token counts: all that
        // is left of them after Stop, since no usage chunk comes then)
        reply.rid = r.headers.get("X-Request-ID");
      });
    } catch (e) {
      if (e instanceof NeedKey) onAuthError();
      else if (e.name !== "AbortError") reply.error = String(e.message || e);
      else finish = "stopped";
    }
    const t1 = performance.now();
    const n = usage ? usage.completion_tokens : chunks;
    // decode speed: tokens after the first over the time after it; when the server held
    // the text back (a tool call is sent once parsed) that span says nothing, so the
    // whole request's time counts instead
    const genS = tFirst != null ? (t1 - tFirst) / 1000 : 0;
    const speed = genS > 0.05 && n > 1 ? (n - 1) / genS : n / ((t1 - t0) / 1000);
    reply.stats = { prompt_tokens: usage && usage.prompt_tokens, completion_tokens: usage ? usage.completion_tokens : null,
      ttft_ms: tFirst != null ? Math.round(tFirst - t0) : "–",
      tok_s: n > 0 ? speed.toFixed(1) : "–", finish };
    if (!reply.tool_calls.length) delete reply.tool_calls;
    update(); setBusy(false); abort.current = null;
  };

  const onKey = (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  };
  const onPaste = (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (files.length) { e.preventDefault(); addFiles(files); }
  };
  const onDrop = (e) => { e.preventDefault(); setDrag(false); addFiles(e.dataTransfer.files); };

  const showSnippet = (which) => {
    let body;
    const pending = input.trim() || images.length ? [{ role: "user", content: input, images }] : [];
    try { body = requestBody([...messages.filter((m) => !m.error), ...pending]); } catch (e) { setErr(`bad JSON: ${e.message}`); return; }
    const make = { curl: asCurl, python: asPython, ollama: asOllama }[which];
    const text = make(location.origin, body, !!getKey());
    copyText(text).then((ok) => setSnippet({ which, text, copied: ok }));
  };

  const p = (k, label, step) => html`<label><span>${label}</span><input name=${k} type="number" step=${step}
    value=${params[k]} onInput=${(e) => setParams({ ...params, [k]: e.target.value })} /></label>`;

  return html`<div class="playground">
    <div class="card">
      <label><span>Model</span><${ModelPicker} name="model" models=${models} value=${current} onChange=${setModel} /></label>
      ${!models.length && html`<p class="muted">No chat model in the store: pull one on the Overview.</p>`}
      <label><span>System prompt</span><textarea name="system" rows="3" value=${system} onInput=${(e) => setSystem(e.target.value)}></textarea></label>
      <div class="row">${p("temperature", "temperature", "0.1")}${p("top_p", "top_p", "0.05")}</div>
      <div class="row">${p("max_tokens", "max_tokens", "1")}${p("seed", "seed", "1")}</div>
      <div class="row">${p("priority", "priority (lower first)", "1")}</div>
      <label><span>Stop strings (one a line)</span><textarea name="stop" rows="2" value=${stop} onInput=${(e) => setStop(e.target.value)}></textarea></label>
      <label class="row"><input type="checkbox" name="schema-on" checked=${schemaOn} onChange=${(e) => setSchemaOn(e.target.checked)} /> JSON schema</label>
      ${schemaOn && html`<textarea name="schema" rows="6" value=${schema} onInput=${(e) => setSchema(e.target.value)}></textarea>`}
      <label class="row"><input type="checkbox" name="tools-on" checked=${toolsOn} onChange=${(e) => setToolsOn(e.target.checked)} /> Tools</label>
      ${toolsOn && html`<textarea name="tools" rows="6" value=${tools} onInput=${(e) => setTools(e.target.value)}></textarea>
        <label><span>tool_choice</span><select name="tool-choice" value=${toolChoice} onChange=${(e) => setToolChoice(e.target.value)}>
          ${["auto", "required", "none"].map((c) => html`<option value=${c}>${c}</option>`)}</select></label>
        <label class="row"><input type="checkbox" name="parallel-tools" checked=${parallel} onChange=${(e) => setParallel(e.target.checked)} /> parallel tool calls</label>`}
      <p class="row"><span class="muted">Copy as</span>
        <button onClick=${() => showSnippet("curl")}>curl</button>
        <button onClick=${() => showSnippet("python")}>Python</button>
        <button onClick=${() => showSnippet("ollama")}>Ollama</button></p>
      ${snippet && html`<div data-testid="snippet"><div class="row muted">${snippet.which}${snippet.copied ? " (copied)" : ""}
        <button onClick=${() => setSnippet(null)}>close</button></div><pre>${snippet.text}</pre></div>`}
    </div>
    <div class="card">
      <div class="messages" ref=${list} data-testid="messages">
        ${messages.map((m) => m.role === "user"
          ? html`<div class="msg user">${(m.images || []).map((u) => html`<img src=${u} alt="attached image" />`)}<div>${m.content}</div></div>`
          : html`<${Reply} m=${m} />`)}
      </div>
      ${err && html`<p class="err">${err}</p>`}
      <div class=${"composer" + (drag ? " drag" : "")} onDragOver=${(e) => { e.preventDefault(); setDrag(true); }}
        onDragLeave=${() => setDrag(false)} onDrop=${onDrop}>
        ${images.length > 0 && html`<div class="thumbs" data-testid="attached">${images.map((u, i) => html`<img src=${u} alt="attached image"
          title="click to remove" onClick=${() => setImages(images.filter((_, j) => j !== i))} />`)}</div>`}
        <textarea name="prompt" rows="3" placeholder=${"Message " + (current || "") + " (Enter sends, Shift+Enter: new line" + (kind === "vision" ? "; drop or paste images)" : ")")}
          value=${input} onInput=${(e) => setInput(e.target.value)} onKeyDown=${onKey} onPaste=${onPaste}></textarea>
        <div class="row">
          <button class="primary" onClick=${send} disabled=${busy || !current}>Send</button>
          ${busy && html`<button onClick=${() => abort.current && abort.current.abort()}>Stop</button>`}
          <label class="row" style="margin:0"><span style="display:inline">Image</span>
            <input type="file" name="image" accept="image/*" multiple onChange=${(e) => { addFiles(e.target.files); e.target.value = ""; }} /></label>
          <button onClick=${() => setMessages([])} disabled=${busy}>Clear</button>
        </div>
      </div>
    </div></div>`;
}

function cosine(a, b) {
  let d = 0, na = 0, nb = 0;
  for (let i = 0; i < a.length; i++) { d += a[i] * b[i]; na += a[i] * a[i]; nb += b[i] * b[i]; }
  return d / (Math.sqrt(na * nb) || 1);
}

function Embeddings({ info, onAuthError }) {
  const models = byKind(info, ["embedding"]);
  const [model, setModel] = useState("");
  const [text, setText] = useState("The cat sat on the mat.\nA kitten rests on a rug.\nStock markets fell today.");
  const [out, setOut] = useState(null);
  const current = model || (models[0] && models[0].name) || "";
  const run = async () => {
    const inputs = text.split("\n").map((s) => s.trim()).filter(Boolean);
    try {
      const r = await call("/v1/embeddings", { method: "POST", body: { model: current, input: inputs } });
      const vecs = r.data.map((d) => d.embedding);
      setOut({ inputs, m: vecs.map((a) => vecs.map((b) => cosine(a, b))), dim: vecs[0] ? vecs[0].length : 0 });
    } catch (e) { e instanceof NeedKey ? onAuthError() : setOut({ error: String(e.message) }); }
  };
  return html`<div class="card"><h2>Embeddings: similarity matrix</h2>
    ${models.length ? html`<${ModelPicker} name="embed-model" models=${models} value=${current} onChange=${setModel} />`
      : html`<p class="muted">No embedding model in the store.</p>`}
    <label><span>One sentence a line</span><textarea name="sentences" rows="4" value=${text} onInput=${(e) => setText(e.target.value)}></textarea></label>
    <button class="primary" name="run-embed" onClick=${run} disabled=${!current}>Embed</button>
    ${out && out.error && html`<p class="err">${out.error}</p>`}
    ${out && out.m && html`<p class="muted">${out.dim} dimensions, cosine similarity</p>
      <table class="matrix" data-testid="similarity"><tr><th></th>${out.inputs.map((_, i) => html`<th>#${i + 1}</th>`)}</tr>
      ${out.m.map((row, i) => html`<tr><th title=${out.inputs[i]}>#${i + 1} ${out.inputs[i].slice(0, 30)}</th>
        ${row.map((v) => html`<td style="background:rgba(37,99,235,${Math.max(0, v) * 0.6})">${v.toFixed(3)}</td>`)}</tr>`)}</table>`}
  </div>`;
}

function Rerank({ info, onAuthError }) {
  const models = byKind(info, ["reranker", "chat"]);
  const [model, setModel] = useState("");
  const [query, setQuery] = useState("What do cats like?");
  const [docs, setDocs] = useState("Cats like to sleep in the sun.\nThe stock market closed higher.\nKittens chase balls of yarn.");
  const [out, setOut] = useState(null);
  const current = model || ((models.find((m) => m.kind === "reranker") || models[0] || {}).name) || "";
  const run = async () => {
    const documents = docs.split("\n").map((s) => s.trim()).filter(Boolean);
    try {
      const r = await call("/v1/rerank", { method: "POST", body: { model: current, query, documents } });
      setOut({ results: r.results });
    } catch (e) { e instanceof NeedKey ? onAuthError() : setOut({ error: String(e.message) }); }
  };
  return html`<div class="card"><h2>Rerank</h2>
    ${models.length ? html`<${ModelPicker} name="rerank-model" models=${models} value=${current} onChange=${setModel} />`
      : html`<p class="muted">No reranker in the store.</p>`}
    <label><span>Query</span><input name="query" value=${query} onInput=${(e) => setQuery(e.target.value)} style="width:100%" /></label>
    <label><span>Documents, one a line</span><textarea name="documents" rows="4" value=${docs} onInput=${(e) => setDocs(e.target.value)}></textarea></label>
    <button class="primary" name="run-rerank" onClick=${run} disabled=${!current}>Rank</button>
    ${out && out.error && html`<p class="err">${out.error}</p>`}
    ${out && out.results && html`<table data-testid="rerank"><tr><th class="num">Score</th><th>Document</th></tr>
      ${out.results.map((r) => html`<tr><td class="num">${r.relevance_score.toFixed(4)}</td><td>${r.document ? r.document.text : "#" + r.index}</td></tr>`)}</table>`}
  </div>`;
}

export function Playground({ info, onAuthError }) {
  const [tab, setTab] = useState("chat");
  return html`<div class="row tabs" style="margin-bottom:.8rem">
      ${[["chat", "Chat"], ["embed", "Embeddings"], ["rerank", "Rerank"]].map(([k, l]) =>
        html`<button class=${tab === k ? "active" : ""} data-tab=${k} onClick=${() => setTab(k)}>${l}</button>`)}</div>
    ${tab === "chat" && html`<${Chat} info=${info} onAuthError=${onAuthError} />`}
    ${tab === "embed" && html`<${Embeddings} info=${info} onAuthError=${onAuthError} />`}
    ${tab === "rerank" && html`<${Rerank} info=${info} onAuthError=${onAuthError} />`}`;
}
