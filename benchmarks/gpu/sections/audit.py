"""8. ``maxout audit`` on a GPU (insight/audit.py): the seed reports' question, "are we maxed out?", answered for a
BERT-base-sized config as a new user would run it (fp32, no bucketing, eager attention, fused AdamW off): where the
time goes, what each lever the GPU supports buys in paired runs, and the verdict (share of the fastest configuration
measured, the overrides to get there). Compile is left out of the full run: two compiles do not fit the section."""

from __future__ import annotations

from .. import workloads
from ..registry import Context, Section

# A config far from maxed out on a GPU, so each lever has something to show.
NAIVE = ["hardware.precision=fp32", "data.bucketing=false", "hardware.attn_implementation=eager",
         "hardware.fused_adamw=false", "hardware.tf32=false", "hardware.compile=false"]


def run(ctx: Context) -> None:
    from maxout.insight import audit  # lazy: imports torch

    arch, batch = ("bert_base", 32) if ctx.full else ("tiny", 16)
    data = workloads.demo(ctx.work, copies=8) if ctx.full else workloads.demo(ctx.work, rows=64)
    overrides = [*workloads.model(arch), *data, *NAIVE, "tracking=none", "checkpoint.enabled=false",
                 f"train.batch_size={batch}", f"train.target_effective_batch={batch}"]
    only = None if ctx.full else ["bucketing", "fused_adamw"]
    budget = max(60.0, min(ctx.left() - 20, 300.0 if ctx.full else 90.0))
    options = {"steps": 20 if ctx.full else 3, "only": only, "progress": False}
    ctx.record("setup", {"model": arch, "overrides": overrides[len(workloads.model(arch)):], "budget_s": budget,
                         **options})
    report = audit.run_audit(overrides, budget, str(ctx.work / "audit"), **options)
    ctx.record("report", report)


def markdown(results: dict) -> str:
    from maxout.insight import audit_report  # lazy: imports maxout

    setup, report = results.get("setup", {}), results.get("report")
    head = (f"`maxout audit` of a random {setup.get('model')} with `{' '.join(setup.get('overrides', []))}`, "
            f"budget {setup.get('budget_s', 0):.0f} s.")
    return head + ("\n\n" + audit_report.markdown(report) if report else "")


SECTION = Section("audit", "maxout audit", run, needs=("mlflow",), min_s={"full": 120, "smoke": 30},
                  max_s={"full": 360, "smoke": 240}, markdown=markdown)
