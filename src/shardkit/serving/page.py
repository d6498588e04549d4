"""``GET /``: one small page to try a prompt, watch its tokens stream in, and watch the server's live state
(requests in the batch, the queue, each rank's KV cache, tokens per second), read from ``GET /state``.

``/?prompt=TEXT&run=1`` fills the prompt and starts at once (what the headless-browser test does).
No script or style from elsewhere: the page works without a network.

>>> "/v1/completions" in PAGE and "/state" in PAGE
True
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shardkit serve: {{model}}</title>
<style>
 body { font: 15px system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
 h1 { font-size: 1.3em; } h1 small { color: #777; font-weight: normal; }
 textarea { width: 100%; height: 5em; font: 14px monospace; }
 #out { white-space: pre-wrap; font: 14px monospace; background: #f4f4f0; border: 1px solid #ccc;
        padding: .8em; min-height: 6em; }
 #out b { color: #555; font-weight: normal; }
 .row { display: flex; gap: 1em; align-items: center; margin: .5em 0; }
 .state { display: grid; grid-template-columns: repeat(4, 1fr); gap: .6em; margin-top: 1em; }
 .card { border: 1px solid #ccc; border-radius: 4px; padding: .5em .8em; }
 .card .v { font-size: 1.5em; } .card .k { color: #777; font-size: .85em; }
 .bar { background: #eee; height: .8em; border-radius: 3px; margin: .2em 0 .5em; }
 .bar div { background: #4a7; height: 100%; border-radius: 3px; }
 #err { color: #b00; }
</style></head>
<body data-model="{{model}}">
<h1>shardkit serve <small>{{model}}</small></h1>
<textarea id="prompt">Once upon a time</textarea>
<div class="row">
 <label>max_tokens <input id="max" type="number" value="64" min="1" style="width:5em"></label>
 <label>temperature <input id="temp" type="number" value="0" min="0" max="2" step="0.1" style="width:4em"></label>
 <button id="go">Generate</button> <span id="status"></span> <span id="err"></span>
</div>
<div id="out"></div>
<div class="state">
 <div class="card"><div class="v" id="batch">-</div><div class="k">in the batch (of <span id="slots">-</span>)</div></div>
 <div class="card"><div class="v" id="queue">-</div><div class="k">queued</div></div>
 <div class="card"><div class="v" id="tps">-</div><div class="k">tokens/s</div></div>
 <div class="card"><div class="k">KV cache per rank</div><div id="kv"></div></div>
</div>
<script>
const $ = (id) => document.getElementById(id);
async function generate() {
  $("out").innerHTML = ""; $("err").textContent = ""; $("status").textContent = "streaming...";
  const prompt = $("prompt").value, shown = document.createElement("b");
  shown.textContent = prompt; $("out").appendChild(shown);
  const text = document.createTextNode(""); $("out").appendChild(text);
  const body = {model: document.body.dataset.model, prompt, max_tokens: +$("max").value, temperature: +$("temp").value,
                stream: true};
  const res = await fetch("/v1/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                              body: JSON.stringify(body)});
  if (!res.ok) { $("err").textContent = (await res.json()).error.message; $("status").textContent = ""; return; }
  const reader = res.body.getReader(), decoder = new TextDecoder();
  let buffer = "", tokens = 0;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
      const line = buffer.slice(0, cut).replace(/^data: /, ""); buffer = buffer.slice(cut + 2);
      if (line === "[DONE]") continue;
      const event = JSON.parse(line);
      if (event.error) { $("err").textContent = event.error.message; continue; }
      text.appendData(event.choices[0].text); tokens++;
      if (event.choices[0].finish_reason) $("status").textContent = "done (" + event.choices[0].finish_reason + ")";
    }
  }
}
async function poll() {
  try {
    const s = await (await fetch("/state")).json();
    $("batch").textContent = s.batch; $("slots").textContent = s.slots; $("queue").textContent = s.queue;
    $("tps").textContent = s.tokens_per_second.toFixed(1);
    $("kv").innerHTML = s.kv_cache.map((k) => {
      const pct = k.capacity ? Math.round(100 * k.used / k.capacity) : 0;
      return `rank ${k.rank}: ${k.used} / ${k.capacity}<div class="bar"><div style="width:${pct}%"></div></div>`;
    }).join("");
  } catch (e) { $("batch").textContent = "?"; }
}
$("go").onclick = generate;
setInterval(poll, 500); poll();
const params = new URLSearchParams(location.search);
if (params.get("prompt") !== null) $("prompt").value = params.get("prompt");
if (params.get("run")) generate();
</script>
</body></html>
"""
