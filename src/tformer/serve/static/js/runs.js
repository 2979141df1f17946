// The runs view: the training runs under `tformer serve --runs DIR`, and for the chosen one its loss, learning
// rate and dev BLEU (or perplexity) against the step, read from its metrics.jsonl. The page asks for the bytes
// after those it has, every POLL_MS, so a running training's curves grow as it logs.

import { describeError, getJSON } from "./api.js";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
export const POLL_MS = 1000;
const LIST_EVERY = 5; // polls between two refreshes of the list of runs

// Each chart: the kind of record it reads (told apart as tformer.viz.plots.read_metrics does), the key and title.
const CHARTS = [
  { kind: "loss", key: "loss", title: "training loss" },
  { kind: "loss", key: "lr", title: "learning rate" },
  { kind: "dev_bleu", key: "dev_bleu", title: "dev BLEU", dots: true },
  { kind: "dev_ppl", key: "dev_ppl", title: "dev perplexity", dots: true },
];

// Math.min / Math.max over an array of any length (spreading 100,000 arguments overflows the stack)
function extent(values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  return [lo, hi];
}

function kindOf(record) {
  return ["dev_bleu", "dev_ppl", "loss"].find((key) => key in record) || null;
}

function ago(seconds) {
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} days ago`;
}

function format(value) {
  if (value === 0) return "0";
  const abs = Math.abs(value);
  if (abs >= 1e4 || abs < 1e-3) return value.toExponential(2).replace(/\.?0+e/, "e"); // 5.00e-4 -> 5e-4
  return Number(value.toPrecision(4)).toString();
}

export class RunsView {
  constructor() {
    this.runs = [];
    this.run = null; // {id, offset, byKind: {kind: Map(step -> record)}}
    this.timer = null;
    this.polls = 0;
    this.active = false; // polling only while the view is shown
  }

  async start() {
    this.active = true;
    await this.refreshList();
    this.schedule();
  }

  stop() {
    this.active = false;
    clearTimeout(this.timer);
  }

  schedule() {
    clearTimeout(this.timer);
    if (this.active) this.timer = setTimeout(() => this.tick(), POLL_MS);
  }

  async tick() {
    this.polls += 1;
    if (this.polls % LIST_EVERY === 0) await this.refreshList();
    else await this.readRun();
    this.schedule();
  }

  async refreshList() {
    try {
      const answer = await getJSON("/v1/runs");
      $("runs-error").hidden = true;
      this.runs = answer.data;
      $("runs-root").textContent = `in ${answer.root}`;
      this.drawList();
      if (!this.run && this.runs.length) await this.select(this.runs[0].id);
      else if (this.run) await this.readRun();
      if (!this.runs.length) $("run-status").textContent = `No run under ${answer.root} has a metrics.jsonl yet.`;
    } catch (err) {
      this.showError(err);
    }
  }

  drawList() {
    const now = Date.now() / 1000;
    $("run-list").replaceChildren(
      ...this.runs.map((run) => {
        const li = document.createElement("li");
        const button = document.createElement("button");
        button.type = "button";
        button.dataset.run = run.id;
        button.classList.toggle("active", this.run !== null && this.run.id === run.id);
        button.append(run.id);
        if (run.running) {
          const dot = document.createElement("span");
          dot.className = "live";
          dot.title = "metrics.jsonl changed in the last two minutes";
          button.append(dot);
        }
        const when = document.createElement("span");
        when.className = "when";
        when.textContent = `updated ${ago(now - run.updated)}`;
        button.append(when);
        button.addEventListener("click", () => this.select(run.id));
        li.append(button);
        return li;
      }),
    );
  }

  async select(id) {
    this.run = { id, offset: 0, byKind: {} };
    this.drawList();
    $("run-title").textContent = id;
    $("run-charts").replaceChildren();
    await this.readRun();
  }

  async readRun() {
    const run = this.run;
    if (!run) return;
    try {
      const answer = await getJSON(`/v1/runs/${encodeURIComponent(run.id)}?offset=${run.offset}`);
      if (run !== this.run) return; // another run was chosen meanwhile
      $("runs-error").hidden = true;
      if (answer.reset) run.byKind = {};
      for (const record of answer.records) {
        const kind = kindOf(record);
        if (!kind) continue;
        (run.byKind[kind] ||= new Map()).set(record.step, record); // a resumed run's repeat: the last wins
      }
      const grew = answer.records.length > 0 || answer.reset || run.offset === 0;
      run.offset = answer.offset;
      const state = answer.running ? "running" : "finished or stopped";
      const last = run.byKind.loss ? extent(run.byKind.loss.keys())[1] : null;
      $("run-status").textContent =
        `${state}: metrics.jsonl updated ${ago(Date.now() / 1000 - answer.updated)}` +
        (last !== null ? `, last logged step ${last}` : "") +
        (answer.skipped ? `; ${answer.skipped} unreadable lines skipped` : "");
      if (grew) this.drawCharts();
    } catch (err) {
      this.showError(err);
    }
  }

  drawCharts() {
    const charts = [];
    for (const spec of CHARTS) {
      const byStep = this.run.byKind[spec.kind];
      if (!byStep) continue;
      const points = [...byStep.values()]
        .filter((r) => typeof r[spec.key] === "number")
        .map((r) => [r.step, r[spec.key]])
        .sort((a, b) => a[0] - b[0]);
      if (points.length) charts.push(chart(spec, points));
    }
    if (!charts.length) $("run-status").textContent += " (no loss or evaluation records yet)";
    $("run-charts").replaceChildren(...charts);
  }

  showError(err) {
    $("runs-error").textContent = describeError(err);
    $("runs-error").hidden = false;
  }
}

// About `count` round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi].
export function ticks(lo, hi, count = 5) {
  const raw = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((f) => f * power).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function svg(tag, attributes, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// One line chart of [step, value] points; the points themselves ride on the <svg> as data-steps / data-values.
function chart(spec, points) {
  const width = 420;
  const height = 220;
  const m = { left: 62, right: 24, top: 10, bottom: 28 };
  const xs = points.map((p) => p[0]);
  const ys = points.map((p) => p[1]);
  let [x0, x1] = extent(xs);
  let [y0, y1] = extent(ys);
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  if (y0 === y1) [y0, y1] = [y0 - Math.abs(y0 || 1) * 0.1, y1 + Math.abs(y1 || 1) * 0.1];
  const pad = (y1 - y0) * 0.05;
  [y0, y1] = [y0 - pad, y1 + pad];
  const px = (x) => m.left + ((x - x0) / (x1 - x0)) * (width - m.left - m.right);
  const py = (y) => height - m.bottom - ((y - y0) / (y1 - y0)) * (height - m.top - m.bottom);

  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" });
  root.dataset.metric = spec.key;
  root.dataset.steps = JSON.stringify(xs);
  root.dataset.values = JSON.stringify(ys);
  for (const y of ticks(y0, y1)) {
    root.append(svg("line", { class: "grid", x1: m.left, x2: width - m.right, y1: py(y), y2: py(y) }));
    root.append(svg("text", { x: m.left - 6, y: py(y) + 4, "text-anchor": "end" }, format(y)));
  }
  for (const x of ticks(x0, x1).filter(Number.isInteger)) {
    root.append(svg("text", { x: px(x), y: height - 8, "text-anchor": "middle" }, String(x)));
  }
  root.append(svg("line", { class: "axis", x1: m.left, x2: m.left, y1: m.top, y2: height - m.bottom }));
  root.append(svg("line", { class: "axis", x1: m.left, x2: width - m.right, y1: height - m.bottom, y2: height - m.bottom }));
  const line = svg("polyline", { class: "series", points: points.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ") });
  root.append(line);
  if (spec.dots || points.length === 1) {
    for (const [x, y] of points) {
      const dot = svg("circle", { class: "dot", cx: px(x), cy: py(y), r: 3 });
      dot.append(svg("title", {}, `step ${x}: ${format(y)}`));
      root.append(dot);
    }
  }
  const box = document.createElement("div");
  box.className = "chart";
  box.dataset.metric = spec.key;
  const title = document.createElement("h4");
  const [lastStep, lastValue] = points[points.length - 1];
  title.textContent = `${spec.title}: ${format(lastValue)} at step ${lastStep}`;
  box.append(title, root);
  return box;
}
