// ikcli's chat page: plain JavaScript, no build step, no external fetches.
// It sends the whole conversation to POST v1/chat/completions with "stream": true and renders the
// server-sent deltas as they arrive: `reasoning_content` in a collapsed <details> above the answer,
// `content` as the answer.  tokens/s comes from the `timings` object that ikcli (like llama-server)
// puts in each choice's last streamed chunk.
"use strict";

const $ = (id) => document.getElementById(id);
const els = {
  messages: $("messages"), input: $("input"), composer: $("composer"), send: $("send"), stop: $("stop"),
  newChat: $("new-chat"), system: $("system"), temperature: $("temperature"), apiKey: $("api-key"),
  model: $("model"), settings: $("settings"),
};

// ------------------------------------------------------------------------------------ settings
// kept in localStorage so that a reload (or the next visit) keeps them
const SETTINGS = { system: "ikcli.system", temperature: "ikcli.temperature", apiKey: "ikcli.apiKey" };

function storageGet(k) {
  try { return localStorage.getItem(k) || ""; } catch (e) { return ""; }
}
function storageSet(k, v) {
  try { if (v) localStorage.setItem(k, v); else localStorage.removeItem(k); } catch (e) { /* private mode */ }
}
for (const [name, key] of Object.entries(SETTINGS)) {
  els[name].value = storageGet(key);
  els[name].addEventListener("input", () => storageSet(key, els[name].value));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = els.apiKey.value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// ------------------------------------------------------------------------------------ state
let conversation = [];   // the {role, content} turns sent with the next request
let controller = null;   // the AbortController of the request in flight (null: idle)

function setBusy(busy) {
  els.send.disabled = busy;
  els.stop.disabled = !busy;
}

// ------------------------------------------------------------------------------------ view
function nearBottom() {
  const m = els.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 40;
}
function scrollDown(force) {
  if (force || nearBottom()) els.messages.scrollTop = els.messages.scrollHeight;
}

function addMessage(role, text) {
  const root = document.createElement("div");
  root.className = "msg " + role;
  root.dataset.role = role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  root.appendChild(label);
  const view = { root };
  if (role === "assistant") {
    // the reasoning block stays hidden until a reasoning delta comes, and collapsed (no `open`)
    view.reasoning = document.createElement("details");
    view.reasoning.className = "reasoning";
    view.reasoning.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    view.reasoningText = document.createElement("div");
    view.reasoningText.className = "reasoning-text";
    view.reasoning.append(summary, view.reasoningText);
    root.appendChild(view.reasoning);
  }
  view.content = document.createElement("div");
  view.content.className = "content";
  view.content.textContent = text || "";
  view.meta = document.createElement("div");
  view.meta.className = "meta";
  root.append(view.content, view.meta);
  els.messages.appendChild(root);
  scrollDown(true);
  return view;
}

function showError(view, text) {
  const box = document.createElement("div");
  box.className = "error";
  box.setAttribute("role", "alert");
  box.textContent = text;
  view.root.appendChild(box);
  scrollDown(true);
}

function speedLabel(timings, usage, clientMs) {
  if (timings && timings.predicted_per_second != null) {
    const label = `${timings.predicted_n} tokens, ${timings.predicted_per_second.toFixed(1)} tokens/s`;
    const title = `prompt: ${timings.prompt_n} tokens` + (timings.prompt_per_second != null
      ? `, ${timings.prompt_per_second.toFixed(1)} tokens/s` : "");
    return [label, title];
  }
  if (timings && timings.predicted_n === 0) return ["0 tokens", ""];
  // a server that sends no timings: measured here, from the first delta to the end of the stream,
  // over usage.completion_tokens (or the number of deltas, roughly one token each)
  if (usage && clientMs > 0) {
    const n = usage.completion_tokens;
    return [`${n} tokens, ${(1000 * n / clientMs).toFixed(1)} tokens/s (measured in the browser)`, ""];
  }
  return ["", ""];
}

// ------------------------------------------------------------------------------------ errors
class ServerError extends Error {}

async function errorOf(res) {
  // the server's errors are JSON in OpenAI's shape: {"error": {"code", "message", "type"}}
  let text = "";
  try { text = await res.text(); } catch (e) { /* the body could not be read */ }
  let message = text.trim();
  try {
    const j = JSON.parse(text);
    if (j && j.error) message = typeof j.error === "string" ? j.error : (j.error.message || JSON.stringify(j.error));
  } catch (e) { /* not JSON: the text as it is */ }
  let out = `Error ${res.status}${res.statusText ? " " + res.statusText : ""}` + (message ? `: ${message}` : "");
  if (res.status === 401) out += "\n(Set the server's API key under Settings.)";
  return new ServerError(out);
}

// ------------------------------------------------------------------------------------ streaming
// server-sent events: yields the data of each event ("[DONE]" included)
async function* sseData(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    buf += done ? decoder.decode() : decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).replace(/\r$/, "");
      buf = buf.slice(nl + 1);
      if (line === "") {
        if (data.length) yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }   // other fields (event:, id:, comments) are not used by this API
    }
    if (done) break;
  }
  if (data.length) yield data.join("\n");
}

