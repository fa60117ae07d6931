// rolloutd view: a batch overview and one page per trajectory, from the JSON blocks above.
// Every text from a result is set with textContent (a tool output may hold HTML); a trajectory's
// record is parsed only when its page opens, and the overview shows PAGE rows at a time.
"use strict";
(function () {
  const PAGE = 100;
  const PHASES = ["queue", "init", "run", "eval"];
  const data = (id) => JSON.parse(document.getElementById(id).textContent);
  const rows = data("rows"), summary = data("summary"), vocab = data("vocab"), meta = data("meta");
  const app = document.getElementById("app");
  const state = { status: "", handler: "", search: "", zeroVar: false, page: 0 };
  const zeroGroups = new Set(summary.groups.filter((g) => g.zero_variance).map((g) => g.group));

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const c of kids.flat()) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
    return e;
  }
  const fmt = (x, nd = 3) => (x === null || x === undefined ? "–" : typeof x === "number" ? +x.toFixed(nd) + "" : String(x));
  const badge = (s) => el("span", { class: "badge " + s, text: s });

  function waterfall(timing, scale, big) {
    const wf = el("div", { class: "wf" + (big ? " big" : ""), title: PHASES.map((p) => p + " " + fmt(timing[p]) + " s").join(", ") });
    for (const p of PHASES) {
      const v = timing[p] || 0;
      if (v > 0 && scale > 0) wf.append(el("span", { class: p, style: "width:" + Math.max(0.5, (100 * v) / scale) + "%" }));
    }
    return wf;
  }
  const legend = () => el("div", { class: "legend muted" }, PHASES.flatMap((p) => [el("span", { class: p, style: "background:var(--" + p + ")" }), p]));

  // ---- overview -------------------------------------------------------------------------
  function filtered() {
    const q = state.search.toLowerCase();
    return rows.filter((r) => (!state.status || r.status === state.status) && (!state.handler || r.handler === state.handler) &&
      (!q || r.instance_id.toLowerCase().includes(q) || String(r.job_id).includes(q)) &&
      (!state.zeroVar || zeroGroups.has(r.instance_id)));
  }

  function overview() {
    const total = (t) => PHASES.reduce((a, p) => a + (t[p] || 0), 0);
    const out = el("div", { id: "overview" });
    const cards = el("div", { class: "cards" });
    cards.append(el("div", { class: "card", id: "by-status" }, el("h3", { text: "status (" + summary.jobs + " jobs)" }),
      Object.entries(summary.by_status).map(([s, n]) => el("div", {}, badge(s), " " + n))));
    cards.append(el("div", { class: "card", id: "failed-at" }, el("h3", { text: "failures by phase" }),
      Object.keys(summary.failed_at).length ? Object.entries(summary.failed_at).map(([s, n]) => el("div", { text: s + ": " + n })) : el("div", { class: "muted", text: "none" })));
    const pm = summary.phase_mean_s, scale = total(pm);
    cards.append(el("div", { class: "card", id: "phases" }, el("h3", { text: "mean time per phase (s)" }), waterfall(pm, scale, true),
      el("div", { class: "muted", text: PHASES.map((p) => p + " " + fmt(pm[p])).join(" · ") }), legend()));
    out.append(cards);

    out.append(el("h2", { text: "reward by domain" }));
    out.append(el("table", { id: "domains" }, el("thead", {}, el("tr", {}, ["handler", "jobs", "scored (ok)", "mean reward"].map((h, i) => el("th", { class: i ? "num" : "", text: h })))),
      el("tbody", {}, summary.domains.map((d) => el("tr", {}, el("td", { text: d.handler }), el("td", { class: "num", text: d.jobs }),
        el("td", { class: "num", text: d.scored }), el("td", { class: "num", text: fmt(d.mean_reward) }))))));

    const zv = summary.groups.filter((g) => g.zero_variance).length;
    out.append(el("h2", { text: "reward by group (" + summary.groups.length + " groups, " + zv + " with zero variance)" }));
    const gt = el("tbody", {});
    for (const g of summary.groups.slice(0, 500)) {
      gt.append(el("tr", { class: g.zero_variance ? "zero-var" : "" }, el("td", { text: g.group }), el("td", { class: "num", text: g.n }),
        el("td", { class: "num", text: fmt(g.mean) }), el("td", { class: "num", text: fmt(g.std) })));
    }
    out.append(el("table", { id: "groups" }, el("thead", {}, el("tr", {}, ["group (instance id)", "samples", "mean", "std"].map((h, i) => el("th", { class: i ? "num" : "", text: h })))), gt));
    if (summary.groups.length > 500) out.append(el("div", { class: "muted", text: "first 500 groups shown" }));

    out.append(el("h2", { text: "trajectories" }));
    const opts = (vals) => [el("option", { value: "", text: "all" }), ...vals.map((v) => el("option", { value: v, text: v }))];
    const statuses = Object.keys(summary.by_status).sort(), handlers = summary.domains.map((d) => d.handler);
    const fs = el("select", { id: "f-status", onchange: (e) => { state.status = e.target.value; state.page = 0; drawRows(); } }, opts(statuses));
    const fh = el("select", { id: "f-handler", onchange: (e) => { state.handler = e.target.value; state.page = 0; drawRows(); } }, opts(handlers));
    const fq = el("input", { id: "f-search", type: "search", placeholder: "instance or job id", oninput: (e) => { state.search = e.target.value; state.page = 0; drawRows(); } });
    const fz = el("input", { id: "f-zerovar", type: "checkbox", onchange: (e) => { state.zeroVar = e.target.checked; state.page = 0; drawRows(); } });
    fs.value = state.status; fh.value = state.handler; fq.value = state.search; fz.checked = state.zeroVar;
    out.append(el("div", { class: "filters" }, "status ", fs, "handler ", fh, fq, el("label", {}, fz, " zero-variance groups only")));
    const pager = el("div", { class: "pager", id: "pager" });
    out.append(pager);
    const tbody = el("tbody", { id: "rows" });
    out.append(el("table", {}, el("thead", {}, el("tr", {}, ["#", "job", "instance", "sample", "handler", "status", "failure", "reward", "turns", "sampled", "attempts", "phases"]
      .map((h) => el("th", { text: h })))), tbody));

    function drawRows() {
      const fr = filtered();
      const pages = Math.max(1, Math.ceil(fr.length / PAGE));
      state.page = Math.min(state.page, pages - 1);
      const shown = fr.slice(state.page * PAGE, (state.page + 1) * PAGE);
      const scale = Math.max(1e-9, ...shown.map((r) => total(r.timing)));
      tbody.replaceChildren(...shown.map((r) => el("tr", { "data-i": r.i, onclick: () => { location.hash = "#/t/" + r.i; } },
        el("td", { class: "num", text: r.i }), el("td", { text: fmt(r.job_id) }), el("td", { text: r.instance_id }),
        el("td", { class: "num", text: fmt(r.sample_index) }), el("td", { text: r.handler }), el("td", {}, badge(r.status)),
        el("td", { text: r.status === "ok" ? "" : (r.failed_phase || "-") + (r.error_type ? ": " + r.error_type : "") }),
        el("td", { class: "num", text: fmt(r.reward) }), el("td", { class: "num", text: r.turns }), el("td", { class: "num", text: r.sampled }),
        el("td", { class: "num", text: fmt(r.attempts) }), el("td", {}, waterfall(r.timing, scale, false)))));
      pager.replaceChildren(
        el("button", { id: "prev", disabled: state.page === 0 ? "disabled" : null, onclick: () => { state.page--; drawRows(); } }, "‹ prev"),
        el("span", { id: "page-info", text: "page " + (state.page + 1) + " of " + pages + " · " + fr.length + " of " + rows.length + " trajectories" }),
        el("button", { id: "next", disabled: state.page >= pages - 1 ? "disabled" : null, onclick: () => { state.page++; drawRows(); } }, "next ›"));
    }
    drawRows();
    return out;
  }

  // ---- one trajectory -----------------------------------------------------------------------
  const piece = (id) => (Object.prototype.hasOwnProperty.call(vocab, id) ? vocab[id] : null);
  const decode = (ids) => (Object.keys(vocab).length ? ids.map((i) => { const p = piece(i); return p === null ? "<" + i + ">" : p; }).join("") : ids.join(" "));
  const lpColor = (lp) => {
    if (lp === null || lp === undefined) return "";
    const t = Math.max(0, Math.min(1, -lp / 5)); // 0 (sure) .. 1 (logprob <= -5)
    return "background:hsl(" + Math.round(120 * (1 - t)) + ",70%," + Math.round(88 - 10 * t) + "%)";
  };

  function chat(seg) {
    const box = el("div", { class: "chat" });
    box.append(el("details", { class: "msg prompt" }, el("summary", { class: "who", text: "prompt · " + seg.prompt_ids.length + " tokens (click to open)" }),
      el("pre", { text: decode(seg.prompt_ids) })));
    seg.turns.forEach((t, k) => {
      const span = t.span || [t.start, t.end];
      const who = "assistant · turn " + k + " · " + (span[1] - span[0]) + " sampled · finish " + fmt(t.finish_reason) +
        " · policy v" + fmt(t.policy_version) + (t.backend ? " · " + t.backend : "") + (t.continuation ? " · continuation" : "");
      box.append(el("div", { class: "msg assistant", "data-turn": k }, el("div", { class: "who", text: who }), el("pre", { text: decode(seg.response_ids.slice(span[0], span[1])) })));
      if (t.obs_start !== null && t.obs_start !== undefined && t.obs_end > t.obs_start) {
        box.append(el("div", { class: "msg obs" }, el("div", { class: "who", text: "observation · " + (t.obs_end - t.obs_start) + " tokens (loss mask 0)" }),
          el("pre", { text: decode(seg.response_ids.slice(t.obs_start, t.obs_end)) })));
      }
    });
    return box;
  }

  function tokens(seg, si, showPrompt) {
    const box = el("div", { class: "tokens", id: "tokens-" + si });
    const nc = new Set(seg.noncanonical || []);
    const starts = new Map();
    seg.turns.forEach((t, k) => starts.set((t.span || [t.start])[0], [k, t]));
    const decoded = Object.keys(vocab).length > 0;
    const mk = (id, cls, title, style, j) => {
      const p = piece(id);
      return el("span", { class: "tok " + cls, title, style, "data-j": j }, p === null ? (decoded ? "<" + id + ">" : id + " ") : p);
    };
    if (showPrompt) for (const id of seg.prompt_ids) box.append(mk(id, "p", "prompt · id " + id));
    else box.append(el("span", { class: "muted", text: "[" + seg.prompt_ids.length + " prompt tokens hidden] " }));
    let turnV = null;
    seg.response_ids.forEach((id, j) => {
      if (starts.has(j)) {
        const [k, t] = starts.get(j);
        turnV = t.policy_version;
        box.append(el("span", { class: "turnmark" + (t.continuation ? " cont" : ""), text: "turn " + k + " · v" + fmt(t.policy_version) + (t.continuation ? " · cont" : "") }));
      }
      const m = seg.loss_mask[j], lp = seg.logprobs[j];
      const title = "id " + id + " · mask " + m + (m ? " · logprob " + fmt(lp, 4) + " · policy v" + fmt(turnV) : "") + (nc.has(j) ? " · non-canonical split" : "");
      box.append(mk(id, (m ? "s" : "o") + (nc.has(j) ? " nc" : ""), title, m ? lpColor(lp) : null, j));
    });
    return box;
  }

  function trajectory(i) {
    const r = rows[i];
    const node = document.getElementById("d-" + i);
    if (!r || !node) return el("div", { id: "traj" }, el("p", { text: "no trajectory " + i }));
    const d = JSON.parse(node.textContent);
    const out = el("div", { id: "traj", "data-i": i });
    out.append(el("p", {}, el("a", { href: "#/", text: "‹ all trajectories" })));
    out.append(el("h2", {}, (d.instance_id || "?") + " ", badge(d.status), " reward " + fmt(d.reward)));
    out.append(el("table", { class: "kv" }, el("tbody", {}, [["job", d.job_id], ["sample", d.sample_index], ["handler", d.handler], ["attempts", d.attempts],
      ["policy version", d.policy_version], ["stale", d.stale], ["node", d.node], ["failed phase", d.failed_phase]]
      .map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: fmt(v) }))))));
    if (d.error) out.append(el("div", { class: "err", id: "error", text: (d.error.type || "error") + ": " + (d.error.message || "") }));
    const timing = d.timing || {};
    out.append(el("h3", { text: "time per phase" }), waterfall(timing, PHASES.reduce((a, p) => a + (timing[p] || 0), 0), true), legend(),
      el("div", { class: "muted", text: PHASES.map((p) => p + " " + fmt(timing[p]) + " s").join(" · ") +
        (d.metrics ? " · llm " + fmt(d.metrics.llm_s) + " s · tools " + fmt(d.metrics.tools_s) + " s" : "") }));
    const showPrompt = el("input", { type: "checkbox", id: "show-prompt" });
    out.append(el("p", {}, el("label", {}, showPrompt, " show prompt tokens")));
    d.segments.forEach((seg, si) => {
      if (d.segments.length > 1) out.append(el("h2", { class: "segment", text: "segment " + si + " of " + d.segments.length }));
      out.append(el("h3", { text: "turns" }), chat(seg));
      const h = el("h3", { text: "tokens · " + seg.loss_mask.filter((m) => m === 1).length + " sampled (coloured by logprob), observations grey" +
        (seg.noncanonical && seg.noncanonical.length ? " · " + seg.noncanonical.length + " in non-canonical splits (wavy)" : "") });
      out.append(h, tokens(seg, si, false));
    });
    showPrompt.addEventListener("change", () => {
      d.segments.forEach((seg, si) => document.getElementById("tokens-" + si).replaceWith(tokens(seg, si, showPrompt.checked)));
    });
    out.append(el("h3", { text: "eval details" }), el("pre", { class: "json", id: "eval", text: JSON.stringify(d.eval_details, null, 2) }));
    out.append(el("h3", { text: "metrics" }), el("pre", { class: "json", text: JSON.stringify(d.metrics, null, 2) }));
    return out;
  }

  function route() {
    const m = /^#\/t\/(\d+)$/.exec(location.hash);
    app.replaceChildren(m ? trajectory(+m[1]) : overview());
    window.scrollTo(0, 0);
    document.body.setAttribute("data-ready", m ? "traj" : "overview");
  }
  document.getElementById("source").textContent = meta.source + (meta.tokenizer ? " · tokenizer " + meta.tokenizer : " · no tokenizer: ids shown");
  if (meta.live) {
    document.getElementById("live").textContent = meta.live.status || "";
    setInterval(() => { if (!/^#\/t\//.test(location.hash)) location.reload(); }, 1000 * (meta.live.refresh_s || 5));
  }
  window.addEventListener("hashchange", route);
  route();
})();
