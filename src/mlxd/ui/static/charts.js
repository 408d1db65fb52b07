// Live charts from /ui/api/stats (the server samples its own counters every couple of
// seconds; see mlxd/observability/history.py). uPlot is loaded as a classic script.
import { html, useEffect, useRef, useState } from "./vendor/preact-htm.module.js";
import { call, NeedKey } from "./api.js";

const WINDOW_S = 300;  // what the charts show: the last five minutes
const COLORS = ["#2563eb", "#16a34a", "#d97706", "#dc2626", "#7c3aed"];

// Each chart: its series, how to read one point, and a one-line summary of the window.
const CHARTS = [
  { id: "tokens", title: "Tokens/s", series: ["generated", "prompt"],
    values: (p) => [p.tokens_per_s, p.prompt_tokens_per_s] },
  { id: "ttft", title: "Time to first token (ms)", series: ["mean TTFT"],
    values: (p) => [p.ttft_ms] },
  { id: "queue", title: "Queue depth", series: ["running", "waiting"],
    values: (p) => [p.running, p.waiting] },
  { id: "status", title: "Requests by status (per interval)", series: ["2xx", "4xx", "5xx"],
    values: (p) => ["2xx", "4xx", "5xx"].map((c) => (p.requests || {})[c] || 0) },
];

function Chart({ spec, points }) {
  const el = useRef(null);
  const plot = useRef(null);
  const data = [points.map((p) => p.t), ...spec.series.map((_, i) => points.map((p) => spec.values(p)[i]))];
  useEffect(() => {
    const width = Math.max(el.current.clientWidth, 280);
    plot.current = new window.uPlot({
      width, height: 160,
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(hi || 0, 1)] } },
      axes: [{ stroke: "#888" }, { stroke: "#888", size: 60 }],
      series: [{}, ...spec.series.map((label, i) => ({ label, stroke: COLORS[i], width: 1.5, spanGaps: true }))],
      legend: { show: true },
    }, data, el.current);
    const onResize = () => plot.current.setSize({ width: Math.max(el.current.clientWidth, 280), height: 160 });
    window.addEventListener("resize", onResize);
    return () => { window.removeEventListener("resize", onResize); plot.current.destroy(); };
  }, []);
  useEffect(() => { if (plot.current) plot.current.setData(data); }, [points]);
  // per series over the window: the peak, shown for a glance, and the sum (data-sum), which
  // any new traffic raises where the peak need not (what the tests read)
  const sums = spec.series.map((label, i) => {
    const vals = data[i + 1].filter((v) => v != null);
    const peak = vals.length ? Math.max(...vals) : 0;
    const sum = vals.reduce((a, v) => a + v, 0);
    return html`<span data-series=${label} data-peak=${peak} data-sum=${sum}>${label} peak ${+peak.toFixed(2)}</span>`;
  });
  return html`<div class="card" data-chart=${spec.id} data-points=${points.length}>
    <div class="chart-title"><strong>${spec.title}</strong><span class="muted row">${sums}</span></div>
    <div ref=${el}></div></div>`;
}

export function Charts({ onAuthError }) {
  const [points, setPoints] = useState([]);
  useEffect(() => {
    let last = 0, stop = false;
    const tick = async () => {
      try {
        const r = await call(`/ui/api/stats?since=${last}`);
        if (r.points.length) {
          last = r.points[r.points.length - 1].t;
          setPoints((old) => [...old, ...r.points].filter((p) => p.t > last - WINDOW_S));
        }
      } catch (e) { if (e instanceof NeedKey) onAuthError(); }
      if (!stop) timer = setTimeout(tick, 2000);
    };
    let timer = setTimeout(tick, 0);
    return () => { stop = true; clearTimeout(timer); };
  }, []);
  // data-last: the server time of the newest point, so a reader knows which traffic is in
  const last = points.length ? points[points.length - 1].t : 0;
  return html`<div class="grid charts" data-testid="charts" data-last=${last}>
    ${CHARTS.map((c) => html`<${Chart} key=${c.id} spec=${c} points=${points} />`)}</div>`;
}