async function send() {
  const text = els.input.value.trim();
  if (!text || controller) return;
  els.input.value = "";
  const conv = conversation;   // "New chat" while this runs starts another array: this one is left alone
  const userView = addMessage("user", text);
  conv.push({ role: "user", content: text });
  const view = addMessage("assistant");
  view.root.classList.add("pending");

  const messages = [];
  const system = els.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = { messages: messages.concat(conv), stream: true };
  const temp = els.temperature.value.trim();
  if (temp !== "" && Number.isFinite(Number(temp))) body.temperature = Number(temp);

  controller = new AbortController();
  setBusy(true);
  let content = "", reasoning = "", timings = null, usage = null, tFirst = null;
  try {
    const res = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) throw await errorOf(res);
    for await (const data of sseData(res)) {
      if (data === "[DONE]") break;
      let chunk;
      try { chunk = JSON.parse(data); } catch (e) { throw new ServerError(`Error: a stream chunk is not JSON: ${data}`); }
      if (chunk.error) {   // an error in the middle of the stream
        const e = chunk.error;
        throw new ServerError(`Error ${e.code || ""}: ${e.message || JSON.stringify(e)}`);
      }
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.reasoning_content) {
          tFirst = tFirst ?? performance.now();
          reasoning += d.reasoning_content;
          view.reasoning.hidden = false;
          view.reasoningText.textContent = reasoning;
        }
        if (d.content) {
          tFirst = tFirst ?? performance.now();
          content += d.content;
          view.content.textContent = content;
        }
      }
      if (chunk.timings) timings = chunk.timings;
      if (chunk.usage) usage = chunk.usage;
      scrollDown(false);
    }
    conv.push({ role: "assistant", content });
    const [label, title] = speedLabel(timings, usage, tFirst == null ? 0 : performance.now() - tFirst);
    view.meta.textContent = label;
    view.meta.title = title;
    view.meta.classList.add("speed");
  } catch (e) {
    if (e.name === "AbortError") {
      // Stop: the fetch is aborted, the server sees the disconnect and cancels the job
      view.meta.textContent = "stopped";
      view.root.classList.add("stopped");
      if (content) conv.push({ role: "assistant", content });
      else dropTurn(conv, userView, text);
    } else {
      showError(view, e instanceof ServerError ? e.message : `Error: ${e.message || e}`);
      dropTurn(conv, userView, text);
    }
  } finally {
    view.root.classList.remove("pending");
    controller = null;
    setBusy(false);
  }
}

// a user turn that got no answer leaves the conversation (two user turns in a row would follow);
// its text goes back to the input, to edit and send again
function dropTurn(conv, userView, text) {
  conv.pop();
  userView.root.classList.add("dropped");
  userView.root.title = "not part of the conversation: it got no answer";
  if (conv === conversation && !els.input.value) els.input.value = text;
}

// ------------------------------------------------------------------------------------ wiring
els.composer.addEventListener("submit", (e) => { e.preventDefault(); send(); });
els.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
els.newChat.addEventListener("click", () => {
  if (controller) controller.abort();
  conversation = [];
  els.messages.replaceChildren();
  els.input.focus();
});

// the model's name (GET v1/models needs no API key)
fetch("v1/models").then((r) => (r.ok ? r.json() : null)).then((j) => {
  const id = j && j.data && j.data[0] && j.data[0].id;
  if (id) { els.model.textContent = id; document.title = `${id} · ikcli chat`; }
}).catch(() => { /* no model name: the page works without it */ });
els.input.focus();
