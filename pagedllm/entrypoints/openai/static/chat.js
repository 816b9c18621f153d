// pagedllm's chat page: plain JavaScript, no build step, no third-party code.
//
// It talks to the server's own OpenAI API: GET /v1/models for the model list and
// POST /v1/chat/completions with stream=true, reading the server-sent events from the
// response body.  Stop aborts the fetch; the server sees the disconnect and aborts the
// request in the engine (docs/server.md).  With --api-key the page asks for the key and
// keeps it in this tab's sessionStorage; every call sends it as a Bearer token.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pagedllm-api-key";
const conversation = [];  // {role, content} of finished turns, sent with every request
let controller = null;    // the AbortController of the streaming request, if any

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    setStatus("server unreachable: " + e.message, true);
    return;
  }
  if (response.status === 401) {
    $("key-box").hidden = false;
    setStatus("This server needs an API key.", true);
    return;
  }
  if (!response.ok) {
    setStatus(await errorText(response), true);
    return;
  }
  const body = await response.json();
  const select = $("model");
  select.replaceChildren(...body.data.map((m) => {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.max_model_len ? `${m.id} (${m.max_model_len} tokens)` : m.id;
    return option;
  }));
  // A max_tokens that leaves no room for the prompt would be refused: halve the context.
  const limit = body.data.length ? body.data[0].max_model_len : null;
  if (limit && Number($("max-tokens").value) >= limit) {
    $("max-tokens").value = Math.max(1, Math.floor(limit / 2));
  }
  $("key-box").hidden = true;
  setStatus("ready");
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(label, content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function numberOr(id, fallback) {
  const v = $(id).value.trim();
  return v === "" ? fallback : Number(v);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true },
    temperature: numberOr("temperature", 0.7),
    top_p: numberOr("top-p", 1),
    max_tokens: numberOr("max-tokens", 256),
  };
  const topK = numberOr("top-k", -1);
  if (topK !== -1) body.top_k = topK;
  const penalty = numberOr("repetition-penalty", 1);
  if (penalty !== 1) body.repetition_penalty = penalty;
  const seed = numberOr("seed", null);
  if (seed !== null) body.seed = seed;
  return body;
}

function tokens(n) {
  return `${n} ${n === 1 ? "token" : "tokens"}`;
}

function showStats(s) {
  const parts = [];
  if (s.prompt !== null) parts.push(`prompt ${tokens(s.prompt)}`);
  parts.push(`${tokens(s.completion)} generated`);
  if (s.firstTokenAt !== null) {
    parts.push(`first token ${((s.firstTokenAt - s.start) / 1000).toFixed(2)} s`);
    const seconds = (performance.now() - s.firstTokenAt) / 1000;
    if (s.completion > 1 && seconds > 0) {
      parts.push(`${((s.completion - 1) / seconds).toFixed(1)} tok/s`);
    }
  }
  if (s.finish) parts.push(`finish: ${s.finish}`);
  $("stats").textContent = parts.join(" · ");
}

// Calls onEvent(parsed JSON) for every "data:" event of an SSE body until [DONE].
async function readEvents(response, onEvent) {
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
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("model").disabled = busy;
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  if (!$("model").value) {
    setStatus("no model loaded", true);
    return;
  }
  $("prompt").value = "";
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  const content = box.querySelector(".content");
  const stats = { start: performance.now(), firstTokenAt: null, prompt: null, completion: 0,
                  finish: null };
  controller = new AbortController();
  setBusy(true);
  setStatus("generating…");
  let reply = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) {
        stats.prompt = chunk.usage.prompt_tokens;
        stats.completion = chunk.usage.completion_tokens;
      }
      for (const choice of chunk.choices || []) {
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          if (stats.firstTokenAt === null) stats.firstTokenAt = performance.now();
          reply += delta;
          content.textContent = reply;
          box.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) stats.finish = choice.finish_reason;
      }
      showStats(stats);
    });
    box.dataset.finish = stats.finish || "";
    setStatus("ready");
  } catch (e) {
    if (e.name === "AbortError") {
      stats.finish = "stopped";
      box.dataset.finish = "stopped";
      setStatus("stopped");
    } else {
      box.classList.add("error");
      content.textContent = reply + (reply ? "\n" : "") + "Error: " + e.message;
      box.dataset.finish = "error";
      setStatus(e.message, true);
    }
  } finally {
    const finish = document.createElement("div");
    finish.className = "finish";
    finish.textContent = stats.finish ? `finish: ${stats.finish}` : "";
    box.append(finish);
    showStats(stats);
    // A stopped reply stays in the conversation: the next turn continues from it.
    if (reply) conversation.push({ role: "assistant", content: reply });
    controller = null;
    setBusy(false);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
    $("stats").textContent = "";
  });
  $("key-save").addEventListener("click", () => {
    sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadModels();
  });
  loadModels();
});
