"""gpu_check.md from gpu_check.py's results (imported by it)."""

from __future__ import annotations

import datetime


def _num(value, fmt: str = ",.0f") -> str:
    return "-" if value is None or value != value else format(value, fmt)


def _planner(run: dict) -> str:
    """The planner's prediction beside the measurement: tokens/s, MFU and peak reserved memory."""
    prediction = run.get("planner")
    if prediction is None:
        return ""
    if "error" in prediction:
        return f"error: {' '.join(prediction['error'])}"
    return (f"{_num(prediction.get('tokens_per_second_per_gpu'))} tok/s, "
            f"{_num(100 * prediction.get('mfu', float('nan')), '.1f')}% MFU, "
            f"{_num(prediction.get('reserved_peak_gib'), '.2f')} GiB")


def _trainer_table(runs: list[dict], title: str, base_label: str | None) -> list[str]:
    planner = any("planner" in r for r in runs)
    lines = [f"**{title}**", "", "| run | seq | tokens/s | x base | MFU % | peak reserved GiB | peak active GiB | "
             "step 1 s |" + (" planner |" if planner else ""), "|---|---:|---:|---:|---:|---:|---:|---:|"
             + ("---|" if planner else "")]
    for r in runs:
        label = r.get("label") or r.get("spec") or r["model"]
        base = next((b for b in runs if (b.get("label") or b.get("spec") or b["model"]) == base_label
                     and b["seq_len"] == r["seq_len"]), None)
        ratio = f"x{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "-"
        lines.append(f"| {label} | {r['seq_len']} | {_num(r['tokens_per_s'])} | {ratio} | {_num(r['mfu_pct'], '.1f')} | "
                     f"{_num(r['peak_reserved_gib'], '.2f')} | {_num(r['peak_active_gib'], '.2f')} | "
                     f"{_num(r.get('first_step_s'), '.1f')} |" + (f" {_planner(r)} |" if planner else ""))
    kernels = sorted({r["kernels"] for r in runs if r.get("kernels")})
    return lines + ([""] + [f"_kernels: {k}_" for k in kernels] if kernels else []) + [""]


def markdown(report: dict) -> str:
    steps = report["steps"]
    env = steps.get("env", {}).get("data", {})
    lines = [f"# gpu_check {datetime.date.today()}" + (" (tiny: toy sizes on the CPU, not a measurement)"
                                                      if report["tiny"] else ""), ""]
    if env:
        lines += [f"GPU {env.get('gpu', 'none')} {env.get('capability', '')}, driver {env.get('driver', '-')}, "
                  f"Python {env['python']}; " + ", ".join(f"{k} {v}" for k, v in env["packages"].items()), "",
                  "auto picks: " + "; ".join(f"{op} {b}" for op, b in env["auto_backends"].items()), ""]
    lines += ["| step | status | seconds | limit |", "|---|---|---:|---:|"]
    lines += [f"| {name} | {s.get('status')} | {s.get('seconds')} | {s.get('limit')} |" for name, s in steps.items()]
    lines.append("")
    for name, s in steps.items():
        if s.get("tail"):
            lines += [f"{name}, last lines:", "```", *s["tail"], "```", ""]
    tests = steps.get("kernel_tests", {}).get("tests")
    if tests:
        lines += [f"**Kernel tests**: {tests['tests']} run, {tests['failures']} failed, {tests['errors']} errors, "
                  f"{tests['skipped']} skipped", *[f"- failed: {t}" for t in tests["failed"]], ""]
    losses = steps.get("losses", {}).get("data")
    if losses:
        lines += ["**Loss curves, Triton kernels against torch** (same seed and data)", "",
                  "| pair | steps | loss first -> last | max abs diff | max rel diff |", "|---|---:|---|---:|---:|"]
        lines += [f"| {pair} | {r['steps']} | {r['first_loss']:.4f} -> {r['last_loss']:.4f} | {r['max_abs_diff']:.2e} | "
                  f"{r['max_rel_diff']:.2e} |" for pair, r in losses.items()]
        lines += [""] + [f"_kernels of {pair.split(' vs ')[0]}: {r['kernels']}_" for pair, r in losses.items()] + [""]
    canon = steps.get("canon_trainer", {}).get("data")
    if canon:
        lines += _trainer_table(canon, "Trainer: llama vs llama_canon (targets x0.97 tokens/s, x1.05 memory)", "llama")
    ops = steps.get("ops", {}).get("data")
    if ops:
        lines += [f"**Canon ops**, forward + backward, {ops['device']}, batch {ops['batch']} x seq {ops['seq']}" +
                  (f", copy bandwidth {ops['copy_bandwidth_gb_s']:,.0f} GB/s" if ops["copy_bandwidth_gb_s"] else ""), "",
                  "| call | channels | first call s | triton ms | fla causal_conv1d ms | memory bound ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {c['call']} | {c['channels']} | {c['first_call_s']:.2f} | {c['triton_ms']:.3f} | "
                  f"{_num(c.get('fla_causal_conv1d_ms'), '.3f')} | {_num(c.get('bound_ms'), '.3f')} |"
                  for c in ops["calls"]]
        lines += [""] + [f"- autotuned {k}: {v}" for k, v in ops["tuned"].items()] + [""]
    linear = (steps.get("linear_trainer", {}).get("data") or {}).get("trainer")
    if linear:
        lines += _trainer_table(linear, "Trainer: linear models vs llama (targets x0.9 at 4096, x1.5 at 16384)",
                                "llama")
    float8 = [r for name, s in steps.items() if name.startswith("float8") for r in s.get("data") or []]
    if float8:
        for name in ("float8_tensorwise", "float8_rowwise"):
            for r in steps.get(name, {}).get("data") or []:
                r["label"] = f"{r['label']} {name.split('_')[1]}"
        bf16 = [dict(r, label=f"{r['label']} bf16") for r in canon or [] if r.get("canon_backend") == "triton"]
        lines += _trainer_table(bf16 + float8, "Trainer: float8 (llama_canon, triton)",
                                bf16[0]["label"] if bf16 else None)
    if "planner" in report:
        lines += [f"_{report['planner']}_", ""]
    return "\n".join(lines)
