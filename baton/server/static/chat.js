// The chat page: a conversation kept here, sent whole to /v1/chat/completions and streamed back.
// Model text is only ever set as textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "baton.chat.";  // localStorage keys: the API key and the settings
const SETTINGS = ["api-key", "system", "temperature", "max-tokens"];

const state = { model: null, messages: [], controller: null };

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// An error body in OpenAI's shape, as an Error naming the server's message.
async function apiError(response) {
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  if (response.status === 401) {
    showSettings(true);
    $("api-key").focus();
    message = `${message} (enter the server's API key in Settings)`;
  }
  return new Error(message);
}

async function loadModel() {
  try {
    const r = await fetch("v1/models", { headers: headers() });
    if (!r.ok) throw await apiError(r);
    const body = await r.json();
    state.model = body.data[0].id;
    $("model").textContent = state.model;
    notice("");
  } catch (e) {
    $("model").textContent = "(not connected)";
    notice(e.message);
  }
}

function showSettings(open) {
  $("settings").hidden = !open;
  $("toggle-settings").setAttribute("aria-expanded", String(open));
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("new-chat").disabled = busy;
}

function messageNode(m, last) {
  const node = document.createElement("div");
  node.className = `msg ${m.role}`;
  node.dataset.status = m.status || "done";
  if (m.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    details.open = m.reasoningOpen ?? m.status === "streaming";
    details.addEventListener("toggle", () => { m.reasoningOpen = details.open; });
    const summary = document.createElement("summary");
    summary.textContent = m.status === "streaming" && !m.content ? "Thinking…" : "Thoughts";
    const pre = document.createElement("pre");
    pre.textContent = m.reasoning;
    details.append(summary, pre);
    node.append(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = m.error ? `Error: ${m.error}` : m.content;
  node.append(content);
  if (m.role === "assistant" && m.status !== "streaming") {
    const meta = document.createElement("div");
    meta.className = "meta";
    const facts = [];
    if (m.status === "stopped") facts.push("stopped");
    if (m.finish && m.finish !== "stop") facts.push(`finish: ${m.finish}`);
    if (m.tokens) facts.push(`${m.tokens} tokens, ${m.rate.toFixed(1)} tok/s`);
    const span = document.createElement("span");
    span.textContent = facts.join(" · ");
    meta.append(span);
    if (last) {
      const again = document.createElement("button");
      again.type = "button";
      again.className = "regenerate";
      again.textContent = "Regenerate";
      again.addEventListener("click", regenerate);
      meta.append(again);
    }
    node.append(meta);
  }
  return node;
}

function render() {
  const box = $("messages");
  const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  box.replaceChildren(...state.messages.map((m, i) => messageNode(m, i === state.messages.length - 1 && !state.controller)));
  if (stick) box.scrollTop = box.scrollHeight;
}

// During a stream only the reply's own node changes.
function renderLast() {
  const box = $("messages");
  const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  box.lastChild.replaceWith(messageNode(state.messages[state.messages.length - 1], false));
  if (stick) box.scrollTop = box.scrollHeight;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of state.messages) {
    if (m.role === "user" || (m.content && !m.error)) messages.push({ role: m.role, content: m.content });
  }
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (state.model) body.model = state.model;  // none yet: the server's one
  const temperature = parseFloat($("temperature").value);
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

// Server-sent events of a streamed chat completion, each `data:` payload parsed.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function generate() {
  const reply = { role: "assistant", content: "", reasoning: "", status: "streaming", chunks: 0 };
  const body = requestBody();
  state.messages.push(reply);
  state.controller = new AbortController();
  setBusy(true);
  render();
  const start = performance.now();
  try {
    const r = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!r.ok) throw await apiError(r);
    if (!state.model) loadModel();
    for await (const event of events(r)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) reply.tokens = event.usage.completion_tokens;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      reply.content += choice.delta.content || "";
      reply.reasoning += choice.delta.reasoning_content || "";
      if (choice.finish_reason) reply.finish = choice.finish_reason;
      reply.chunks += 1;
      $("messages").dataset.chunks = String(reply.chunks);
      renderLast();
    }
    reply.status = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      reply.status = "stopped";
    } else {
      reply.status = "error";
      reply.error = e.message;
    }
  } finally {
    reply.rate = reply.tokens ? reply.tokens / ((performance.now() - start) / 1000) : 0;
    state.controller = null;
    setBusy(false);
    render();
  }
}

function regenerate() {
  if (state.controller) return;
  if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") state.messages.pop();
  if (state.messages.length) generate();
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  generate();
}

function init() {
  for (const id of SETTINGS) {
    const saved = localStorage.getItem(STORE + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => {
      localStorage.setItem(STORE + id, $(id).value);
      if (id === "api-key") loadModel();
    });
  }
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => { state.messages = []; render(); });
  $("toggle-settings").addEventListener("click", () => showSettings($("settings").hidden));
  loadModel();
}

init();
