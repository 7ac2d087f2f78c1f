// Demo page: upload → POST /caption → words; hovering a word loads GET /captions/{id}/overlay?token=i.
// "Try a sample" fetches a bundled photo from /static/samples/ and sends it through the same upload path.
// Plain browser JavaScript, no external CDN: the page works offline.
"use strict";
const $ = (id) => document.getElementById(id);
let current = null;  // the caption on screen: {id, tokens, isEos, attention, geometry, summary}
let latest = 0;      // number of the newest caption request: an older answer that arrives later is dropped
let lastFile = null; // captioned again when the model, the beam size, the length penalty or a repeat rule changes
let inflight = null; // the AbortController of the caption request on its way: a newer one cancels it
let defaultBeam = null;  // the service's default beam size, as its answers to an empty beam box report it
let settling = 0;    // the timer of a caption waiting for the controls to settle (SETTLE_MS)
// the current caption's heatmaps by "token:mode": {promise, url}, url (an object URL) once it has arrived; one
// request per heatmap, however many events (mouseenter, focus, click) ask for it while it is on its way
const overlays = new Map();
const models = new Map();    // name → its /models entry (heatmap_modes: the modes it can draw; decoding: its rules)
// the repeat rules' boxes, by the request option each one sets
const RULE_BOXES = { block_doubled_words: "block-doubled", block_trigrams: "block-trigrams" };
// the number boxes, by the request option each one sets: `id`, and what a value it takes must be (`must`: the box's
// own bounds; the beam box's maximum is the service's, once its OpenAPI document has said it: loadBeamLimit)
const NUMBER_BOXES = {
  beam_size: { id: "beam", must: (box) => `the beam size must be a whole number from ${box.min}` +
                                          `${box.max ? ` to ${box.max}` : " up"}, or empty for the default` },
  length_penalty: { id: "length-penalty",
                    must: (box) => `the length penalty must be a number from ${box.min} to ${box.max}, or empty for the model's default` },
};
const MIN_SIDE = 256;  // a smaller image is shown enlarged to this longer side, its heatmap with it
// A photo the service refuses as too large (413: more pixels or bytes than it takes) is sent again as a copy this
// long on its longer side, then this one: the model sees a few hundred pixels, the heatmaps at most SHOWN_SIDE.
const COPY_SIDES = [2048, 1024];
// a burst of changes (arrow keys held on the beam box or the model list) sends one caption, this long after the last
const SETTLE_MS = 400;

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
  delete $("status").dataset.models;
}

// What a failed answer says: the service's problem detail (its title, an HTTP reason phrase such as "Request Entity
// Too Large", tells a person nothing more); a proxy's HTML page or an empty body gives the status.
// `fields`: the request fields the problem blames (its `errors`, each with the `loc` of one field).
async function failure(response) {
  try {
    const body = await response.json();
    const fields = Array.isArray(body.errors) ? body.errors.flatMap((e) => e.loc ?? []) : [];
    const message = body.detail || `${body.title || "Error"} (HTTP ${response.status})`;
    return { message, fields, type: body.type ?? "" };
  } catch {
    return { message: `HTTP ${response.status} ${response.statusText}`.trim(), fields: [], type: "" };
  }
}

// A number box is marked while a caption was refused for it (by the box itself or by the service; `refused`: the
// options blamed): a screen reader says "invalid" on the box and reads the status, which says why, as its
// description; a red border shows it.
function markRefused(refused) {
  for (const [option, { id }] of Object.entries(NUMBER_BOXES)) {
    const isRefused = refused.includes(option);
    $(id).setAttribute("aria-invalid", String(isRefused));
    if (isRefused) $(id).setAttribute("aria-describedby", "status");
    else $(id).removeAttribute("aria-describedby");
  }
}

// A server still loading its models (CAPTIONER_LOAD_IN_BACKGROUND) lists none, or none yet answers: the page asks
// again every MODELS_RETRY_S seconds (the Retry-After of the service's 503s) until it has a model.
const MODELS_RETRY_S = 5;
// the longer side of the photo and of its overlays as the page shows them: the two must match, pixel for pixel
const SHOWN_SIDE = 1024;

