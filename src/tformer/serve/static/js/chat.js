// The chat view: a conversation streamed from /v1/chat/completions (or /v1/completions for a model without a chat
// template), rendered as markdown, with live token counts, a Stop button that aborts the request on the server
// (closing the stream makes the server free its KV blocks), sampling settings and regeneration.

import { describeError, events, request } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);

export class ChatView {
  constructor(info) {
    this.info = info;
    this.messages = []; // {role, content} as sent to the server
    this.controller = null;
    this.bind();
    if (!info.chat_template) {
      $("chat-mode").hidden = false;
      $("chat-mode").textContent =
        "This model has no chat template: each message is continued as plain text (/v1/completions).";
    }
    this.showContext(0);
    if (info.max_model_len) $("max-tokens").value = Math.min(512, Math.floor(info.max_model_len / 2));
  }

  bind() {
    $("chat-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("regenerate").addEventListener("click", () => this.regenerate());
    $("new-chat").addEventListener("click", () => this.reset());
    for (const [input, output] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
      $(input).addEventListener("input", () => ($(output).textContent = $(input).value));
    }
    $("raw").addEventListener("change", () => this.redraw());
  }

  get busy() {
    return this.controller !== null;
  }

  send() {
    if (this.busy) return;
    const text = $("prompt").value;
    if (!text.trim()) {
      this.showError("The message is empty: type something to send.");
      return;
    }
    const settings = this.settings();
    if (typeof settings === "string") {
      this.showError(settings);
      return;
    }
    $("prompt").value = "";
    this.messages.push({ role: "user", content: text });
    this.appendMessage("user", text);
    this.generate(settings);
  }

  regenerate() {
    if (this.busy || !this.messages.length) return;
    if (this.messages[this.messages.length - 1].role === "assistant") {
      this.messages.pop();
      $("messages").lastElementChild.remove();
    }
    const settings = this.settings();
    if (typeof settings === "string") this.showError(settings);
    else this.generate(settings);
  }

  reset() {
    this.stop();
    this.messages = [];
    $("messages").replaceChildren();
    this.hideError();
    $("regenerate").disabled = true;
    this.showContext(0);
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  // The sampling settings as request fields, or a message saying which one is wrong.
  settings() {
    const maxTokens = Number($("max-tokens").value);
    if (!Number.isInteger(maxTokens) || maxTokens < 1) return "max tokens must be a whole number of at least 1.";
    const body = {
      temperature: Number($("temperature").value),
      top_p: Number($("top-p").value),
      max_tokens: maxTokens,
    };
    const seed = $("seed").value.trim();
    if (seed) {
      if (!/^-?\d+$/.test(seed)) return "seed must be a whole number (or empty for a random one).";
      body.seed = Number(seed);
    }
    if ($("ignore-eos").checked) body.ignore_eos = true;
    return body;
  }

  requestBody(settings) {
    const stream = { stream: true, stream_options: { include_usage: true, continuous_usage_stats: true } };
    if (!this.info.chat_template) {
      return ["/v1/completions", { prompt: this.messages[this.messages.length - 1].content, ...settings, ...stream }];
    }
    const system = $("system").value.trim();
    const messages = system ? [{ role: "system", content: system }, ...this.messages] : this.messages;
    return ["/v1/chat/completions", { messages, ...settings, ...stream }];
  }

  async generate(settings) {
    this.hideError();
    const [path, body] = this.requestBody(settings);
    const view = this.appendMessage("assistant", "");
    view.root.classList.add("streaming");
    this.controller = new AbortController();
    this.setBusy(true);
    const run = { text: "", usage: null, finish: null, first: 0, last: 0 };
    try {
      const response = await request(path, { method: "POST", body, signal: this.controller.signal });
      for await (const chunk of events(response)) {
        if (this.take(chunk, run)) this.draw(view, run.text);
        this.showStats(run);
      }
      view.note.textContent = run.finish === "length" ? "stopped at max tokens" : "";
      this.finish(view, run);
    } catch (err) {
      if (err.name === "AbortError") {
        view.note.textContent = `stopped by you after ${run.usage ? run.usage.completion_tokens : 0} tokens`;
        this.finish(view, run);
      } else {
        this.showError(describeError(err));
        if (run.text) this.finish(view, run, "the answer broke off: see the error above");
        else this.takeBack(view);
      }
    } finally {
      view.root.classList.remove("streaming");
      this.controller = null;
      this.setBusy(false);
    }
  }

  finish(view, run, note) {
    if (note) view.note.textContent = note;
    this.draw(view, run.text);
    view.root.dataset.finish = run.finish || "";
    this.messages.push({ role: "assistant", content: run.text });
  }

  // A request that failed before any answer: its message goes back into the box, to be edited and sent again.
  takeBack(view) {
    view.root.remove();
    const last = this.messages[this.messages.length - 1];
    if (last && last.role === "user") {
      this.messages.pop();
      $("messages").lastElementChild.remove();
      if (!$("prompt").value) $("prompt").value = last.content;
    }
  }

  // One stream chunk: its text, its usage so far, its finish reason; true if it brought text.
  take(chunk, run) {
    const choice = chunk.choices && chunk.choices[0];
    const text = choice ? (choice.delta ? choice.delta.content : choice.text) : "";
    if (choice && choice.finish_reason) run.finish = choice.finish_reason;
    if (chunk.usage) run.usage = chunk.usage;
    if (!text) return false;
    run.text += text;
    const now = performance.now();
    if (!run.first) run.first = now;
    run.last = now;
    return true;
  }

  appendMessage(role, text) {
    const root = document.createElement("div");
    root.className = `message ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role === "user" ? "you" : this.info.model || "model";
    const content = document.createElement("div");
    content.className = "content";
    const note = document.createElement("div");
    note.className = "note";
    root.append(label, content, note);
    $("messages").append(root);
    const view = { root, content, note };
    if (role === "user") content.textContent = text;
    else this.draw(view, text);
    root.scrollIntoView({ block: "end" });
    return view;
  }

  draw(view, text) {
    const box = $("messages");
    const following = box.scrollHeight - box.scrollTop - box.clientHeight < 40; // the reader is at the newest text
    view.root.dataset.text = text;
    const raw = $("raw").checked;
    view.content.classList.toggle("raw", raw);
    if (raw) view.content.textContent = text;
    else renderMarkdown(text, view.content);
    if (following) box.scrollTop = box.scrollHeight;
  }

  redraw() {
    for (const root of $("messages").querySelectorAll(".message.assistant")) {
      this.draw({ root, content: root.querySelector(".content") }, root.dataset.text || "");
    }
  }

  showStats(run) {
    const tokens = run.usage ? run.usage.completion_tokens : 0;
    $("stat-tokens").textContent = `${tokens} token${tokens === 1 ? "" : "s"}`;
    const seconds = (run.last - run.first) / 1000;
    $("stat-speed").textContent = tokens > 1 && seconds > 0 ? `${((tokens - 1) / seconds).toFixed(1)} tok/s` : "– tok/s";
    if (run.usage) this.showContext(run.usage.total_tokens);
  }

  showContext(used) {
    const limit = this.info.max_model_len;
    $("stat-context").textContent = `${used} / ${limit}`;
    $("stat-context").title = `tokens in the context (prompt and answer) against the model's limit of ${limit}`;
  }

  setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("regenerate").disabled = busy || !this.messages.length;
  }

  showError(message) {
    $("chat-error").textContent = message;
    $("chat-error").hidden = false;
  }

  hideError() {
    $("chat-error").hidden = true;
  }
}
