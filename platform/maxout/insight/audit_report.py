"""The audit's report in its four forms: ``audit.json`` (the data), ``audit.md`` (what the MLflow run page shows as
its description), two charts (speed-up per lever, time breakdown) and rich tables for the console.

All of them are drawn from the one report dict audit.py assembles, so they cannot disagree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import pandas as pd
from rich.markup import escape
from rich.table import Table

from .charts import plot  # not benchmark.py: that imports the training stack

STATUS_STYLE = {"measured": "green", "in use": "dim", "cannot use": "red", "skipped": "dim", "not reached": "yellow",
                "failed": "red"}


def num(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec) + suffix


def where_the_time_goes(report: dict) -> list[tuple[str, str]]:
    c, device = report["current"], report["device"]
    mfu = (f"{num(c['mfu'], '.1%')} of {c['peak_tflops']:g} TFLOP/s ({c['precision']} peak)" if c["peak_tflops"]
           else f"– (no peak FLOP/s known for {device['name']})")
    return [
        ("throughput", f"{num(c['samples_per_s'], '.1f')} samples/s, {num(c['tokens_per_s'], '.0f')} tokens/s "
                       f"(steady state, median of {c['runs']} runs)"),
        ("MFU", mfu),
        ("padding efficiency", f"{num(c['padding_efficiency'], '.1%')} of processed tokens are real"),
        ("GPU utilization", f"{num(c['gpu_utilization'], '.0f')} % (NVML, inside the training window)"
         if c["gpu_utilization"] is not None else "– (no GPU)"),
        ("step time", f"{num(c['step_ms'], '.1f')} ms: data wait {num(c['data_wait_share'], '.1%')}, optimizer step "
                      f"{num(c['optimizer_share'], '.1%')}, forward + backward and the rest "
                      f"{num(c['forward_backward_share'], '.1%')}"),
        ("host syncs per step", f"{num(c['host_syncs_per_step'], '.2f')} ({c['sync_source']})"),
        ("peak memory", f"{num(c['peak_memory_gb'], '.3f')} GiB of {num(c['memory_limit_gb'], '.1f')} GiB, headroom "
                        f"{num(c['headroom_gb'], '.1f')} GiB ({c['memory_source']})"),
        ("batch", f"micro-batch {c['micro_batch']} x accumulation {c['accumulation_steps']}"),
    ]


def lever_row(lever: dict) -> dict[str, str]:
    measured = lever["status"] == "measured"
    note = lever["reason"] if not measured else lever["overrides"]
    if lever["cost"] and lever["status"] not in ("in use", "skipped"):
        note = f"{note}; cost: {lever['cost']}"
    return {"lever": lever["name"], "status": lever["status"],
            "speed-up": num(lever.get("speedup"), ".2f", "x") if measured else "–",
            "after / before current": (f"{num(lever['speedup_after_current'], '.2f')} / "
                                       f"{num(lever['speedup_before_current'], '.2f')}" if measured else "–"),
            "memory": num(lever.get("memory_ratio"), ".2f", "x") if measured else "–",
            "compile s": num(lever.get("compile_s"), ".1f") if measured and lever.get("compile_s") else "–",
            "note": note}


def markdown(report: dict) -> str:
    v, cfg, device = report["verdict"], report["config"], report["device"]
    lines = [f"**Verdict: {v['text']}.**", ""]  # first: the run page shows the first lines of a description
    if v["overrides"]:
        lines += [f"Use: `maxout train {v['command']}`", ""]
    lines += [f"Compile: {v['compile']['text']}.", ""]
    if v["with_cost"]:
        lines += ["Faster, with a cost (not recommended without checking it): " + "; ".join(
            f"{c['lever']} {c['speedup']:.2f}x ({c['cost']})" for c in v["with_cost"]), ""]
    if v["not_reached"]:
        lines += [f"Not reached within the budget of {report['budget_s']:g} s: {', '.join(v['not_reached'])} "
                  f"(raise --budget-s).", ""]
    best = report["best"]
    if best["levers"] and len(best["levers"]) > 1:
        state = (f"measured {num(best.get('speedup'), '.2f', 'x')}" if best["measured"]
                 else f"not measured ({best.get('reason', '')})")
        lines += [f"Best combination ({', '.join(best['levers'])}): {state}.", ""]
    lines += [f"maxout audit of `{cfg['name']}` on {device['label']}.", ""]
    lines += ["### Where the time goes", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v_.replace('|', '/')} |" for k, v_ in where_the_time_goes(report)]
    head = ["lever", "status", "speed-up", "after / before current", "memory", "compile s", "note"]
    lines += ["", "### Levers", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lever in report["levers"]:
        row = lever_row(lever)
        lines.append("| " + " | ".join(row[h].replace("|", "/") for h in head) + " |")
    lines += ["", f"Each measured lever: {report['steps']} steady-state steps per run, two runs, each paired with "
                  f"the current config's run right before or right after it; speed-up = median of the two ratios "
                  f"of samples/s. Device: {device['label']}. Budget {report['budget_s']:g} s, "
                  f"used {report['elapsed_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> dict[str, Path]:
    files = {"json": out / "audit.json", "markdown": out / "audit.md", "speedup_png": out / "speedup.png",
             "breakdown_png": out / "breakdown.png"}
    files["json"].write_text(json.dumps(report, indent=2, default=str))
    files["markdown"].write_text(markdown(report))
    bars = [(lever["name"], lever["speedup"]) for lever in report["levers"] if lever["status"] == "measured"]
    best = report["best"]
    if best.get("measured"):
        bars.append(("best combination", best["speedup"]))
    table = pd.DataFrame({"cell": [n for n, _ in bars] or ["(none measured)"],
                          "speed-up": [s for _, s in bars] or [float("nan")]})
    plot(table, "speed-up", f"steady-state samples/s vs the current config ({report['device']['label']})",
         files["speedup_png"])
    plot_breakdown(report["current"], files["breakdown_png"])
    return files


def plot_breakdown(current: dict, path: Path) -> None:
    import matplotlib  # lazy: 0.6 s to import, and only the charts need it

    matplotlib.use("Agg")  # no display on servers and in CI; chosen before pyplot is imported
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen

    parts = [("data wait", current["data_wait_share"], "tab:orange"),
             ("forward + backward (+ clip, zero_grad)", current["forward_backward_share"], "tab:blue"),
             ("optimizer step", current["optimizer_share"], "tab:green")]
    fig, ax = plt.subplots(figsize=(9, 1.9))
    left = 0.0
    for label, share, color in parts:
        ax.barh([0], [share], left=left, color=color, label=f"{label} {share:.1%}")
        left += share
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel(f"share of a steady-state step ({current['step_ms']:.1f} ms)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=3, fontsize=8, frameon=False)
    ax.set_title("Where the time goes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render(report: dict, url: Optional[str] = None) -> list:
    """Rich renderables: where the time goes, the levers, the verdict."""
    time_table = Table(title="Where the time goes (the config as it stands)", show_header=False,
                       title_justify="left")
    time_table.add_column(style="bold", no_wrap=True)
    time_table.add_column(overflow="fold")
    for key, value in where_the_time_goes(report):
        time_table.add_row(key, escape(value))
    lever_table = Table(title="Levers (speed-up: median of the runs after / before the current config's)",
                        title_justify="left")
    for name in ("lever", "status", "speed-up", "memory", "note"):
        lever_table.add_column(name, style="bold" if name == "lever" else None, no_wrap=name != "note",
                               overflow="fold")
    for lever in report["levers"]:
        row = lever_row(lever)
        speedup = row["speed-up"] + (f" ({row['after / before current']})" if row["speed-up"] != "–" else "")
        note = row["note"] + (f"; compile {row['compile s']} s" if row["compile s"] != "–" else "")
        style = STATUS_STYLE.get(lever["status"], "")
        lever_table.add_row(row["lever"], f"[{style}]{row['status']}[/]", speedup, row["memory"], escape(note))
    v = report["verdict"]
    verdict = Table(title="Verdict", show_header=False, title_justify="left")
    verdict.add_column(style="bold", no_wrap=True)
    verdict.add_column(overflow="fold")
    verdict.add_row("share", escape(v["text"]))
    verdict.add_row("use", escape(v["overrides"] or "the config as it stands"))
    verdict.add_row("compile", escape(v["compile"]["text"]))
    if v["with_cost"]:
        verdict.add_row("with a cost", escape("; ".join(f"{c['lever']} {c['speedup']:.2f}x ({c['cost']})"
                                                        for c in v["with_cost"])))
    if v["not_reached"]:
        verdict.add_row("not reached", f"{', '.join(v['not_reached'])} (budget {report['budget_s']:g} s)")
    if url:
        verdict.add_row("MLflow", url)
    return [time_table, lever_table, verdict]