async function loadModels() {
  let problem;
  try {
    const response = await fetch("models");
    if (!response.ok) throw new Error((await failure(response)).message);
    const list = await response.json();
    $("model").innerHTML = "";
    for (const m of list) {
      models.set(m.name, m);
      $("model").add(new Option(`${m.name} (${m.architecture}, ${m.attention})`, m.name, m.default, m.default));
    }
    offerModes();
    showModelRules();
    if (list.length) {
      if ($("status").dataset.models) setStatus("");  // the waiting message, not a caption's
      return;
    }
    problem = "No model is loaded on this server yet";
  } catch (err) {
    problem = `Could not list models: ${err.message || err}`;
  }
  setStatus(`${problem}; asking again in ${MODELS_RETRY_S} s.`, true);
  $("status").dataset.models = "waiting";
  setTimeout(loadModels, MODELS_RETRY_S * 1000);
}

// The modes the chosen model cannot draw (area_topk, without area attention) are not offered; "" is its default.
function offerModes() {
  const drawable = models.get($("model").value)?.heatmap_modes ?? [];
  for (const option of $("mode").options) {
    option.disabled = option.value !== "" && !drawable.includes(option.value);
  }
  if ($("mode").selectedOptions[0]?.disabled) $("mode").value = "";
}

// The service's widest beam (CAPTIONER_MAX_BEAM_SIZE) as its OpenAPI document states it, so that the beam box
// refuses a wider one before anything is sent. Without the document (a proxy that does not pass it) the box has no
// maximum, and the service's refusal names its limit.
async function loadBeamLimit() {
  try {
    const response = await fetch("openapi.json");
    if (!response.ok) return;
    const widest = (await response.json()).components?.schemas?.CaptionForm?.properties?.beam_size?.maximum;
    if (Number.isInteger(widest)) $("beam").max = widest;
  } catch {
    // no maximum on the box: the service still refuses a beam above its limit, and its answer says which
  }
}

// The repeat rules' boxes and the length penalty show the chosen model's defaults (chosen on validation data: GET
// /models' `decoding`), so that every caption says what it was made with; another model brings its own.
function showModelRules() {
  const rules = models.get($("model").value)?.decoding ?? {};
  for (const [option, box] of Object.entries(RULE_BOXES)) $(box).checked = Boolean(rules[option]);
  $("length-penalty").value = rules.length_penalty ?? "";
}

function clearCaption() {
  current = null;
  // one still on its way is released when it arrives
  for (const { promise } of overlays.values()) promise.then((url) => URL.revokeObjectURL(url), () => {});
  overlays.clear();
  $("caption").textContent = "";
  $("selected").textContent = "";
  $("overlay").hidden = true;
  $("overlay").removeAttribute("src");
}

// `about`: what the photo shows, where the page knows it (a sample's description)
function showPhoto(file, about = "") {
  if ($("photo").src) URL.revokeObjectURL($("photo").src);
  delete $("photo").dataset.fallback;
  $("photo").style.width = "";
  $("photo").src = URL.createObjectURL(file);
  $("photo").alt = `the image captioned${about ? ` (${about})` : ""}: ${file.name}`;
}

// No caption to show: the result is hidden, and a keyboard focus inside it (on a word) moves to the file chooser
// instead of falling to the page's body.
function hideResult() {
  const hadFocus = $("result").contains(document.activeElement);
  $("result").hidden = true;
  if (hadFocus) $("file").focus();
}

// The index of the word whose heatmap is shown, null when none is.
function chosenWord() {
  const active = document.querySelector("#caption .word.active");
  return active ? +active.dataset.index : null;
}

// An image the service reads but the browser cannot show (TIFF) is shown as the service read it: its overlay
// rendering with no heat (alpha 0), same size and orientation as every heatmap drawn over it.
function photoFallback() {
  const photo = $("photo");
  if (!current || !photo.complete || photo.naturalWidth > 0 || photo.dataset.fallback) return;
  photo.dataset.fallback = "yes";
  photo.src = `captions/${current.id}/overlay?${new URLSearchParams({ token: 0, format: "png", alpha: 0, max_side: SHOWN_SIDE })}`;
}

// A tiny image is enlarged (keeping its shape) so that its heatmaps can be seen; the heatmap covers the photo's box.
// No taller than the stage's max-height (70vh, style.css), which would otherwise squash a width set here.
function sizePhoto() {
  const photo = $("photo");
  const side = Math.max(photo.naturalWidth, photo.naturalHeight);
  const scale = Math.min(MIN_SIDE / side, (0.7 * window.innerHeight) / photo.naturalHeight);
  photo.style.width = side > 0 && side < MIN_SIDE && scale > 1 ? `${photo.naturalWidth * scale}px` : "";
}

