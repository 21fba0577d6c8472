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
    return (
        f"{_num(prediction.get('tokens_per_second_per_gpu'))} tok/s, "
        f"{_num(100 * prediction.get('mfu', float('nan')), '.1f')}% MFU, "
        f"{_num(prediction.get('reserved_peak_gib'), '.2f')} GiB"
    )


TABLES = {
    "canon": "Trainer: llama vs llama_canon, 1B, seq 4096, batch 8 (the recipes') and 2, compile "
    "(targets at batch 8: "
    "x0.97 tokens/s or more, x1.05 peak memory or less)",
    "linear": "Trainer: linear models vs llama, 1B, compile: the recipes' 16,384 x 1 (target: x1.5 "
    "tokens/s), then "
    "4096 x 2 for information",
    "float8": "Trainer: float8 vs bf16, llama_canon (triton), 1B, seq 4096, batch 2, compile",
}


def _trainer_table(
    runs: list[dict],
    everything: dict[str, dict],
    title: str,
    unmeasured: dict[str, str] | None = None,
) -> list[str]:
    """One table: each run with its ratio to its ``base`` run (``everything``: every run by case),
    then a row for each case of ``unmeasured`` (case -> why: skipped, timed out, failed)."""
    planner = any("planner" in r for r in runs)
    lines = [
        f"**{title}**",
        "",
        "| run | seq | tokens/s | x base | MFU % | peak reserved GiB | x base | "
        "peak active GiB | step 1 s |" + (" planner |" if planner else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if planner else ""),
    ]
    shown: list[dict] = []  # the bases from other tables first, so that each table is read alone
    for r in [everything[r["base"]] for r in runs if r.get("base") in everything] + runs:
        if r not in shown:
            shown.append(r)
    for r in shown:
        base = (
            everything.get(r.get("base")) if r in runs else None
        )  # a base from another table: "-"
        speed = f"x{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "-"
        memory = f"x{r['peak_reserved_gib'] / base['peak_reserved_gib']:.3f}" if base else "-"
        lines.append(
            f"| {r['label']} | {r['seq_len']} | {_num(r['tokens_per_s'])} | {speed} | "
            f"{_num(r['mfu_pct'], '.1f')} | {_num(r['peak_reserved_gib'], '.2f')} | {memory} | "
            f"{_num(r['peak_active_gib'], '.2f')} | {_num(r.get('first_step_s'), '.1f')} |"
            + (f" {_planner(r)} |" if planner else "")
        )
    lines += [
        f"| {case} | | {why} | | | | | | |" + (" |" if planner else "")
        for case, why in (unmeasured or {}).items()
    ]
    kernels = sorted({r["kernels"] for r in runs if r.get("kernels")})
    lines += ([""] + [f"_kernels: {k}_" for k in kernels] if kernels else []) + [""]
    return lines + [
        line for r in runs for line in _profile(r) + _canon_step(r, everything.get(r.get("base")))
    ]


def _canon_step(run: dict, base: dict | None) -> list[str]:
    """A LlamaCanon step against its Llama base's, from their profiled steps: the Canon kernels, the
    kernels they replace (Inductor's fused ones: the norms and SwiGLU that the Canon ops fuse) and
    the idle GPU time."""
    if not base or "canon" not in run.get("label", "") or "canon" in base.get("label", ""):
        return []
    profiles = [r.get("profile_summary") for r in (run, base)]
    if not all(
        isinstance(p, dict) and p.get("total_ms") and r.get("tokens_per_s")
        for p, r in zip(profiles, (run, base))
    ):
        return []

    def idle(r: dict, p: dict) -> float:
        return max(1000 * r["batch"] * r["seq_len"] / r["tokens_per_s"] - p["total_ms"], 0.0)

    (mine, theirs), kinds = profiles, ("canon (triton)", "inductor (fused)")
    canon_ms, fused, fused_base = (
        mine["kinds_ms"].get(kinds[0], 0.0),
        mine["kinds_ms"].get(kinds[1], 0.0),
        theirs["kinds_ms"].get(kinds[1], 0.0),
    )
    return [
        f"- {run['label']} against {base['label']}, ms per step: Canon kernels "
        f"{canon_ms:.1f}; Inductor's fused "
        f"kernels {fused:.1f} against {fused_base:.1f} (taken over by Canon's ops: "
        f"{fused_base - fused:.1f}); "
        f"idle {idle(run, mine):.1f} against {idle(base, theirs):.1f}; all kernels "
        f"{mine['total_ms']:.1f} "
        f"against {theirs['total_ms']:.1f}",
        "",
    ]


