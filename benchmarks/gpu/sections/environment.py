"""1. Environment: the device, driver, CUDA, torch and transformers, and the matmul peak measured in this run next to
the data sheet's dense peak (bf16, fp16, TF32, fp32)."""

from __future__ import annotations

import time
from pathlib import Path

from ..registry import Context, Section

# (name, torch dtype name, TF32 on, the precision whose data-sheet peak applies)
KINDS = (("bf16", "bfloat16", False, "bf16"), ("fp16", "float16", False, "fp16"), ("tf32", "float32", True, "fp32"),
         ("fp32", "float32", False, "fp32"))


def matmul_tflops(dtype: str, tf32: bool, n: int, reps: int, device: str) -> float:
    """TFLOP/s of an n x n x n matmul: the mean of ``reps`` products after 3 warm-ups, on random data."""
    import torch  # lazy: the parent process never imports torch for this

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
        b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
        for _ in range(3):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        return 2 * n**3 * reps / (time.perf_counter() - started) / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def run(ctx: Context) -> None:
    import torch  # lazy: see matmul_tflops
    from maxout import hardware  # lazy: imports torch
    from maxout.train.run import library_versions  # lazy: imports torch

    device = hardware.detect()
    ctx.record("cuda", device.is_cuda)
    ctx.record("device", device.to_dict())
    versions = library_versions()
    versions.update({"cuda (torch build)": torch.version.cuda, "cudnn": device.cudnn_version,
                     "driver": device.driver_version})
    try:
        import triton  # lazy: optional; inductor's GPU kernels

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    ctx.record("versions", versions)
    n, reps = (8192, 10) if device.is_cuda else (512, 3)
    peaks = {}
    for name, dtype, tf32, sheet_precision in KINDS:
        if not device.is_cuda and name in ("fp16", "tf32"):
            continue  # CPU matmuls have neither
        measured = matmul_tflops(dtype, tf32, n, reps, device.torch_device)
        sheet = hardware.peak_flops(device, sheet_precision, tf32)
        peaks[name] = {"measured_tflops": measured, "datasheet_tflops": sheet / 1e12 if sheet else None,
                       "measured_over_datasheet": measured * 1e12 / sheet if sheet else None, "n": n}
        ctx.record("matmul", peaks)


def markdown(results: dict) -> str:
    device, versions = results.get("device", {}), results.get("versions", {})
    what = (f"{device.get('total_memory_gb')} GiB, compute capability {device.get('compute_capability')}, "
            f"{device.get('count')} visible" if device.get("kind") == "cuda" else
            f"CPU, {device.get('cpu_count')} cores, {device.get('host_memory_gb')} GiB")
    lines = [f"Device: **{device.get('name')}** ({what}); driver {versions.get('driver')}, CUDA "
             f"{versions.get('cuda (torch build)')}, cuDNN {versions.get('cudnn')}, torch {versions.get('torch')}, "
             f"transformers {versions.get('transformers')}, triton {versions.get('triton')}, Python "
             f"{versions.get('python')}.", ""]
    notes = device.get("notes") or []
    lines += [f"Notes: {'; '.join(notes)}", ""] if notes else []
    lines += ["| matmul | n | measured TFLOP/s | data sheet (dense) | measured / data sheet |", "|---|---|---|---|---|"]
    for name, p in results.get("matmul", {}).items():
        sheet = f"{p['datasheet_tflops']:.0f}" if p["datasheet_tflops"] else "–"
        ratio = f"{p['measured_over_datasheet']:.0%}" if p["measured_over_datasheet"] else "–"
        lines.append(f"| {name} | {p['n']} | {p['measured_tflops']:.3g} | {sheet} | {ratio} |")
    return "\n".join(lines)


def chart(results: dict, path: Path) -> bool:
    from .charts import bars  # lazy: matplotlib

    peaks = results.get("matmul", {})
    if not peaks:
        return False
    series = {"measured": [p["measured_tflops"] for p in peaks.values()]}
    if any(p["datasheet_tflops"] for p in peaks.values()):
        series["data sheet (dense)"] = [p["datasheet_tflops"] or 0.0 for p in peaks.values()]
    return bars(path, list(peaks), series, "TFLOP/s", "matmul peak: measured in this run vs data sheet")


SECTION = Section("environment", "Environment and matmul peak", run, needs=(),
                  min_s={"full": 20, "smoke": 5}, max_s={"full": 90, "smoke": 90}, markdown=markdown, chart=chart)