// A copy of an image file at most `side` pixels on its longer side, as a JPEG (its orientation applied, as the
// browser shows it); null when the browser cannot decode the file.
async function shrunkCopy(file, side) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(file, { imageOrientation: "from-image" });
  } catch {
    return null;
  }
  const scale = Math.min(1, side / Math.max(bitmap.width, bitmap.height));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(bitmap.width * scale));
  canvas.height = Math.max(1, Math.round(bitmap.height * scale));
  const context = canvas.getContext("2d");
  context.fillStyle = "#fff";  // transparency on white, as the service flattens it
  context.fillRect(0, 0, canvas.width, canvas.height);
  context.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", 0.92));
  return blob && new File([blob], file.name.replace(/\.[^.]*$/, "") + ".jpg", { type: "image/jpeg" });
}

// Whether a 200 answer is a caption the page can show (a proxy's page or another service's JSON is not).
function isCaption(body) {
  return body !== null && typeof body === "object" && typeof body.id === "string" && Array.isArray(body.tokens)
    && Array.isArray(body.is_eos) && body.is_eos.length === body.tokens.length;
}

// The number boxes' values by option, an empty box left out (the default: the service's beam size,
// CAPTIONER_DEFAULT_BEAM_SIZE, or the model's length penalty); a value a box itself rejects is an error naming its
// option (`option`); a beam above the service's maximum is refused by the box once the page knows it
// (loadBeamLimit), by the service otherwise, whose answer names it.
function numberOptions() {
  const options = {};
  for (const [option, { id, must }] of Object.entries(NUMBER_BOXES)) {
    const box = $(id);
    if (box.value === "" && box.validity.valid) continue;
    const value = box.valueAsNumber;
    // the beam box's step (1) refuses a fraction; the length penalty's step (0.1) is only what the arrow keys add
    const fits = option === "beam_size" ? box.validity.valid
      : !box.validity.badInput && value >= Number(box.min) && value <= Number(box.max);
    if (!fits || !Number.isFinite(value)) throw Object.assign(new Error(must(box)), { option });
    options[option] = value;
  }
  return options;
}

// The number boxes checked before anything is sent: their options (numberOptions) when they hold what they take;
// otherwise null, the status says why, the box is marked and nothing is sent.
function acceptedNumbers() {
  let options;
  try {
    options = numberOptions();
  } catch (err) {
    setStatus(`Not sent: ${err.message}`, true);
    markRefused([err.option]);
    return null;
  }
  markRefused([]);
  return options;
}

