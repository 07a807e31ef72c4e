"""The step budget of a profiled case of the mfu sections: where its steady step's milliseconds go against what P3
allows it. The step (from the run's optimizer steps a second), its kernel time by kind (the profile's: matmul,
attention, other), the matmuls' own TFLOP/s (the FLOPs torch.profiler counts for them) against the measured matmul
peak, and the step that P3's MFU would need at the case's tokens a step.

``python -m benchmarks.gpu.step_budget REPORT.json...`` prints the budgets of reports already written; those from
before the budget existed get theirs from the profile's shares and the run's samples a second."""

from __future__ import annotations

import json
import sys
from pathlib import Path

P3_TARGET = 0.35  # issue 37's P3: MFU of BERT-base at <= 128 tokens against the data sheet's dense peak


def kernel_ms_per_step(profile: dict) -> dict[str, float]:
    """A profile's kernel milliseconds a step by kind, from its shares of the kernel time over its steps."""
    return {k: share * profile["device_ms"] / profile["steps"] for k, share in profile["shares"].items()}


def step_budget(name: str, case: dict) -> str:
    """One case's budget (the module docstring), a sentence for the report."""
    p = case["profile"]
    # reports from before the budget carry no per_step_ms: the same figures from the shares
    per_step = p.get("per_step_ms") or (kernel_ms_per_step(p) if p.get("shares") else None)
    if not per_step:
        return f"Step budget of {name}: not in this report."
    if "step_ms" not in case:  # likewise: a step of micro_batch x accumulation rows, from samples/s
        case = {**case, "step_ms": 1e3 * case["micro_batch"] * case["accumulation"] / case["steady_samples_per_s"]}
    kernels = sum(per_step.values())
    parts = [f"matmul {per_step['matmul']:.1f} ms"]
    if p.get("matmul_tflops"):
        peak = case.get("measured_peak_tflops")
        parts[0] += (f" at {p['matmul_tflops']:.3g} TFLOP/s"
                     + (f" ({p['matmul_tflops'] / peak:.0%} of the measured matmul peak)" if peak else ""))
    parts += [f"attention {per_step['attention']:.1f} ms", f"other {per_step['other']:.1f} ms"]
    idle = case["step_ms"] - kernels  # negative where the profiled steps' kernels outlast the timed steps
    line = (f"Step budget of {name}: {case['step_ms']:.1f} ms a step, {kernels:.1f} ms of kernels "
            f"({', '.join(parts)}), " + (f"{idle:.1f} ms without one" if idle > 0 else "no time without one"))
    if case.get("mfu_datasheet"):
        needed = case["step_ms"] * case["mfu_datasheet"] / P3_TARGET
        line += (f". P3's {P3_TARGET:.0%} of the data sheet needs {needed:.1f} ms a step at these tokens a step"
                 + (f": {case['step_ms'] - needed:.1f} ms less" if needed < case["step_ms"] else ": met"))
    return line + "."


def budgets(report: dict) -> list[str]:
    """Every profiled case's step budget in a report.json (a call's, or the merged one)."""
    found = [s.get("results", {}) for s in report.get("sections", []) if s.get("name") in ("mfu", "mfu_compiled")]
    return [step_budget(name, c) for results in found for name, c in results.get("cases", {}).items()
            if c.get("profile")]


if __name__ == "__main__":
    for path in sys.argv[1:]:
        found = budgets(json.loads(Path(path).read_text()))
        if found:
            print(f"{path}:", *found, sep="\n")
        else:
            print(f"{path}: no profiled mfu case")
