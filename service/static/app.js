// Demo page: upload → POST /caption → words; hovering a word loads GET /captions/{id}/overlay?token=i.
// "Try a sample" fetches a bundled photo from /static/samples/ and sends it through the same upload path.
// Plain browser JavaScript, no external CDN: the page works offline.
"use strict";
const $ = (id) => document.getElementById(id);
let current = null;  // {id, tokens}
const cache = new Map();

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function loadModels() {
  try {
    const models = await (await fetch("/models")).json();
    $("model").innerHTML = "";
    for (const m of models) {
      const option = new Option(`${m.name} (${m.architecture}, ${m.attention})`, m.name, m.default, m.default);
      $("model").add(option);
    }
    if (!models.length) setStatus("No model is loaded on this server.", true);
  } catch (err) {
    setStatus(`Could not list models: ${err}`, true);
  }
}

async function caption(file) {
  if (!file) return;
  $("photo").src = URL.createObjectURL(file);
  $("overlay").hidden = true;
  $("result").hidden = false;
  $("caption").textContent = "";
  setStatus("Captioning…");
  const form = new FormData();
  form.append("file", file);
  // an emptied beam box means the service's default, as an empty form field would (an empty query value is a 422)
  const params = new URLSearchParams({ model: $("model").value });
  if ($("beam").value) params.set("beam_size", $("beam").value);
  const response = await fetch(`/caption?${params}`, { method: "POST", body: form });
  const body = await response.json();
  if (!response.ok) {
    setStatus(`${body.title || "Error"}: ${body.detail || response.status}`, true);
    return;
  }
  current = { id: body.id, tokens: body.tokens };
  cache.clear();
  setStatus(`${body.model}: ${body.tokens.length} tokens, beam ${body.beam_size}`);
  body.tokens.forEach((token, i) => {
    const span = document.createElement("span");
    span.textContent = token;
    span.className = "word" + (body.is_eos[i] ? " eos" : "");
    span.dataset.index = i;
    span.tabIndex = 0;
    span.addEventListener("mouseenter", () => show(i));
    span.addEventListener("click", () => show(i));
    span.addEventListener("focus", () => show(i));
    $("caption").appendChild(span);
  });
}

// A sample is captioned exactly as if the user had uploaded that file: same request, same rendering.
async function captionSample(name) {
  let photo;
  try {
    const response = await fetch(`/static/samples/${name}.jpg`);
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    photo = await response.blob();
  } catch (err) {
    setStatus(`Could not load the sample photo: ${err}`, true);
    return;
  }
  await caption(new File([photo], `${name}.jpg`, { type: "image/jpeg" }));
}

async function show(index) {
  if (!current) return;
  document.querySelectorAll("#caption .word").forEach((el) => el.classList.toggle("active", +el.dataset.index === index));
  $("selected").textContent = `Showing “${current.tokens[index]}”.`;
  const mode = $("mode").value;
  const key = `${current.id}:${index}:${mode}`;
  if (!cache.has(key)) {
    const params = new URLSearchParams({ token: index, format: "png", max_side: 1024 });
    if (mode) params.set("mode", mode);
    const response = await fetch(`/captions/${current.id}/overlay?${params}`);
    if (!response.ok) {
      const body = await response.json();
      setStatus(`${body.title}: ${body.detail}`, true);
      return;
    }
    cache.set(key, URL.createObjectURL(await response.blob()));
  }
  $("overlay").src = cache.get(key);
  $("overlay").hidden = false;
}

$("file").addEventListener("change", (e) => caption(e.target.files[0]));
const drop = $("drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  caption(e.dataTransfer.files[0]);
});
$("mode").addEventListener("change", () => {
  const active = document.querySelector("#caption .word.active");
  if (active) show(+active.dataset.index);
});
document.querySelectorAll("#samples button[data-sample]").forEach((button) => {
  button.addEventListener("click", () => captionSample(button.dataset.sample));
});
loadModels();