// Caption `file` (the photo on screen from now on). `scroll`: bring the result into view (a new photo; not a change
// of model or beam size, made in the controls above it); `waiting`: the status until the answer; `word`: the word
// whose heatmap to show once it has come (the one chosen before); `keep`: the caption on screen stays until the
// answer, and stays if the answer is a refusal (another model or beam size for the same photo: a beam above the
// service's limit took the good caption away); `about`: what the photo shows, for its text alternative.
async function caption(file, { scroll = true, waiting = "Captioning…", word = null, keep = false, about = "" } = {}) {
  if (!file) return;
  clearTimeout(settling);
  const params = new URLSearchParams({ model: $("model").value });
  for (const [option, box] of Object.entries(RULE_BOXES)) params.set(option, $(box).checked);
  // before anything on screen changes: a number a box rejects leaves the last caption as it was
  const numbers = acceptedNumbers();
  if (numbers === null) return;
  for (const [option, value] of Object.entries(numbers)) params.set(option, value);
  const request = ++latest;
  inflight?.abort();  // its answer would be dropped: the server stops working on it
  const controller = (inflight = new AbortController());
  lastFile = file;
  keep &&= !$("result").hidden;  // nothing on screen to keep after a refusal of a new photo
  if (!keep) {
    // a word's keyboard focus stays in the caption while its words are replaced (it fell to the page's body)
    if ($("caption").contains(document.activeElement)) $("caption").focus();
    clearCaption();
    showPhoto(file, about);
    $("result").hidden = false;
  }
  setStatus(waiting);
  let body;
  let sent = file;  // the file, or the copy sent in its place when the service refused it as too large
  let copySide = null;  // that copy's longer side
  try {
    for (let copies = 0; ; copies++) {
      const form = new FormData();
      form.append("file", sent);
      const response = await fetch(`caption?${params}`, { method: "POST", body: form, signal: controller.signal });
      if (request !== latest) return;  // a newer request was sent meanwhile: its answer is the one to show
      if (response.ok) {
        body = await response.json().catch(() => null);
        if (!isCaption(body)) throw new Error("the answer was not a caption (a proxy's page in the way?)");
        break;
      }
      const { message, fields } = await failure(response);
      const copy = response.status === 413 && copies < COPY_SIDES.length ? await shrunkCopy(file, COPY_SIDES[copies])
        : null;
      if (request !== latest) return;
      if (copy === null) {
        if (!keep) hideResult();
        // named, so that the message says which upload failed (a dropped file, a sample, one picked long ago)
        setStatus(`“${file.name}” was not captioned: ${message}`, true);
        markRefused(fields);
        return;
      }
      sent = copy;
      copySide = COPY_SIDES[copies];
      setStatus(`“${file.name}” is larger than this server takes; sending a smaller copy (a JPEG at most `
                + `${copySide} px on its longer side)…`);
    }
  } catch (err) {
    if (request === latest) {
      if (!keep) hideResult();
      setStatus(`The request failed: ${err.message || err}`, true);
    }
    return;
  } finally {
    if (inflight === controller) inflight = null;
  }
  if ($("beam").value === "") {  // the service's default: the box counts from it and says it
    defaultBeam = body.beam_size;
    $("beam").placeholder = `default (${defaultBeam})`;
  }
  const words = body.tokens.filter((_, i) => !body.is_eos[i]);
  const penalty = body.length_penalty ? `, length penalty ${body.length_penalty}` : "";
  const from = copySide === null ? ""
    : ` (from a smaller copy, at most ${copySide} px on its longer side: the photo was too large)`;
  // the words are replaced: a keyboard focus on one of them (or on the caption, held there) moves to the new word
  const refocus = $("caption").contains(document.activeElement);
  clearCaption();
  // the live region announces the caption itself, not only that one arrived
  current = { id: body.id, tokens: body.tokens, isEos: body.is_eos, attention: body.attention,
              geometry: body.geometry, summary: `${body.model}, beam ${body.beam_size}${penalty}: “${words.join(" ")}”${from}` };
  setStatus(current.summary);
  photoFallback();
  body.tokens.forEach((token, i) => {
    const span = document.createElement("span");
    span.textContent = token;
    span.className = "word" + (body.is_eos[i] ? " eos" : "");
    span.dataset.index = i;
    span.tabIndex = i === 0 ? 0 : -1;  // one Tab stop for the caption: the chosen word (show() moves it)
    span.setAttribute("role", "button");  // each word shows its heatmap
    span.setAttribute("aria-pressed", "false");  // "pressed": the word whose heatmap is shown (show() moves it)
    // the name begins with the text on screen, so that a voice-control user can say what they see ("click eos")
    if (body.is_eos[i]) span.setAttribute("aria-label", `${token} (end of caption)`);
    // while the keyboard is in the caption, the pointer moves the focus with the heatmap (it showed one word's
    // heatmap while another word kept the focus and the caption's Tab stop)
    span.addEventListener("mouseenter", () => ($("caption").contains(document.activeElement) ? span.focus() : show(i)));
    span.addEventListener("click", () => show(i));
    span.addEventListener("focus", () => show(i));
    span.addEventListener("keydown", (e) => step(e, i));
    $("caption").appendChild(span);
  });
  // below the controls, the photo started under the fold of a phone's screen (and of a tall photo's on a desktop):
  // the words and the photo their heatmaps cover are brought into view together, and a keyboard user's focus, left
  // on a control that scrolled away, moves to the result's heading
  if (scroll) {
    if ($("controls").contains(document.activeElement)) $("result-title").focus({ preventScroll: true });
    $("result").scrollIntoView({ block: "start" });
  }
  const chosen = word !== null ? Math.min(word, body.tokens.length - 1) : refocus ? 0 : null;
  const spans = $("caption").querySelectorAll(".word");
  if (chosen !== null && refocus) spans[chosen].focus();  // focusing a word shows its heatmap
  else if (chosen !== null) show(chosen);
}