def _profile(run: dict) -> list[str]:
    """Where one profiled step's time went: the share of each kind of kernel, then the largest
    five."""
    p = run.get("profile_summary")
    if not isinstance(p, dict) or not p.get("total_ms"):
        return []
    total = p["total_ms"]
    kinds = ", ".join(f"{k} {100 * ms / total:.0f}%" for k, ms in p["kinds_ms"].items())
    top = "; ".join(f"`{name[:60]}` {ms:.1f} ms" for name, ms in p["top_ms"][:5])
    return [
        f"- profile of {run['label']} at {run['seq_len']} (one step, {total:,.1f} ms of "
        f"kernels): {kinds}. "
        f"Largest: {top}",
        *_host(p.get("host")),
        *_planned_by_kind(run, p),
        "",
    ]


def _host(host: dict | None) -> list[str]:
    """The host's side of the profiled step (where idle GPU time comes from)."""
    if not host or not (host.get("step_ms") or host.get("launches")):
        return []
    ops = "; ".join(
        f"`{name.split('::', 1)[-1]}` {o['calls']} calls {o['ms']:.1f} ms"
        + (f" ({o['launches']} launches, {o['launch_ms']:.1f} ms)" if o.get("launches") else "")
        for name, o in list(host["custom_ops"].items())[:6]
    )
    span = f"the step spans {host['step_ms']:.1f} ms on the host, " if host.get("step_ms") else ""
    return [
        f"  host: {span}{host['launches']:,} kernel launches ({host['launch_ms']:.1f} ms "
        "in the launch calls)" + (f"; custom ops (launches included): {ops}" if ops else "")
    ]


PLANNED_KIND = {
    "gemm": "matmul",
    "attention": "attention",
    "canon (triton)": "canon",
    "fla / mamba (triton)": "recurrence",
}
"""The profile's kinds as the planner names them; every other kind is the planner's ``other``."""


def by_planner_kind(run: dict) -> dict[str, tuple[float, float]] | None:
    """Milliseconds per op kind, (planned, measured), for a run with a profiled step and a plan:
    matmul, attention, canon, recurrence, other, and ``idle`` (the measured step time less its
    kernels: launch gaps and host work; the plan has none)."""
    profile, plan = run.get("profile_summary"), run.get("planner") or {}
    ranks = plan.get("ranks") or []
    if not isinstance(profile, dict) or not ranks or not run.get("tokens_per_s"):
        return None
    planned = {kind: 1000 * s for kind, s in ranks[0]["time"]["compute"].items()}
    measured: dict[str, float] = {}
    for kind, ms in profile["kinds_ms"].items():
        name = PLANNED_KIND.get(kind, "other")
        measured[name] = measured.get(name, 0.0) + ms
    step_ms = 1000 * run["batch"] * run["seq_len"] / run["tokens_per_s"]
    measured["idle"] = max(step_ms - profile["total_ms"], 0.0)
    planned["idle"] = 1000 * plan["step_seconds"] - sum(planned.values())
    return {
        k: (planned.get(k, 0.0), measured.get(k, 0.0)) for k in dict.fromkeys([*planned, *measured])
    }


def _planned_by_kind(run: dict, profile: dict) -> list[str]:
    kinds = by_planner_kind(run)
    if not kinds:
        return []
    cells = ", ".join(
        f"{k} {planned:.1f} / {measured:.1f}" for k, (planned, measured) in kinds.items()
    )
    return [f"  planned / measured ms by kind: {cells}"]


