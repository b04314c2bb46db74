"""The dashboard's pure chart maths run in node (no browser): TensorBoard's debiased EMA, the x axis mappings
(wall / relative time, consumed tokens) and their inverses, empty/constant chart detection, export of the points in
view. Skipped where node is absent; the browser test covers the same modules in chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

UI_JS = Path(__file__).resolve().parents[3] / "app" / "ui" / "js"
NODE = shutil.which("node")


def _run(script: str) -> dict:
    if NODE is None:
        pytest.skip("node is not installed")
    prelude = (
        f'import * as T from "{(UI_JS / "transform.js").as_uri()}";\n'
        f'import {{Series, MetricStore}} from "{(UI_JS / "series.js").as_uri()}";\n'
    )
    out = subprocess.run(
        [NODE, "--input-type=module", "-e", prelude + script], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


def test_ema_is_tensorboards_debiased_average_and_skips_gaps() -> None:
    got = _run("""
        const s = new Series("loss", null);
        [4, 2, NaN, 8, 1].forEach((v, i) => s.push(i + 1, v));
        console.log(JSON.stringify({w6: Array.from(T.ema(s, 0.6)).map((v) => Number.isNaN(v) ? null : v),
                                    w0: Array.from(T.ema(s, 0)).map((v) => Number.isNaN(v) ? null : v)}));
    """)
    w, values, expected, last, k = 0.6, [4, 2, None, 8, 1], [], 0.0, 0
    for v in values:
        if v is None:
            expected.append(None)
            continue
        last, k = last * w + (1 - w) * v, k + 1
        expected.append(last / (1 - w**k))
    assert got["w6"] == pytest.approx(expected) and got["w6"][0] == pytest.approx(4.0)
    assert got["w0"] == [4, 2, None, 8, 1]


def test_live_smoothing_extends_the_cached_average_exactly() -> None:
    got = _run("""
        const s = new Series("loss", null);
        const value = (i) => 5 * Math.exp(-i / 50) + Math.sin(i) + (i % 17 === 0 ? NaN : 0);
        for (let i = 1; i <= 200; i++) s.push(i, value(i));
        const first = T.smoothed(s, 0.9);
        for (let i = 201; i <= 250; i++) { s.push(i, value(i)); T.smoothed(s, 0.9); }  // one point at a time, live
        const live = T.smoothed(s, 0.9), full = T.ema(s, 0.9);
        s.push(150, 1);  // a restart from step 150 cuts the series: the average starts over
        const cut = T.smoothed(s, 0.9);
        const same = (a, b, n) => Array.from({length: n}, (_, i) => Number.isNaN(a[i]) ? Number.isNaN(b[i]) : Math.abs(a[i] - b[i]) < 1e-12).every(Boolean);
        console.log(JSON.stringify({sameObject: first === live, n: live.n, equal: same(live.y, full, 250),
                                    cutN: cut.n, cutEqual: same(cut.y, T.ema(s, 0.9), cut.n)}));
    """)
    assert got == {"sameObject": True, "n": 250, "equal": True, "cutN": 150, "cutEqual": True}  # 250: within capacity


def test_x_axes_map_steps_to_time_and_tokens_and_back() -> None:
    got = _run("""
        const store = new MetricStore();
        const t0 = Date.parse("2026-01-01T00:00:00Z");
        for (let step = 1; step <= 4; step++)
            store.add(step, null, {lm_loss: 5 - step, tokens: 100 * step}, new Date(t0 + 2000 * step).toISOString().replace("Z", ""));
        const rel = T.xAxis("relative", store), tok = T.xAxis("tokens", store), wall = T.xAxis("wall", store);
        const none = T.xAxis("tokens", new MetricStore());
        console.log(JSON.stringify({
            rel: [1, 2, 4, 2.5].map(rel.toX), relBack: rel.toStep(3), tok: [1, 2, 3, 4].map(tok.toX), tokBack: tok.toStep(600),
            wall: wall.toX(1), wallTime: wall.time, fallback: none.mode,
            available: ["step", "wall", "tokens"].map((m) => T.xModeAvailable(m, new MetricStore())),
        }));
    """)
    assert got["rel"] == [0, 2, 6, 3]  # seconds since the first point; a step between points interpolates
    assert got["relBack"] == 2.5
    assert got["tok"] == [100, 300, 600, 1000]  # cumulative `tokens`
    assert got["tokBack"] == 3
    assert got["wall"] == 1767225602 and got["wallTime"] is True  # a time without offset is UTC
    assert got["fallback"] == "step" and got["available"] == [True, False, False]


def test_flat_charts_detected_and_export_covers_the_zoomed_range() -> None:
    got = _run("""
        const mk = (name, values) => { const s = new Series(name, null); values.forEach((v, i) => s.push(i + 1, v)); return s; };
        const flat = [T.flatness([mk("mfu", [null, null])]), T.flatness([mk("gbs", [4, 4, 4])]), T.flatness([mk("l", [3, 2])])];
        const loss = mk("lm_loss", [5, 4, 3, 2, 1]);
        const grown = mk("x", [1, 1]); T.flatness([grown]); grown.push(3, 7);
        const axis = T.xAxis("step", new MetricStore());
        const data = {x_axis: "step", smoothing: 0.5,
                      series: T.visiblePoints([{series: loss, label: "lm_loss, run a", run: "a"}], 2, 4, axis, 0.5)};
        console.log(JSON.stringify({flat, grown: T.flatness([grown]), data, csv: T.toCsv(data)}));
    """)
    assert got["flat"] == [{"kind": "empty"}, {"kind": "constant", "value": 4}, None]
    assert got["grown"] is None  # the cached extent follows new points
    points = got["data"]["series"][0]["points"]
    assert [p[:3] for p in points] == [[2, 2, 4], [3, 3, 3], [4, 4, 2]]
    assert points[0][3] == pytest.approx((0.25 * 5 + 0.5 * 4) / 0.75)  # the smoothed value rides along
    lines = got["csv"].splitlines()
    assert lines[0] == "series,run,step,x,value,smoothed" and lines[1].startswith('"lm_loss, run a",a,2,2,4,')


def test_a_series_re_indexed_on_an_axis_keeps_its_values_and_rises_strictly() -> None:
    """The compare page's per-run axis: x = the run's own relative time (two points in one second nudged apart so
    decimation sees a strictly rising x), y and times shared, the step axis the series itself."""
    got = _run("""
        const store = new MetricStore();
        [[1, "2026-01-01T00:00:00Z"], [2, "2026-01-01T00:00:10Z"], [3, "2026-01-01T00:00:10Z"], [4, "2026-01-01T00:00:30Z"]]
            .forEach(([step, t]) => store.add(step, null, {loss: 10 - step}, t));
        const s = store.series.get("loss");
        const on = T.onAxis(s, T.xAxis("relative", store));
        console.log(JSON.stringify({x: Array.from(on.x), y: Array.from(on.y), n: on.n, label: on.label,
                                    same: T.onAxis(s, T.xAxis("step", store)) === s, source: Array.from(s.x.subarray(0, s.n))}));
    """)
    assert got["x"][:2] == [0, 10] and 10 < got["x"][2] < 10.001 and got["x"][3] == 30
    assert got["y"] == [9, 8, 7, 6] and got["n"] == 4 and got["label"] == "loss"
    assert got["same"] and got["source"] == [1, 2, 3, 4]


def test_moe_metrics_chart_next_to_the_loss() -> None:
    """An MoE run's load_balancing_loss shares the Loss chart; per-layer expert imbalance shares one chart."""
    got = _run(f"""
        const {{MAIN}} = await import("{(UI_JS / "chart_groups.js").as_uri()}");
        const names = ["lm_loss", "val_lm_loss", "load_balancing_loss", "loss_scale", "expert_load_imbalance_max",
                       "expert_load_imbalance_layer_3", "grad_norm", "dropped_token_fraction"];
        console.log(JSON.stringify(Object.fromEntries(names.map((n) => [n, (MAIN.find((g) => g.match(n)) || {{}}).title ?? null]))));
    """)
    assert got == {
        "lm_loss": "Loss",
        "val_lm_loss": "Loss",
        "load_balancing_loss": "Loss",
        "loss_scale": None,
        "expert_load_imbalance_max": "Expert load imbalance",
        "expert_load_imbalance_layer_3": "Expert load imbalance",
        "grad_norm": "Grad norm",
        "dropped_token_fraction": None,
    }