// Arrow keys move between the words, Home and End to the first and last (the caption is one Tab stop, so Tab
// leaves it: the ARIA toolbar pattern); Enter and Space choose the focused word, as they press a button (Space would
// otherwise scroll the page).
function step(event, index) {
  if (event.key === "Enter" || event.key === " ") {
    event.preventDefault();
    show(index);
    return;
  }
  const words = document.querySelectorAll("#caption .word");
  const to = { ArrowRight: index + 1, ArrowDown: index + 1, ArrowLeft: index - 1, ArrowUp: index - 1, Home: 0,
               End: words.length - 1 }[event.key];
  if (to === undefined) return;
  event.preventDefault();
  words[Math.min(Math.max(to, 0), words.length - 1)].focus();
}

// A sample is captioned exactly as if the user had uploaded that file: same request, same rendering.
async function captionSample(name, about) {
  let photo;
  try {
    const response = await fetch(`static/samples/${name}.jpg`);
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    photo = await response.blob();
  } catch (err) {
    setStatus(`Could not load the sample photo: ${err.message || err}`, true);
    return;
  }
  await caption(new File([photo], `${name}.jpg`, { type: "image/jpeg" }), { about });
}

// The heatmap of word `index` in `mode`, asked of the service once; a failed one is asked again next time.
function heatmap(shown, index, mode) {
  const key = `${index}:${mode}`;
  if (!overlays.has(key)) {
    const params = new URLSearchParams({ token: index, format: "png", max_side: SHOWN_SIDE });
    if (mode) params.set("mode", mode);
    const entry = { url: null };
    entry.promise = fetch(`captions/${shown.id}/overlay?${params}`)
      .catch((err) => { throw new Error(`The heatmap request failed: ${err.message || err}`); })
      .then(async (response) => {
        if (!response.ok) {
          const { message, type } = await failure(response);
          throw Object.assign(new Error(`The heatmap could not be drawn: ${message}`), { type });
        }
        entry.mode = response.headers.get("X-Heatmap-Mode") || mode;  // "default" resolved to what was drawn
        return URL.createObjectURL(await response.blob());
      });
    entry.promise.then((url) => { entry.url = url; }, () => { if (overlays.get(key) === entry) overlays.delete(key); });
    overlays.set(key, entry);
  }
  return overlays.get(key);
}

async function show(index) {
  const shown = current;
  if (!shown) return;
  document.querySelectorAll("#caption .word").forEach((el) => {
    el.classList.toggle("active", +el.dataset.index === index);
    el.setAttribute("aria-pressed", String(+el.dataset.index === index));
    el.tabIndex = +el.dataset.index === index ? 0 : -1;
  });
  const mode = $("mode").value;
  const isWanted = () => current === shown && $("mode").value === mode && chosenWord() === index;
  const entry = heatmap(shown, index, mode);
  if (!entry.url) {
    // until this word's heatmap arrives none is drawn: the one on screen belongs to another word (or mode)
    $("overlay").hidden = true;
    $("selected").textContent = `Loading the heatmap of “${shown.tokens[index]}”…`;
  }
  let url;
  try {
    url = await entry.promise;
  } catch (err) {
    if (isWanted()) {
      $("overlay").hidden = true;
      $("selected").textContent = "";
      if (err.type?.endsWith("/unknown-result") && lastFile) {
        // the service no longer keeps this caption (restarted, or it aged out): the photo is captioned again, and
        // the word chosen on the new caption shows its heatmap
        caption(lastFile, { scroll: false, word: index,
                            waiting: "This caption is no longer kept by the server; captioning the photo again…" });
      } else {
        setStatus(err.message || String(err), true);
      }
    }
    return;
  }
  if (!isWanted()) return;  // another word (or mode) was chosen while this heatmap was on its way
  // the heatmap's text alternative says where it is hot (WCAG 1.1.1), not only which word it is of
  const where = whereLooked(shown.attention?.[index], shown.geometry);
  $("overlay").src = url;
  $("overlay").alt = (shown.isEos[index] ? "where the model looked as it ended the caption"
    : `where the model looked for “${shown.tokens[index]}”`) + (where ? `: ${where}` : "");
  $("overlay").hidden = false;
  $("selected").textContent = `Showing “${shown.tokens[index]}” (${modeName(entry.mode)} heatmap)`
    + (where ? `: ${where}.` : ".");
  if ($("status").className === "error") setStatus(shown.summary);  // an earlier heatmap's error is over
}