def markdown(report: dict) -> str:
    steps = report["steps"]
    env = steps.get("env", {}).get("data", {})
    lines = [
        f"# gpu_check {datetime.date.today()}"
        + (" (tiny: toy sizes on the CPU, not a measurement)" if report["tiny"] else ""),
        "",
    ]
    if env:
        lines += [
            f"GPU {env.get('gpu', 'none')} {env.get('capability', '')}, driver "
            f"{env.get('driver', '-')}, "
            f"host {env.get('host', '-')}, Python {env['python']}; "
            + ", ".join(f"{k} {v}" for k, v in env["packages"].items()),
            "",
            "auto picks: " + "; ".join(f"{op} {b}" for op, b in env["auto_backends"].items()),
            "",
        ]
    lines += ["| step | status | seconds | limit | host load before |", "|---|---|---:|---:|---:|"]
    lines += [
        f"| {name} | {s.get('status')}"
        f"{f' ({n} leftover processes killed)' if (n := s.get('leftovers_killed')) else ''} | "
        f"{s.get('seconds', '')} | {s.get('limit', '')} | {s.get('load_before', '')} |"
        for name, s in steps.items()
    ]
    lines.append("")
    for name, s in steps.items():
        if s.get("tail"):
            lines += [f"{name}, last lines:", "```", *s["tail"], "```", ""]
    tests = steps.get("kernel_tests", {}).get("tests")
    if tests:
        lines += [
            f"**Kernel tests**: {tests['tests']} run, {tests['failures']} failed, "
            f"{tests['errors']} errors, "
            f"{tests['skipped']} skipped",
            *[f"- failed: {t}" for t in tests["failed"]],
            "",
        ]
    losses = steps.get("losses", {}).get("data")
    if losses:
        lines += [
            "**Loss curves, Triton kernels against torch** (same seed and data)",
            "",
            "| pair | steps | loss first -> last | max abs diff | max rel diff |",
            "|---|---:|---|---:|---:|",
        ]
        lines += [
            f"| {pair} | {r['steps']} | {r['first_loss']:.4f} -> {r['last_loss']:.4f} | "
            f"{r['max_abs_diff']:.2e} | "
            f"{r['max_rel_diff']:.2e} |"
            for pair, r in losses.items()
        ]
        lines += (
            [""]
            + [
                f"_kernels of {pair.split(' vs ')[0]}: {r['kernels']}_"
                for pair, r in losses.items()
            ]
            + [""]
        )
    runs = [
        s["data"]
        for s in steps.values()
        if isinstance(s.get("data"), dict) and "table" in s["data"]
    ]
    everything = {r["case"]: r for r in runs}
    # A linear case without figures says why in its table (GDN2 where fla refuses its backward, a
    # first step past its limit).
    unmeasured = {
        name: s.get("status")
        for name, s in steps.items()
        if name.startswith("linear_") and not isinstance(s.get("data"), dict)
    }
    for table, title in TABLES.items():
        mine = [r for r in runs if r["table"] == table]
        if mine:
            lines += _trainer_table(
                mine, everything, title, unmeasured if table == "linear" else None
            )
    for step, kind in (("canon_bwd_blocks", "backward"), ("canon_fwd_blocks", "forward")):
        blocks = steps.get(step, {}).get("data")
        if not blocks:
            continue
        lines += [
            f"**Canon {kind} kernels by block configuration**, {blocks['device']}, batch "
            f"{blocks['batch']} x "
            f"seq {blocks['seq']} (* = the fixed configuration of this checkout)",
            "",
            "| call | channels | config | ms | memory bound ms |",
            "|---|---:|---|---:|---:|",
        ]
        lines += [
            f"| {r['call']} | {r['channels']} | "
            f"{r['config']}{' *' if r['current'] else ''} | {r['ms']:.3f} | "
            f"{_num(r.get('bound_ms'), '.3f')} |"
            for r in blocks["rows"]
        ]
        lines.append("")
    gemms = steps.get("float8_gemms", {}).get("data")
    if gemms:
        from bench_float8_gemm import table as float8_gemm_table

        lines += [
            f"**{line}**" if i == 0 else line for i, line in enumerate(float8_gemm_table(gemms))
        ] + [""]
    ops = steps.get("ops", {}).get("data")
    if ops:
        lines += [
            f"**Canon ops**, forward + backward, {ops['device']}, batch {ops['batch']} x "
            f"seq {ops['seq']}"
            + (
                f", copy bandwidth {ops['copy_bandwidth_gb_s']:,.0f} GB/s"
                if ops["copy_bandwidth_gb_s"]
                else ""
            ),
            "",
            "| call | channels | first call s | triton ms | fla causal_conv1d ms | memory "
            "bound ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {c['call']} | {c['channels']} | {c['first_call_s']:.2f} | {c['triton_ms']:.3f} | "
            f"{_num(c.get('fla_causal_conv1d_ms'), '.3f')} | {_num(c.get('bound_ms'), '.3f')} |"
            for c in ops["calls"]
        ]
        lines += [""] + [f"- autotuned {k}: {v}" for k, v in ops["tuned"].items()] + [""]
    cp = steps.get("cp_attention", {}).get("data")
    if cp:
        from cp_attention_rank import table as cp_attention_table

        lines += [
            f"**{line}**" if i == 0 else line for i, line in enumerate(cp_attention_table(cp))
        ] + [""]
    if "planner" in report:
        lines += [f"_{report['planner']}_", ""]
    return "\n".join(lines)