def test_preference_metrics_chart_beside_the_loss() -> None:
    """Stage dpo: margin and accuracy get their own charts right after the loss, training and held-out pairs
    together; the rewards and log-probs of both answers share one chart each."""
    got = _run(f"""
        const {{MAIN}} = await import("{(UI_JS / "chart_groups.js").as_uri()}");
        const names = ["lm_loss", "val_lm_loss", "rewards/margins", "val_rewards/margins", "rewards/accuracies",
                       "val_rewards/accuracies", "rewards/chosen", "rewards/rejected", "logps/chosen",
                       "val_logps/rejected", "logits/chosen"];
        console.log(JSON.stringify({{
          titles: Object.fromEntries(names.map((n) => [n, (MAIN.find((g) => g.match(n)) || {{}}).title ?? null])),
          order: MAIN.map((g) => g.title).slice(0, 4),
        }}));
    """)
    assert got["order"] == ["Loss", "Expert load imbalance", "Reward margin", "Preference accuracy"]
    assert got["titles"] == {
        "lm_loss": "Loss",
        "val_lm_loss": "Loss",
        "rewards/margins": "Reward margin",
        "val_rewards/margins": "Reward margin",
        "rewards/accuracies": "Preference accuracy",
        "val_rewards/accuracies": "Preference accuracy",
        "rewards/chosen": "Rewards (chosen, rejected)",
        "rewards/rejected": "Rewards (chosen, rejected)",
        "logps/chosen": "Log-probs (chosen, rejected)",
        "val_logps/rejected": "Log-probs (chosen, rejected)",
        "logits/chosen": None,
    }


