// The live status page (GET / on serve_metrics): one self-contained page, no script or style
// from elsewhere (it works offline), that polls /status.json every second.
#include "metrics_parts.hpp"

namespace troupe::detail {

namespace {

/// The live page: self-contained (no script or style from elsewhere), polls /status.json.
const char* page = R"HTML(<!doctype html>
<html><head><meta charset="utf-8"><title>troupe</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}
.bar{display:inline-block;height:.7em;background:#4a8;vertical-align:middle}
.down{color:#b33}.removed{color:#888}
.progress{display:inline-block;width:240px;height:.8em;background:#eee;vertical-align:middle}
.progress span{display:block;height:100%;background:#48c}
svg.spark{vertical-align:middle;background:#f6f6f6}
</style></head>
<body><h1>troupe</h1><div id="when">loading…</div><div id="runners"></div>
<script>
"use strict";
let last = null;
const rates = {};  // runner id -> the last 60 items/s samples (the sparkline)
function spark(xs){
  if (xs.length < 2) xs = [xs[0] || 0, xs[0] || 0];
  const w = 180, h = 28, top = Math.max(1, ...xs);
  const pts = xs.map((x,i)=>`${(i*w/(xs.length-1)).toFixed(1)},${(h-1-x/top*(h-2)).toFixed(1)}`).join(" ");
  return `<svg class="spark" width="${w}" height="${h}" aria-label="items per second"><polyline fill="none" stroke="#2a6" stroke-width="1.5" points="${pts}"/></svg>`;
}
function esc(s){return String(s).replace(/[&<>"]/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;","\"":"&quot;"}[c]));}
function state(p){return p.removed?"removed":p.quarantined?"quarantined":p.alive?"up":"lost";}
async function tick(){
  let s;
  try { s = await (await fetch("status.json",{cache:"no-store"})).json(); }
  catch(e){ document.getElementById("when").textContent = "no answer: " + e; return; }
  const now = s.time_seconds;
  let html = "";
  for (const id of Object.keys(rates))  // runners that are gone
    if (!s.runners.some(r=>String(r.id)===id)) delete rates[id];
  for (const r of s.runners){
    const prev = last && last.runners.find(x=>x.id===r.id);
    const dt = prev ? now - last.time_seconds : 0;
    const rate = prev && dt>0 ? (r.items - prev.items)/dt : 0;
    const hist = rates[r.id] = (rates[r.id] || []);
    if (prev) { hist.push(rate); if (hist.length > 60) hist.shift(); }
    html += `<h2>runner ${r.id}${r.open?"":" (closed)"}</h2>`;
    html += `<div>jobs running: ${r.jobs_running} · submitted: ${r.jobs_submitted} · items: ${r.items} · items/s: ${rate.toFixed(0)} ${hist.length ? spark(hist) : ""}</div>`;
    if (r.jobs.length){
      html += "<table><tr><th>job</th><th>progress</th><th>done</th><th>items/s</th><th>ETA</th></tr>";
      for (const j of r.jobs){
        const share = j.total ? Math.min(1, j.done/j.total) : null;
        const eta = share !== null && j.items_per_second > 0 ? ((j.total-j.done)/j.items_per_second).toFixed(1)+" s" : "";
        html += `<tr class="job" id="job-${r.id}-${j.id}"><td>${j.id}</td><td>`+
                (share === null ? "running" : `<span class="progress"><span style="width:${(share*100).toFixed(1)}%"></span></span> ${(share*100).toFixed(0)}%`)+
                `</td><td>${j.done}${j.total === null ? "" : "/"+j.total}</td><td>${j.items_per_second.toFixed(0)}</td><td>${eta}</td></tr>`;
      }
      html += "</table>";
    }
    html += "<table><tr><th>producer</th><th>device</th><th>state</th><th>items</th><th>items/s</th><th>busy</th></tr>";
    for (const p of r.producers){
      const pp = prev && prev.producers.find(x=>x.index===p.index);
      const busy = pp && dt>0 ? Math.min(1,(p.busy_seconds-pp.busy_seconds)/dt) : 0;
      const ips = pp && dt>0 ? (p.items-pp.items)/dt : 0;
      const st = state(p);
      html += `<tr class="${st==="up"?"":st==="removed"?"removed":"down"}"><td>${p.index}</td><td>${esc(p.device)}</td><td>${st}</td><td>${p.items}</td><td>${ips.toFixed(0)}</td>`+
              `<td><span class="bar" style="width:${(busy*80).toFixed(0)}px"></span> ${(busy*100).toFixed(0)}%</td></tr>`;
    }
    html += "</table>";
  }
  for (const c of (s.clusters || [])){
    html += `<h2>cluster ${c.id}</h2><table><tr><th>node</th><th>state</th><th>incarnation</th><th>devices</th></tr>`;
    for (const m of c.members)
      html += `<tr class="${m.state==="up"?"":m.state==="lost"?"down":"removed"}"><td>${esc(m.address)}</td><td>${esc(m.state)}</td><td>${esc(m.incarnation)}</td><td>${m.devices}</td></tr>`;
    html += "</table>";
  }
  for (const n of (s.nodes || [])){
    html += `<h2>node ${esc(n.address)}${n.draining?" (draining)":""}</h2>`+
            `<div class="node">producers: ${n.producers} · coordinators: ${n.coordinators} · watching clusters: ${n.watchers} · started: ${n.producers_spawned} · refused: ${n.spawns_refused}</div>`;
  }
  if (s.work && (s.nodes || []).length)
    html += `<div>worked here: ${s.work.chunks} chunks, ${s.work.items} items, ${s.work.busy_seconds.toFixed(1)} s busy</div>`;
  document.getElementById("runners").innerHTML = html || "<p>no runner or node in this process</p>";
  document.getElementById("when").textContent = "updated " + new Date().toLocaleTimeString();
  last = s;
}
tick(); setInterval(tick, 1000);
</script></body></html>
)HTML";

}  // namespace

const char* status_page() noexcept {
  return page;
}

}  // namespace troupe::detail
