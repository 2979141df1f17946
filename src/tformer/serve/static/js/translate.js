// The translate view: a sentence to POST /v1/translations (beam size, alpha), the translation, and its
// cross-attention map as a heat map of output tokens (rows) over source tokens (columns). The map is one layer
// and head of the weights the server returns, or their mean over layers and/or heads (the default: both).

import { describeError, getJSON } from "./api.js";

const $ = (id) => document.getElementById(id);
const MEAN = "mean";

// viridis at eleven stops, interpolated: dark (no attention) to yellow (all of it)
const VIRIDIS = [
  [68, 1, 84], [72, 35, 116], [64, 67, 135], [52, 94, 141], [41, 120, 142], [32, 144, 140],
  [34, 167, 132], [68, 190, 112], [121, 209, 81], [189, 222, 38], [253, 231, 37],
];

export function colour(t) {
  const x = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2);
  const f = x - i;
  const rgb = VIRIDIS[i].map((c, k) => Math.round(c + f * (VIRIDIS[i + 1][k] - c)));
  return `rgb(${rgb.join(", ")})`;
}

// The (output x source) matrix of `weights` [layer][head][output][source] for one layer and head; MEAN for either
// averages over it, as the mean of every (layer, head) map chosen.
export function selectMap(weights, layer, head) {
  const layers = layer === MEAN ? weights.map((_, i) => i) : [Number(layer)];
  const heads = head === MEAN ? weights[0].map((_, i) => i) : [Number(head)];
  const first = weights[layers[0]][heads[0]];
  const sum = first.map((row) => row.map(() => 0));
  for (const l of layers) {
    for (const h of heads) {
      weights[l][h].forEach((row, t) => row.forEach((w, s) => (sum[t][s] += w)));
    }
  }
  const n = layers.length * heads.length;
  return sum.map((row) => row.map((w) => w / n));
}

function label(token) {
  if (!token.trim()) return token.length ? "␣" : "∅";
  return token;
}

export class TranslateView {
  constructor(info) {
    this.info = info;
    this.result = null;
    $("translate-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.translate();
    });
    $("layer").addEventListener("change", () => this.drawMap());
    $("head").addEventListener("change", () => this.drawMap());
  }

  async translate() {
    $("translate-error").hidden = true;
    const input = $("source").value;
    if (!input.trim()) return this.showError("The source sentence is empty: type the sentence to translate.");
    const beam = Number($("beam-size").value);
    const alpha = Number($("alpha").value);
    if (!Number.isInteger(beam) || beam < 1 || beam > 16) return this.showError("beam size must be 1 to 16.");
    if (!Number.isFinite(alpha) || alpha < 0) return this.showError("alpha must be a number of at least 0.");
    $("translate").disabled = true;
    $("translate-stats").textContent = "translating…";
    const started = performance.now();
    try {
      const body = { input, beam_size: beam, alpha };
      this.result = await getJSON("/v1/translations", { method: "POST", body });
      const seconds = (performance.now() - started) / 1000;
      $("translate-stats").textContent =
        `${this.result.usage.completion_tokens} tokens from ${this.result.usage.prompt_tokens} in ${seconds.toFixed(2)} s`;
      this.show();
    } catch (err) {
      $("translate-stats").textContent = "";
      this.showError(describeError(err));
    } finally {
      $("translate").disabled = false;
    }
  }

  show() {
    const { translation, attention } = this.result;
    $("translation").textContent = translation || "(an empty translation)";
    fill($("layer"), attention.length, "layer", "all layers (mean)");
    fill($("head"), attention[0].length, "head", "all heads (mean)");
    $("translate-result").hidden = false;
    this.drawMap();
  }

  drawMap() {
    if (!this.result) return;
    const { attention, source_tokens: source, output_tokens: output } = this.result;
    const map = selectMap(attention, $("layer").value, $("head").value);
    const top = map.flat().reduce((a, b) => Math.max(a, b), 1e-9);
    $("map-scale").textContent = `colour: 0 (dark) to ${top.toFixed(3)} (yellow), the largest weight shown`;
    const table = document.createElement("table");
    table.className = "heatmap";
    const head = table.createTHead().insertRow();
    head.append(document.createElement("th"));
    for (const token of source) {
      const th = document.createElement("th");
      th.className = "src";
      th.dataset.token = token;
      const span = document.createElement("span");
      span.textContent = label(token);
      th.append(span);
      head.append(th);
    }
    const body = table.createTBody();
    map.forEach((row, t) => {
      const tr = body.insertRow();
      const th = document.createElement("th");
      th.className = "out";
      th.dataset.token = output[t];
      th.textContent = label(output[t]);
      tr.append(th);
      row.forEach((w, s) => {
        const td = tr.insertCell();
        td.className = "cell";
        td.dataset.weight = String(w);
        td.style.backgroundColor = colour(w / top);
        td.title = `${label(output[t])} → ${label(source[s])}: ${w.toFixed(4)}`;
      });
    });
    $("heatmap").replaceChildren(table);
  }

  showError(message) {
    $("translate-error").textContent = message;
    $("translate-error").hidden = false;
  }
}

// A <select> of MEAN and then 0..n-1, labelled from 1, keeping the current choice when it still exists.
function fill(select, n, name, meanLabel) {
  const keep = select.value;
  select.replaceChildren();
  select.append(new Option(meanLabel, MEAN));
  for (let i = 0; i < n; i++) select.append(new Option(`${name} ${i + 1}`, String(i)));
  select.value = keep && (keep === MEAN || Number(keep) < n) ? keep : MEAN;
}
