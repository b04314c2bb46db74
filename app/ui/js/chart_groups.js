// Which metric names share a chart on the job page, in display order (pure data: node tests it without a DOM).
// A metric no group matches gets its own chart under "More metrics".

export const MAIN = [
  // lm_loss, val_lm_loss and an MoE run's load_balancing_loss (the switch loss, 1.0 when balanced) side by side
  {title: "Loss", match: (n) => /loss/.test(n) && !/scale|tokens/.test(n)},
  // MoE: max/mean tokens per expert, one series per MoE layer and the worst of them (engine/train/router_stats.py)
  {title: "Expert load imbalance", match: (n) => n.startsWith("expert_load_imbalance")},
  // stage dpo (TRL's names, engine/train/dpo.py; val_ on held-out pairs): margin and accuracy next to the loss
  {title: "Reward margin", match: (n) => /^(val_)?rewards\/margins$/.test(n)},
  {title: "Preference accuracy", match: (n) => /^(val_)?rewards\/accuracies$/.test(n)},
  {title: "Rewards (chosen, rejected)", match: (n) => /^(val_)?rewards\/(chosen|rejected)$/.test(n)},
  {title: "Log-probs (chosen, rejected)", match: (n) => /^(val_)?logps\/(chosen|rejected)$/.test(n)},
  {title: "Grad norm", match: (n) => n === "grad_norm"},
  {title: "Learning rate", match: (n) => n === "lr"},
  {title: "Tokens/s", match: (n) => n === "tokens_per_s"},
  {title: "Memory (MB)", match: (n) => n.startsWith("mem_")},
  // a serve job's deployment metrics (engine/serve/stats.py), one window per step
  {title: "Requests/s", match: (n) => n === "serve_requests_per_s"},
  {title: "Serving tokens/s (prompt, generated)", match: (n) => /^serve_(prompt|generation)_tokens_per_s$/.test(n)},
  {title: "Latency (s): time to first token, inter-token", match: (n) => /^serve_(ttft|itl)_p(50|99)_s$/.test(n)},
  {title: "Queue and slots", match: (n) => n === "serve_queue_depth" || n === "serve_running"},
  {title: "KV cache use", match: (n) => n === "serve_kv_cache_usage"},
];
// Device telemetry (worker/telemetry.py): its step is seconds since the node started, so these charts keep the
// step axis whatever the x-axis control says.
export const DEVICES = [
  {title: "Device utilisation (%)", match: (n) => n === "sys_util_pct"},
  {title: "Device memory (MB)", match: (n) => n === "sys_mem_used_mb" || n === "sys_mem_total_mb"},
  {title: "Device temperature (°C)", match: (n) => n === "sys_temp_c"},
  {title: "Device power (W)", match: (n) => n === "sys_power_w"},
];
