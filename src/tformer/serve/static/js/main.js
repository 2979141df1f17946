// The playground's start: ask the server what it serves (GET /v1/playground), ask for the API key while it
// answers 401, then offer the views that fit: chat for a decoder, translate for an encoder-decoder, runs when the
// server was started with --runs.

import { ApiError, apiKey, describeError, getJSON } from "./api.js";
import { ChatView } from "./chat.js";
import { RunsView } from "./runs.js";
import { TranslateView } from "./translate.js";

const $ = (id) => document.getElementById(id);
const views = {};
let started = false;

function showKeyDialog(message) {
  $("key-dialog").hidden = false;
  $("key-message").textContent = message;
  $("key-input").value = apiKey.get();
  $("key-input").focus();
}

function bindKeyDialog() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey.set($("key-input").value.trim());
    $("key-dialog").hidden = true;
    if (!started) connect();
  });
  $("key-forget").addEventListener("click", () => {
    apiKey.set("");
    $("key-input").value = "";
  });
  $("key-button").addEventListener("click", () => {
    const dialog = $("key-dialog");
    if (dialog.hidden) showKeyDialog(apiKey.get() ? "A key is saved in this browser." : "No key is saved.");
    else dialog.hidden = true;
  });
  window.addEventListener("tformer:unauthorized", (event) => showKeyDialog(event.detail.describe()));
}

function choose(name) {
  for (const button of $("tabs").querySelectorAll("button")) {
    button.classList.toggle("active", button.dataset.view === name);
  }
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== `view-${name}`;
  if (views.runs) {
    if (name === "runs") views.runs.start();
    else views.runs.stop();
  }
  history.replaceState(null, "", `#${name}`);
}

async function connect() {
  $("banner").hidden = true;
  $("loading").hidden = false;
  let info;
  try {
    info = await getJSON("/v1/playground");
  } catch (err) {
    $("loading").hidden = true;
    if (!(err instanceof ApiError && err.status === 401)) {
      $("banner").textContent = describeError(err);
      $("banner").hidden = false;
    }
    return;
  }
  started = true;
  $("loading").hidden = true;
  if (info.model) {
    const context = info.max_model_len ? `, ${info.max_model_len}-token context` : "";
    $("model-name").textContent = `${info.model} (${info.family}${context})`;
  }
  if (info.family === "decoder" && info.text) views.chat = new ChatView(info);
  if (info.family === "encoder-decoder" && info.text) views.translate = new TranslateView(info);
  if (info.runs) views.runs = new RunsView();
  const names = Object.keys(views);
  if (!names.length) {
    $("banner").textContent =
      `This server has nothing the playground can show: the model is a ${info.family} model ` +
      "(chat needs a decoder with a tokenizer, translation an encoder-decoder) and no --runs directory was given.";
    $("banner").hidden = false;
    return;
  }
  for (const button of $("tabs").querySelectorAll("button")) {
    button.hidden = !(button.dataset.view in views);
    button.addEventListener("click", () => choose(button.dataset.view));
  }
  const wanted = location.hash.slice(1);
  choose(names.includes(wanted) ? wanted : names[0]);
}

bindKeyDialog();
connect();
