"""check-hardware: prints on a CPU, --json parses, every unavailable speed-up carries its reason, and a described
GPU renders its compute capability and the profile auto would pick."""

from __future__ import annotations

import json

import pytest

from maxout import cli, loading
from maxout.insight import hardware_report

from .conftest import fake_cuda


def test_check_hardware_prints_on_cpu(capsys, tmp_path):
    assert cli.main(["check-hardware", "model=tiny", f"batch_finder.cache_path={tmp_path / 'c.json'}"]) == 0
    out = capsys.readouterr().out
    for text in ("Device", "CPU cores", "host memory", "Speed-ups on this device", "fp16 autocast + GradScaler",
                 "no CUDA device", "Versions", "hardware=auto picks", "cpu (no CUDA device visible)",
                 "recommended batch", "micro-batch 16 x accumulation 1"):
        assert text in out, text


def test_check_hardware_json_parses(capsys, tmp_path, cpu_device, tokenized_rows):
    args = ["check-hardware", "model=tiny", "train.target_effective_batch=64", "batch_finder.memory_budget_gb=2",
            f"batch_finder.cache_path={tmp_path / 'c.json'}", "--json"]
    assert cli.main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["device"]["kind"] == "cpu" and rep["device"]["cpu_count"] == cpu_device.cpu_count
    assert rep["auto_profile"] == {"name": "cpu", "why": "no CUDA device visible"}
    assert rep["support"]["TF32 matmuls"] == {"ok": False, "reason": "no CUDA device"}
    assert all(s["ok"] or s["reason"] for s in rep["support"].values())  # nothing unavailable without a why
    assert rep["versions"]["torch"] == cpu_device.torch_version
    batch = rep["batch"]
    assert batch["source"] == "search" and batch["micro_batch"] == 64 and batch["budget_gb"] == 2.0
    # The search's longest row and its probe's set-up tokenized the demo's 800 training rows once, not twice
    assert tokenized_rows[800] == 1
    # The search was cached: the same report without probing says so.
    assert cli.main([*args[:-1], "--no-search", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)["batch"]
    assert again["source"] == "cache" and again["max_batch"] == batch["max_batch"]


def test_no_search_without_a_cached_result_says_so(capsys, tmp_path):
    cfg = loading.load(["hardware=cpu", "model=tiny", f"batch_finder.cache_path={tmp_path / 'empty.json'}"])
    from maxout import hardware

    rep = hardware_report.report(cfg, hardware.detect(), search=False)
    assert "not in the batch finder's cache" in rep["batch"]["error"]


def test_a_described_gpu_renders_its_capabilities_and_profile(tmp_path):
    from rich.console import Console

    device = fake_cuda(name="NVIDIA GeForce RTX 3090", memory_gb=24.0, cc=(8, 6))
    cfg = loading.load(["hardware=rtx3090", "model=tiny", f"batch_finder.cache_path={tmp_path / 'c.json'}"],
                       device=device)
    rep = hardware_report.report(cfg, device, search=False)  # no probes: there is no GPU to run them on
    assert rep["auto_profile"]["name"] == "rtx3090" and rep["support"]["TF32 matmuls"]["ok"] is True
    assert rep["support"]["flash-attention 2"] == {"ok": False, "reason": "the flash_attn package is not installed"}
    console = Console(record=True, width=140)
    for table in hardware_report.render(rep):
        console.print(table)
    text = console.export_text()
    assert "compute capability │ 8.6" in text and "24.0 GiB" in text and "matches profile 'rtx3090'" in text


@pytest.mark.gpu
def test_check_hardware_on_a_gpu_reports_the_device_and_a_searched_batch(capsys, tmp_path):
    args = ["check-hardware", "hardware=auto", "model=tiny", f"batch_finder.cache_path={tmp_path / 'c.json'}", "--json"]
    assert cli.main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["device"]["kind"] == "cuda" and rep["device"]["compute_capability"]
    assert rep["versions"]["cuda (torch build)"] and rep["batch"]["micro_batch"] >= 1
    assert rep["support"]["pinned memory"]["ok"] is True