// A heatmap mode as the page's mode list names it (the service's own name where the list has none).
function modeName(mode) {
  return [...$("mode").options].find((option) => option.value === mode)?.text ?? mode;
}

// Where an attention row put its weight, in words: the part of the photo (in thirds) around its strongest visual
// item, and the share its three strongest items hold. Empty for a row the page cannot read.
function whereLooked(row, geometry) {
  if (!Array.isArray(row) || !geometry || row.length === 0 || row.length !== geometry.boxes?.length) return "";
  const order = row.map((_, i) => i).sort((a, b) => row[b] - row[a]);
  const strongest = order.slice(0, 3);
  const total = row.reduce((sum, w) => sum + w, 0) || 1;
  const share = Math.round((100 * strongest.reduce((sum, i) => sum + row[i], 0)) / total);
  const [x1, y1, x2, y2] = geometry.boxes[order[0]];
  const [width, height] = geometry.image_size;
  const third = (centre, names) => names[Math.min(2, Math.max(0, Math.floor(3 * centre)))];
  const vertical = third((y1 + y2) / 2 / height, ["upper", "middle", "lower"]);
  const horizontal = third((x1 + x2) / 2 / width, ["left", "centre", "right"]);
  const part = vertical === "middle" && horizontal === "centre" ? "centre" : `${vertical} ${horizontal}`;
  const items = geometry.kind === "grid" ? "cells" : "regions";
  return `mostly the ${part} of the photo (its ${strongest.length} strongest of ${row.length} ${items} hold `
    + `${share} % of the attention)`;
}

function chooseFile(input) {
  caption(input.files[0]);
  input.value = "";  // so that picking the same file again is a change too
}

$("file").addEventListener("change", (e) => chooseFile(e.target));
// Space opens the focused file input's chooser; Enter, as on a button, does too
$("file").addEventListener("keydown", (e) => {
  if (e.key === "Enter") {
    e.preventDefault();
    $("file").click();
  }
});
$("photo").addEventListener("load", sizePhoto);
$("photo").addEventListener("error", photoFallback);
const drop = $("drop");
drop.addEventListener("dragover", () => drop.classList.add("over"));
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
// A file dropped anywhere on the page is captioned, as on the drop zone: the browser would otherwise open it in
// place of the page (a photo dropped on the photo shown, say), leaving the page and its caption.
document.addEventListener("dragover", (e) => e.preventDefault());
document.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  if (e.dataTransfer?.files.length) caption(e.dataTransfer.files[0]);
});
$("mode").addEventListener("change", () => {
  const word = chosenWord();
  if (word !== null) show(word);
});
// another model, beam size, length penalty or repeat rule captions the image on screen again, once the control has
// settled (holding an arrow key on any is one change per step); the result stays where it is on the page
function captionAgain() {
  clearTimeout(settling);
  if (acceptedNumbers() === null) return;  // a number a box rejects is said at once, as it is typed
  // the word chosen stays chosen on the new caption
  if (lastFile) settling = setTimeout(() => caption(lastFile, { scroll: false, keep: true, word: chosenWord() }),
                                      SETTLE_MS);
}
$("model").addEventListener("change", () => {
  offerModes();
  showModelRules();
  captionAgain();
});
for (const box of Object.values(RULE_BOXES)) $(box).addEventListener("change", captionAgain);
for (const { id } of Object.values(NUMBER_BOXES)) $(id).addEventListener("change", captionAgain);
// an empty box stands for the service's default: the arrow keys step from it, not from the box's minimum (1)
$("beam").addEventListener("keydown", (e) => {
  if ((e.key === "ArrowUp" || e.key === "ArrowDown") && $("beam").value === "" && defaultBeam !== null) {
    $("beam").value = defaultBeam;
  }
});
window.addEventListener("resize", sizePhoto);
document.querySelectorAll("#samples button[data-sample]").forEach((button) => {
  button.addEventListener("click", () => captionSample(button.dataset.sample, button.textContent.trim()));
});
loadModels();
loadBeamLimit();
