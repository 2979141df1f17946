// Talking to `tformer serve`: the API key, JSON requests, OpenAI-shaped errors and server-sent event streams.

const KEY_STORAGE = "tformer.apiKey";

export const apiKey = {
  get() {
    return localStorage.getItem(KEY_STORAGE) || "";
  },
  set(key) {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  },
};

// An error to show on the page: the HTTP status (0 when the server did not answer) and a readable message.
export class ApiError extends Error {
  constructor(status, message, param = null) {
    super(message);
    this.status = status;
    this.param = param;
  }

  // What the page shows: what went wrong, in words, and the server's own message.
  describe() {
    if (this.status === 0) return `Could not reach the server: ${this.message}`;
    if (this.status === 401) return `The server wants an API key (401): ${this.message}`;
    if (this.status >= 500) return `Server error (${this.status}): ${this.message}`;
    const where = this.param ? ` [${this.param}]` : "";
    return `The server refused the request (${this.status})${where}: ${this.message}`;
  }
}

export function describeError(err) {
  if (err instanceof ApiError) return err.describe();
  return `Something went wrong in the page: ${err && err.message ? err.message : err}`;
}

// fetch with the API key; resolves to the Response when it is 2xx, else throws an ApiError from its body.
export async function request(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  const key = apiKey.get();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, `${err.message || err} (is \`tformer serve\` still running?)`);
  }
  if (!response.ok) {
    const error = await errorFrom(response);
    if (error.status === 401) window.dispatchEvent(new CustomEvent("tformer:unauthorized", { detail: error }));
    throw error;
  }
  return response;
}

export async function getJSON(path, options) {
  return (await request(path, options)).json();
}

// The ApiError a non-2xx response describes: OpenAI's {"error": {"message", "param"}} or whatever text it has.
async function errorFrom(response) {
  const text = await response.text().catch(() => "");
  try {
    const error = JSON.parse(text).error;
    if (error && error.message) return new ApiError(response.status, error.message, error.param || null);
  } catch (_) {
    // not JSON: a proxy's page, a crash
  }
  const detail = text.trim().slice(0, 300) || response.statusText || "no details";
  return new ApiError(response.status, detail);
}

// The JSON payloads of a server-sent event stream, one at a time, until `data: [DONE]`; an `{"error": ...}` event
// throws. One at a time, so that a caller draws each token as it comes, even when a network read brings several.
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const parts = buffer.split("\n\n");
    buffer = parts.pop();
    for (const part of parts) {
      for (const line of part.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new ApiError(500, payload.error.message || "the stream failed");
        yield payload;
      }
    }
  }
  throw new ApiError(0, "the stream ended before [DONE]: the server closed the connection");
}