def test_deployment_metrics_share_charts_by_kind() -> None:
    """A serve job's metrics (engine/serve/stats.py) chart as the deployment's figures: throughput, latency, queue."""
    got = _run(f"""
        const {{MAIN}} = await import("{(UI_JS / "chart_groups.js").as_uri()}");
        const names = ["serve_requests_per_s", "serve_prompt_tokens_per_s", "serve_generation_tokens_per_s",
                       "serve_ttft_p50_s", "serve_itl_p99_s", "serve_queue_depth", "serve_running",
                       "serve_kv_cache_usage", "serve_requests_total"];
        console.log(JSON.stringify(Object.fromEntries(names.map((n) => [n, (MAIN.find((g) => g.match(n)) || {{}}).title ?? null]))));
    """)
    tokens, latency = "Serving tokens/s (prompt, generated)", "Latency (s): time to first token, inter-token"
    assert got == {
        "serve_requests_per_s": "Requests/s",
        "serve_prompt_tokens_per_s": tokens,
        "serve_generation_tokens_per_s": tokens,
        "serve_ttft_p50_s": latency,
        "serve_itl_p99_s": latency,
        "serve_queue_depth": "Queue and slots",
        "serve_running": "Queue and slots",
        "serve_kv_cache_usage": "KV cache use",
        "serve_requests_total": None,  # running totals: "More metrics"
    }


def test_result_notes_mark_a_resumed_run_and_warnings() -> None:
    if NODE is None:
        pytest.skip("node is not installed")
    script = (
        f'import {{resultNotes}} from "{(UI_JS / "format.js").as_uri()}";\n'
        "console.log(JSON.stringify({"
        'resumed: resultNotes({resumed_from_job: "j1", start_iteration: 20}),'
        'warned: resultNotes({warnings: ["trained 0 iterations"]}), plain: resultNotes({iterations: 3})}));'
    )
    out = subprocess.run(
        [NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60, check=True
    )
    notes = json.loads(out.stdout)
    assert notes["resumed"] == ["Resumed from job j1's run at iteration 20 (resume: auto)"]
    assert notes["warned"] == ["Warning: trained 0 iterations"] and notes["plain"] == []


def test_chat_stream_folds_openai_chunks_split_anywhere() -> None:
    """The chat page's stream parser (openai_stream.js): SSE events cut at any byte boundary, the thought apart from
    the answer, the finish reason and the usage chunk, [DONE]; and both error shapes."""
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "User wants "}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "jazz."}}]},
        {"choices": [{"index": 0, "delta": {"content": "播放"}}]},
        {"choices": [{"index": 0, "delta": {"content": " jazz"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}},
    ]
    text = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    got = _run(f"""
        const S = await import("{(UI_JS / "openai_stream.js").as_uri()}");
        const text = {json.dumps(text, ensure_ascii=False)};
        const results = [];
        for (const size of [1, 7, 64, text.length]) {{
            const a = S.newAnswer();
            let rest = "";
            for (let i = 0; i < text.length; i += size) rest = S.feed(a, rest + text.slice(i, i + size));
            results.push(a);
        }}
        console.log(JSON.stringify({{results, errors: [
            S.errorMessage(429, {{error: {{message: "the queue is full", type: "rate_limit_error"}}}}),
            S.errorMessage(422, {{message: "deployment: not ready"}}), S.errorMessage(502, null)]}}));
    """)
    for answer in got["results"]:
        assert answer["content"] == "播放 jazz" and answer["reasoning"] == "User wants jazz."
        assert answer["finish"] == "stop" and answer["usage"]["completion_tokens"] == 7 and answer["done"]
        assert answer["chunks"] == len(chunks)
    assert got["errors"] == ["429: the queue is full", "422: deployment: not ready", "HTTP 502"]
