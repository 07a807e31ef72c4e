"""The GPU report (benchmarks/gpu_report.py) and what it carries (benchmarks/gpu/wheels.py, closure.py).

Stand-in sections (tests/gpu_report_fakes.py) run in the real runner's child processes: one that works, one that
raises, one that hangs past its limit, one that crashes, ones that cannot run here or do not fit the budget; the
report keeps what each recorded and says why each did not finish. A runner killed mid-way leaves a report. The real
report runs on this CPU at smoke scale: the CPU-safe sections run, the CUDA ones say why they did not. pytest's
JUnit XML becomes per-test rows; the profile's kernel kinds; the wheel pins follow the lock; and maxout's GPU paths run
with only the GPU image's packages and the carried wheels importable (slow)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import types

import pandas as pd
import pytest
import torch
from packaging.utils import canonicalize_name

from benchmarks import gpu_report
from benchmarks.gpu import host_time, report, step_budget, wheels, workloads
from benchmarks.gpu.sections import EXPECTED_S, PLANS, SECTIONS, gpu_tests, hpo, mfu, vs_trainer

from . import warm_maxout
from .conftest import ROOT

FAKES = ["--registry", "tests.gpu_report_fakes:SECTIONS", "--cuda", "no"]
PNG = b"\x89PNG\r\n\x1a\n"


def entries(out) -> dict:
    return {e["name"]: e for e in json.loads((out / "report.json").read_text())["sections"]}


def test_each_section_keeps_what_it_measured_and_says_why_it_did_not_finish(tmp_path, capsys):
    out = tmp_path / "report"
    code = gpu_report.main(["--out", str(out), "--budget-s", "120", *FAKES])
    assert code == 1  # a section failed and one crashed: the command says so, the report is still whole
    got = entries(out)
    assert got["works"]["status"] == "ok" and got["works"]["results"]["value"] == 42
    assert got["works"]["results"]["previous"] == []  # the first section: nothing before it
    assert (got["raises"]["status"], got["raises"]["error"]) == ("failed", "ValueError: boom")
    assert got["raises"]["results"] == {"half": "done"} and "Traceback" in got["raises"]["traceback"]
    assert got["hangs"]["status"] == "timeout" and got["hangs"]["results"]["first"] == "measured"
    assert got["hangs"]["reason"] == "killed at its limit of 8 s; what it recorded before is kept"
    assert not got["hangs"].get("budget_cut")  # its own limit, not the budget: running it again would not help
    assert got["crashes"]["status"] == "crashed" and got["crashes"]["results"] == {"before": "the crash"}
    assert got["crashes"]["error"] == "the process ended with exit code 3 before it reported"
    assert (got["needs_gpu"]["status"], got["needs_gpu"]["reason"]) == ("skipped", "needs a CUDA device, here")
    assert got["needs_lib"]["reason"] == "needs the no_such_library_here package, which is not installed"
    assert got["late"]["status"] == "skipped" and got["late"]["budget_cut"]
    assert got["late"]["reason"].startswith("time budget: ") and got["late"]["reason"].endswith("needs at least "
                                                                                               "10000 s")
    with pytest.raises(ProcessLookupError):
        os.kill(got["hangs"]["results"]["pid"], 0)  # the runner ended the hung section's process
    report = (out / "report.md").read_text()
    assert "| works | ok |" in report and "| value |\n|---|\n| 42 |" in report and "![Works](works.png)" in report
    assert "| raises | FAILED |" in report and "ValueError: boom" in report and "second line" not in report
    assert "Run them next: `python -m benchmarks.gpu_report --out DIR --sections late`" in report
    assert (out / "works.png").read_bytes()[:8] == PNG
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "works.png"]
    printed = capsys.readouterr().out
    assert "gpu_report: works: ok" in printed and "gpu_report: raises: FAILED: ValueError: boom" in printed
    assert "next: python -m benchmarks.gpu_report --out DIR --sections late" in printed


def test_a_runner_killed_mid_way_leaves_the_report_of_every_section_before(tmp_path):
    out, pid_file = tmp_path / "report", tmp_path / "hung.pid"
    # The plan holds the hung section for 600 s: it is still running whenever its first figure reaches the report,
    # however slowly its process starts (under its own 8 s limit, a slow start left it a window of ~1 s)
    runner = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_report", "--out", str(out), "--plan", "hold",
                               *FAKES], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "FAKE_PID_FILE": str(pid_file),
                                   "TMPDIR": str(tmp_path)})  # the runner's scratch, which a SIGKILL leaves
    try:
        deadline = time.monotonic() + 180  # until what the hanging section recorded is in the report
        while time.monotonic() < deadline:
            if pid_file.exists() and entries(out)["hangs"].get("results", {}).get("first") or runner.poll() is not None:
                break
            time.sleep(0.1)
        assert pid_file.exists(), "the hanging section never started"
        runner.send_signal(signal.SIGKILL)  # the device's time limit, say: no chance to write anything more
        runner.wait(timeout=30)
        got = entries(out)
        assert got["works"]["status"] == "ok" and got["works"]["results"]["value"] == 42
        assert got["hangs"]["status"] == "running"  # killed mid-section: its figures so far are in the report
        assert got["hangs"]["results"]["first"] == "measured"
        assert "| hangs | running |" in (out / "report.md").read_text()
    finally:
        runner.kill()
        if pid_file.exists():  # the section's process, which the kill left behind in its own process group
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_unknown_section_is_a_one_line_error(tmp_path, capsys):
    assert gpu_report.main(["--out", str(tmp_path), "--sections", "works,nope", *FAKES]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("gpu_report: error: unknown section 'nope' (valid: works, raises, hangs, crashes, needs_gpu, "
                   "needs_lib, late)")
    assert not (tmp_path / "report.json").exists()


def test_the_sections_come_in_order_of_value():
    assert [s.name for s in SECTIONS] == ["environment", "gpu_tests", "vs_trainer", "mfu", "mfu_compiled",
                                          "compile_modes", "packing", "ablation", "batch_finder", "tracking", "audit",
                                          "hpo"]
    assert all({"cuda"} & set(s.needs) for s in SECTIONS if s.name in ("gpu_tests", "mfu", "compile_modes",
                                                                        "mfu_compiled", "batch_finder"))


def test_the_calls_fit_the_15_minutes_a_gpu_machine_is_lent():
    """call1 within 8 minutes and call2 within 5, the carried wheels' install and the report's reserve included;
    call3 within what the two left on 2026-11-27; each fixed limit within its call's budget, the last section taking
    what is left."""
    plans = {p.name: p for p in PLANS}
    assert set(plans) == {"call1", "call2", "call3"}
    install_s = 20  # pip installing the carried wheels: ~10 s on the H200
    assert plans["call1"].budget_s + install_s <= 8 * 60 and plans["call2"].budget_s + install_s <= 5 * 60
    assert 30 + plans["call1"].budget_s + plans["call2"].budget_s + 2 * install_s <= 15 * 60 - 60  # start, margin
    order = [s.name for s in SECTIONS]
    for plan in plans.values():
        assert plan.sections == sorted(plan.sections, key=order.index)  # registry order: how they run
        fixed = [v for v in plan.limits.values() if v is not None]
        assert sum(fixed) + gpu_report.RESERVE_S < plan.budget_s and list(plan.limits.values())[-1] is None
    # the headline, with the time for the compiled Trainer since run 7 (P8: a loan of its own)
    assert plans["call1"].sections == ["environment", "vs_trainer"]
    # hpo, the batch finder and tracking: loans of their own
    assert plans["call2"].sections == ["gpu_tests", "mfu"]
    # call3 takes what the loan had left after calls 1 and 2 (the machine warm): held 614.6 s of 900 on 2026-11-27's
    # third loan (570.1 s on its second; 698.3 s on its first, whose calls have since been cut to fit), when call 1
    # still ran P8 (80 s then) and its vs_trainer had no CUDA graphs to compile (~40 s more since)
    # (run 7, 2026-11-28: held 604.5 s after call 2, 295 s left). CUDA graphs at batch 64 measured 2.14x and 1.79x
    # default mode (runs 6, 7), and vs_trainer runs them: call 3 is the compiled MFU's, both its cases
    assert plans["call3"].sections == ["mfu_compiled"]
    # Held after call 2 in run 7: 604.5 s. Since then call 1 adds the compiled Trainer (~120 s, its guess), mfu moved
    # from call 1 to call 2 (no change in all), the batch finder and tracking left (51 + 47 s in run 7), and gpu_tests
    # may take 20 s more: ~646 s
    held = 604.5 + 120 - (51 + 47) + 20
    assert plans["call3"].budget_s + install_s <= 15 * 60 - held - 10
    assert plans["call3"].budget_s - gpu_report.RESERVE_S >= 90 + 90  # both compiled MFU cases, as estimated


def test_each_planned_section_has_the_seconds_the_h200_measured():
    """Each fixed limit holds what its section took on the H200 (2026-11-26) or is expected to take now, with room;
    the expected sections fit their call; the last one gets at least its minimum even when every fixed one runs to
    its limit. (Call 2 of 2026-11-26 cut batch_finder at 50 s and tracking at 40 s, each before its summary.)"""
    by_name = {s.name: s for s in SECTIONS}
    for plan in PLANS:
        *fixed, last = plan.sections
        for name in fixed:
            assert plan.limits[name] >= EXPECTED_S[name] + 5, name
        assert sum(EXPECTED_S[n] for n in plan.sections) + gpu_report.RESERVE_S <= plan.budget_s, plan.name
        worst = plan.budget_s - gpu_report.RESERVE_S - sum(plan.limits[n] for n in fixed)
        assert worst >= by_name[last].min_s["full"], plan.name


def test_a_plan_picks_its_sections_budget_and_limits(tmp_path):
    out = tmp_path / "report"
    assert gpu_report.main(["--out", str(out), "--plan", "quick", *FAKES]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["plan"] == "quick" and report["meta"]["budget_s"] == 60
    got = {e["name"]: e for e in report["sections"]}
    assert list(got) == ["works", "hangs", "needs_gpu"]  # the plan's sections, in registry order
    assert got["hangs"]["reason"].startswith("killed at its limit of 2 s")  # the plan's limit, not its own 8 s
    assert int(report["meta"]["compile_threads"]) >= 1


def test_an_unknown_plan_is_a_one_line_error(tmp_path, capsys):
    assert gpu_report.main(["--out", str(tmp_path), "--plan", "call9", *FAKES]) == 2
    assert capsys.readouterr().err.strip() == "gpu_report: error: unknown plan 'call9' (valid: quick, hold)"


def git_in(folder):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=folder, check=True,
                       capture_output=True)
    return git


def test_the_commit_is_read_from_the_tree_itself_even_in_a_copy_inside_another_repository(tmp_path):
    """The device machine runs a copy with no .git of its own inside another repository: git would name that one."""
    git = git_in(tmp_path)
    git("init", "-q")
    (tmp_path / "f").write_text("x")
    git("add", "f")
    git("commit", "-q", "-m", "enclosing")
    copy = tmp_path / "copy"
    (copy / ".gpu-wheels").mkdir(parents=True)
    assert gpu_report.commit(copy) == {"commit": None, "source": "the tree has no .git of its own and no "
                                                                  ".gpu-wheels/COMMIT (make gpu-commit writes it)",
                                       "git": None}
    (copy / ".gpu-wheels" / "COMMIT").write_text("abc1234-dirty\n")
    assert gpu_report.commit(copy) == {"commit": "abc1234-dirty", "source": ".gpu-wheels/COMMIT", "git": None}
    ours = gpu_report.commit(tmp_path)  # a tree that is its own repository, with no COMMIT file: git answers
    head = gpu_report._git(tmp_path, "rev-parse", "--short", "HEAD")
    assert ours == {"commit": head, "source": "git", "git": head}


def test_the_commit_file_wins_over_a_git_of_an_older_commit_that_sees_the_tree_as_changes(tmp_path):
    """2026-11-26: the device's copy carried a .git of the last landed commit (ac83f3c) with the tree (c5cb8fe) as
    uncommitted changes: git said "ac83f3c-dirty", the COMMIT file that `make gpu-wheels` wrote said c5cb8fe. The
    report names the file's commit and keeps git's view beside it, in report.json and report.md."""
    git = git_in(tmp_path)
    git("init", "-q")
    (tmp_path / "f").write_text("landed")
    git("add", "f")
    git("commit", "-q", "-m", "the last landed commit")
    landed = gpu_report._git(tmp_path, "rev-parse", "--short", "HEAD")
    (tmp_path / "f").write_text("the tree that travelled")
    (tmp_path / ".gpu-wheels").mkdir()
    (tmp_path / ".gpu-wheels" / "COMMIT").write_text("c5cb8fe\n")
    found = gpu_report.commit(tmp_path)
    assert found == {"commit": "c5cb8fe", "source": ".gpu-wheels/COMMIT", "git": f"{landed}-dirty"}
    meta = {"commit": found["commit"], "commit_source": found["source"], "commit_git": found["git"]}
    assert f"commit c5cb8fe (.gpu-wheels/COMMIT), git says {landed}-dirty" in report.markdown(meta, [], {}, [])


def test_on_a_gpu_inductors_caches_live_in_the_tree_the_device_keeps_between_calls(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert gpu_report.compile_cache(cuda=False) is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert gpu_report.compile_cache(cuda=True) == f"{ROOT / '.inductor-cache'} (" + (
        "warm)" if (ROOT / ".inductor-cache").is_dir() and any((ROOT / ".inductor-cache").iterdir()) else "cold)")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ROOT / ".inductor-cache")
    assert "/.inductor-cache/" in (ROOT / ".gitignore").read_text().splitlines()  # kept out of commits, kept there
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # one already set wins
    assert gpu_report.compile_cache(cuda=True) == f"{tmp_path / 'cache'} (cold)"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "fxgraph").mkdir()
    assert gpu_report.compile_cache(cuda=True) == f"{tmp_path / 'cache'} (warm)"


def test_pytest_outcomes_per_test_from_its_junit_xml(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\ndef test_passes():\n    assert True\n\n"
        "@pytest.mark.gpu\ndef test_fails():\n    assert 1 == 2, 'one is not two'\n\n"
        "@pytest.mark.gpu\ndef test_skips():\n    pytest.skip('no device')\n\n"
        "def test_not_gpu():\n    assert True\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    result = gpu_tests.run_pytest([tmp_path / "tests" / "test_sample.py"], tmp_path / "junit.xml", timeout=120,
                                  cwd=tmp_path)
    rows = {r["id"].split("::")[1]: r for r in result["tests"]}
    assert set(rows) == {"test_passes", "test_fails", "test_skips"}  # -m gpu deselected the other
    assert rows["test_passes"]["outcome"] == "passed" and rows["test_skips"]["outcome"] == "skipped"
    assert rows["test_fails"]["outcome"] == "failed" and "one is not two" in rows["test_fails"]["message"]
    assert result["summary"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1, "exit_code": 1,
                                 "timed_out": False, "files": ["tests/test_sample.py"]}
    verbose = gpu_tests.parse_verbose("tests/test_a.py::test_x PASSED  [ 50%]\ntests/test_a.py::test_y FAILED\nnoise\n"
                                      "[gw1] [ 75%] SKIPPED tests/test_a.py::test_z[sdpa] \n")  # the last: xdist's
    assert [(r["id"], r["outcome"]) for r in verbose] == [("tests/test_a.py::test_x", "passed"),
                                                         ("tests/test_a.py::test_y", "failed"),
                                                         ("tests/test_a.py::test_z[sdpa]", "skipped")]
    # cut short: xdist had named test_w[True] when it handed it out, and no outcome came (H200 runs 6 and 7)
    cut = ("tests/test_a.py::test_z[sdpa] \ntests/test_a.py::test_w[True] \n"
           "[gw1] [ 75%] SKIPPED tests/test_a.py::test_z[sdpa] \n")
    assert gpu_tests.unfinished(cut, gpu_tests.parse_verbose(cut)) == ["tests/test_a.py::test_w[True]"]
    summary = {"passed": 1, "skipped": 1, "timed_out": True, "unfinished": ["tests/test_a.py::test_w[True]"]}
    assert gpu_tests.markdown({"summary": summary}).splitlines()[0].endswith(
        "cut at the time limit); files: ; still running when cut: `tests/test_a.py::test_w[True]`")


def test_the_gpu_test_files_are_the_ones_with_gpu_marks():
    files = {p.name for p in gpu_tests.gpu_test_files()}
    assert {"test_gpu.py", "test_batch_finder.py"} <= files and "test_platform.py" not in files


@pytest.mark.parametrize("name, kind", [
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "matmul"), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "matmul"),
    ("triton_tem_fused_addmm_0", "matmul"), ("aten::addmm", "matmul"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"), ("aten::_scaled_dot_product_attention", "attention"),
    ("triton_per_fused_add_native_layer_norm_3", "other"), ("void at::native::vectorized_elementwise_kernel", "other"),
    ("multi_tensor_apply_kernel<FusedAdamMathFunctor>", "other"),
])
def test_profile_kernels_are_told_apart_by_name(name, kind):
    assert mfu.kind(name) == kind


def tiny_setup(folder, *overrides):
    """A built (untrained) set-up of the tiny model on 32 demo rows, batch 8: 4 steps an epoch."""
    from maxout import hardware, loading
    from maxout.train import prepare
    from maxout.train.setup import build

    cfg = loading.load(["hardware=cpu", *workloads.model("tiny"), *workloads.demo(folder, rows=32),
                        "tracking=none", "train.batch_size=8", *overrides])
    checked = prepare.check(cfg)
    return build(cfg, hardware.detect(), checked.dataset, checked.tokenizer)


def test_the_compile_off_mfu_measures_prepared_masks_and_packing_in_the_same_call(tmp_path):
    from benchmarks.gpu.registry import Context
    from maxout import loading

    ctx = Context("mfu", "full", tmp_path, {}, time.time() + 60, tmp_path / "r.json")
    prepared, mask_read, bins, packed = mfu.cases(ctx, compiled=False)
    # the profile's prepared masks, then the same overrides with transformers reading each mask on the host
    assert mask_read["data"]() == [*prepared["data"](), "hardware.prepared_mask=false"]
    assert prepared["name"] == mfu.LOW_PRECISION_LN and mask_read["name"] == mfu.MASK_READ
    assert {"hardware.compile=false", "hardware.low_precision_layernorm=true"} <= set(prepared["data"]())
    tiny = workloads.model("tiny")
    assert loading.load([*tiny, *prepared["data"]()]).hardware.prepared_mask is True
    # then the same padding-free, at the same tokens a step: a config that loads, packed
    assert packed["data"]()[:len(prepared["data"]())] == prepared["data"]() and packed["name"] == mfu.PACKED
    cfg = loading.load([*tiny, *packed["data"]()])
    assert (cfg.data.padding, cfg.data.max_tokens_per_batch, cfg.hardware.compile) == ("packed", "auto", False)
    # and the same tokens in bins of data.max_length (bin_packing.py), before varlen: the same overrides but one
    assert bins["data"]() == [*packed["data"](), "data.packing_attention=bins"] and bins["name"] == mfu.BINS
    assert loading.load([*tiny, *bins["data"]()]).data.packing_attention == "bins"
    case = {"micro_batch": 1024, "accumulation": 1, "steady_tokens_per_s": 440_000.0, "flops_per_token": 6.6e8,
            "mfu_datasheet": 0.23, "mfu_measured_peak": None, "padding_efficiency": 0.85, "compile_s": None,
            "peak_memory_gb": 50.0}
    table = mfu.markdown({"cases": {prepared["name"]: {**case, "steady_tokens_per_s": 484_000.0},
                                    mask_read["name"]: case,
                                    bins["name"]: {**case, "steady_tokens_per_s": 605_000.0},
                                    packed["name"]: {**case, "steady_tokens_per_s": 532_400.0}}})
    assert ("Prepared masks ÷ transformers' mask read on the host (compile off, the same run): **1.10×** tokens/s."
            in table)
    assert "Packed ÷ bucketed (compile off, low-precision LayerNorm, the same run): **1.10×** tokens/s." in table
    assert "Bins ÷ bucketed (compile off, low-precision LayerNorm, the same run): **1.25×** tokens/s." in table
    assert "Bins ÷ packed through the varlen kernel (compile off, the same run): **1.14×** tokens/s." in table
    host = {"wall_ms": 175.0, "data_ms": 0.5, "issue_ms": 30.0, "kernel_ms": 144.0, "kernels_per_step": 880,
            "launch_ms": 6.0, "launches_per_step": 880, "host_ops_ms": 60.0, "syncs_per_step": 1.0, "top_host": [],
            "blocking": {}}
    table = mfu.markdown({"cases": {mask_read["name"]: {**case, "host": host}, prepared["name"]: case}})
    assert f"| {mask_read['name']} | 175.00 | 0.50 | 30.00 | 144.00 | 880 | 880 (6.00) | 60.00 | 1.0 | none |" in table
    assert f"| {prepared['name']} |" not in table.partition("on the host")[2]  # a case without a split has no row


def test_the_compiled_mfu_turns_inductors_mix_order_reduction_off_and_measures_packed_layers_against_bucketed(
        tmp_path):
    """Run 7's compiled step spent a quarter of its kernel time in mix-order LayerNorm-backward kernels: call 3's
    compiled cases turn that fusion off through the product's flag (each run sets inductor's switch, and records
    the decision): the whole model bucketed, then its layers compiled alone (a shorter compile) packed at the same
    tokens a step, then bucketed, and the table gives the ratios of each pair measured in the same process."""
    from benchmarks.gpu.registry import Context
    from maxout import loading
    from maxout.optimizations import compile as compile_opt, mix_order_reduction, named
    from maxout.train.setup import plan_decisions
    from transformers import BertForSequenceClassification

    from .conftest import fake_cuda

    ctx = Context("mfu_compiled", "full", tmp_path, {}, time.time() + 60, tmp_path / "r.json")
    bucketed, packed, layers, *_ = mfu.cases(ctx, compiled=True)
    assert [c["name"] for c in (bucketed, packed, layers)] == [mfu.MIX_ORDER_OFF, mfu.MIX_ORDER_OFF_PACKED_LAYERS,
                                                                mfu.MIX_ORDER_OFF_LAYERS]
    assert layers["data"]() == [*bucketed["data"](), "hardware.compile_scope=layers"]
    assert packed["data"]() == [*layers["data"](), "data.padding=packed", "data.max_tokens_per_batch=auto"]
    # compile mode default by name: the Hopper profiles record CUDA graphs, whose recordings would fill 30 steps
    assert bucketed["data"]()[-2:] == ["hardware.compile_mode=default", "hardware.mix_order_reduction=false"]
    cfg = loading.load([*workloads.model("tiny"), *packed["data"]()])
    assert (cfg.data.padding, cfg.hardware.compile_mode) == ("packed", "default")  # compile: the GPU profile's
    h200 = fake_cuda(name="NVIDIA H200", memory_gb=139.8, cc=(9, 0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_opt, "has_triton", lambda: True)  # as the GPU image has it
        for case, scope in ((bucketed, "model"), (packed, "layers"), (layers, "layers")):
            cfg = loading.load(["hardware=h200", *workloads.model("tiny"), *case["data"]()], device=h200)
            decisions = plan_decisions(cfg, h200, BertForSequenceClassification)
            decision = named(decisions, "mix_order_reduction")
            assert (decision.requested, decision.effective) == (False, False)
            assert named(decisions, "compile_scope").effective == scope
    assert mix_order_reduction.enabled() is True  # nothing set in this process: each run sets its own
    # the whole model's compile and the packed layers', each its own graph, in call 3's budget beside the report's
    # reserve (the bucketed layers' case runs where the compiles were as short as expected)
    assert bucketed["needs_s"] + packed["needs_s"] <= PLANS[2].budget_s - gpu_report.RESERVE_S
    case = {"micro_batch": 1024, "accumulation": 1, "steady_tokens_per_s": 500_000.0, "flops_per_token": 5.2e8,
            "mfu_datasheet": 0.26, "mfu_measured_peak": None, "padding_efficiency": 0.85, "compile_s": 55.0,
            "compile_graphs": 1, "peak_memory_gb": 45.0}
    faster = {**case, "steady_tokens_per_s": 600_000.0}
    table = mfu.markdown({"cases": {bucketed["name"]: case, packed["name"]: faster,
                                    layers["name"]: {**case, "steady_tokens_per_s": 480_000.0}}})
    assert ("Layers compiled alone ÷ the whole model compiled (bucketed, mix-order reduction off, the same run): "
            "**0.96×** tokens/s." in table)
    assert ("Packed ÷ bucketed (layers compiled alone, mix-order reduction off, the same run): **1.25×** tokens/s."
            in table)


def test_a_profile_of_cpu_training_steps_adds_up_and_counts_the_model_flops_its_matmuls_did(tmp_path):
    from maxout import metrics

    # rows cut to 8 tokens: every demo row is longer, so each micro-batch is [batch, 8] and a step's tokens are known
    setup = tiny_setup(tmp_path, "data.max_length=8")
    profile = mfu.profile_steps(setup, steps=2)
    assert profile["steps"] == 2 and profile["device_ms"] > 0
    assert sum(profile["shares"].values()) == pytest.approx(1.0) and profile["shares"]["matmul"] > 0
    assert profile["top"] and all(t["kind"] in ("matmul", "attention", "other") for t in profile["top"])
    assert sum(profile["per_step_ms"].values()) == pytest.approx(profile["device_ms"] / 2)
    # the profiler's matmul FLOPs a step are the model's training FLOPs (metrics.count_flops: forward, both
    # gradients, the tiny model's eager attention) at the step's tokens: what the MFU figure counts, padding aside
    count = metrics.count_flops(setup.model, setup.model_config, 8.0)
    tokens = setup.micro_batch * setup.accum_steps * 8
    assert profile["matmul_flops_per_step"] == pytest.approx(count.total * tokens, rel=1e-3)
    assert profile["matmul_tflops"] == pytest.approx(
        profile["matmul_flops_per_step"] / (profile["per_step_ms"]["matmul"] / 1e3) / 1e12)


def test_attention_kernels_are_timed_alone_on_the_same_rows_and_a_kernel_that_cannot_run_says_why():
    from benchmarks.gpu import attention_kernels

    got = attention_kernels.measure("cpu", rows=8, width=8, layers=2, reps=1)
    sizes = attention_kernels.lengths(8, 8)
    assert all(6 <= n <= 8 for n in sizes) and got["real_tokens"] == sum(sizes) and got["padded_tokens"] == 64
    # metrics.count_flops' convention: 4 x width x length^2 a row forward, three times that with the backward
    assert got["flops_per_layer"] == 3 * 4 * 12 * 64 * sum(n * n for n in sizes)
    assert list(got["cases"]) == [name for name, *_ in attention_kernels.CASES]
    math = got["cases"]["math, padding mask, dropout 0.1"]
    assert math["ms_per_step"] == pytest.approx(2 * math["ms_per_layer"]) and math["tflops"] == pytest.approx(
        got["flops_per_layer"] / (math["ms_per_layer"] / 1e3) / 1e12)
    # the same rows in bins of 128 (bin_packing's first-fit; all 8 rows fit one), through math with its bins' mask
    assert (got["bins"], got["bin_width"]) == (1, 128)
    assert got["cases"]["math, the rows in bins of 128, block-diagonal mask, dropout 0.1"]["ms_per_step"] > 0
    # a CPU has neither torch's varlen flash kernel nor cuDNN's: each is a finding with torch's reason
    for refused in ("varlen flash, packed, no dropout", "cuDNN, padding mask, dropout 0.1",
                    "cuDNN, the rows in bins of 128, block-diagonal mask, dropout 0.1"):
        assert set(got["cases"][refused]) == {"error"} and got["cases"][refused]["error"]
    assert "Triggered internally" not in got["cases"]["flash, rows without padding, dropout 0.1"]["error"]

    shown = {"rows": 1024, "width": 72, "heads": 12, "head_dim": 64, "layers": 12, "real_tokens": 64512,
             "padded_tokens": 73728, "cases": {
                 "cuDNN, padding mask, dropout 0.1": {"ms_per_step": 16.4, "tflops": 27.0},
                 "varlen flash, packed, no dropout": {"ms_per_step": 9.9, "tflops": 45.0},
                 "math, padding mask, dropout 0.1": {"error": "out of memory"}}}
    table = mfu.markdown({"cases": {}, "attention_kernels": shown})
    assert "(1024 rows of <= 72 tokens (88% real), 12 heads of 64, 12 layers;" in table
    assert table.index("| varlen flash, packed, no dropout | 9.9 | 45 |") < table.index("| cuDNN, padding mask")
    assert "| math, padding mask, dropout 0.1 | – | – (out of memory) |" in table
    assert ("Fastest: varlen flash, packed, no dropout, 6.5 ms a step less than cuDNN, padding mask, dropout 0.1 "
            "(what bucketed training runs).") in table


def test_the_step_budget_says_what_p3_leaves_of_the_step_and_where_the_kernels_go():
    # run 7's eager bf16-LayerNorm case (2026-11-28), its figures as analysed by hand then
    case = {"step_ms": 128.0, "mfu_datasheet": 0.262, "measured_peak_tflops": 790.0,
            "profile": {"per_step_ms": {"matmul": 54.0, "attention": 16.0, "other": 46.0}, "matmul_tflops": 711.0}}
    assert step_budget.step_budget("eager", case) == (
        "Step budget of eager: 128.0 ms a step, 116.0 ms of kernels (matmul 54.0 ms at 711 TFLOP/s (90% of the "
        "measured matmul peak), attention 16.0 ms, other 46.0 ms), 12.0 ms without one. P3's 35% of the data sheet "
        "needs 95.8 ms a step at these tokens a step: 32.2 ms less.")
    # no matmul FLOPs counted (CUDA graphs), no peak measured, P3 met
    met = {"step_ms": 80.0, "mfu_datasheet": 0.40,
           "profile": {"per_step_ms": {"matmul": 50.0, "attention": 10.0, "other": 25.0}, "matmul_tflops": None}}
    assert step_budget.step_budget("graphs", met) == (
        "Step budget of graphs: 80.0 ms a step, 85.0 ms of kernels (matmul 50.0 ms, attention 10.0 ms, other "
        "25.0 ms), no time without one. P3's 35% of the data sheet needs 91.4 ms a step at these tokens a step: met.")
    # a report from before the budget (run 7's): its figures from the profile's shares and the run's samples/s
    old = {"micro_batch": 1024, "accumulation": 1, "steady_samples_per_s": 8000.0, "mfu_datasheet": 0.262,
           "profile": {"steps": 3, "device_ms": 348.0, "shares": {"matmul": 0.5, "attention": 0.125, "other": 0.375}}}
    report_json = {"sections": [{"name": "environment", "results": {}},
                                {"name": "mfu", "results": {"cases": {"old": old, "no profile": {}}}}]}
    assert step_budget.budgets(report_json) == [
        "Step budget of old: 128.0 ms a step, 116.0 ms of kernels (matmul 58.0 ms, attention 14.5 ms, other 43.5 "
        "ms), 12.0 ms without one. P3's 35% of the data sheet needs 95.8 ms a step at these tokens a step: 32.2 ms "
        "less."]
    assert step_budget.step_budget("older", {"profile": {}}) == "Step budget of older: not in this report."


def test_the_host_split_times_the_guards_every_call_between_two_timings_that_skip_them(tmp_path, graphs,
                                                                                          monkeypatch):
    """vs_trainer's maxout runs time the same compiled steps with dynamo's guards at every call, between two timings
    of the forward that skips them (hardware.skip_guards): A B A, the forward put back after."""
    from maxout.optimizations import skip_guards

    setup = tiny_setup(tmp_path, "hardware.compile=true")
    skipping = setup.forward
    assert isinstance(skipping, skip_guards.GuardSkippingForward)
    calls, real = [], host_time._timed
    monkeypatch.setattr(host_time, "_timed", lambda s, groups, steps, meter: calls.append(
        s.forward is skipping) or real(s, groups, steps, meter))
    got = host_time.split(setup, steps=3, profiled=0, guards_every_call=True)
    assert calls == [True, False, True] and setup.forward is skipping
    assert skipping.skipped > 0 and graphs.frame_count == 1  # the skipping timings skipped; one graph for all
    for timed in (got, got["guards_every_call"], got["guards_every_call"]["skipping_again"]):
        assert 0 < timed["issue_ms"] and timed["data_ms"] + timed["issue_ms"] <= timed["wall_ms"]
    table = "\n".join(host_time.markdown({"maxout": got}))
    assert "| maxout, dynamo's guards at every call (hardware.skip_guards=false) |" in table
    assert "| maxout, guards skipped again for inputs already seen |" in table
    assert "guards_every_call" not in host_time.split(setup, steps=1, profiled=0)  # asked for only


def test_the_host_split_partitions_each_step_and_runs_on_across_epochs(tmp_path, monkeypatch):
    setup = tiny_setup(tmp_path, "hardware.num_workers=1", "hardware.persistent_workers=false")
    before = [p.detach().clone() for p in setup.model.parameters()]
    windows, real = [], host_time._timed
    monkeypatch.setattr(host_time, "_timed", lambda s, groups, steps, meter: windows.append(steps) or real(
        s, groups, steps, meter))
    got = host_time.split(setup, steps=6, profiled=2)  # 6 + 3 + 6 + 2 steps: past the 4-step epoch, four times
    # the other loader's workers start on its first batch: those steps are run untimed first
    assert windows == [6, host_time.WARM_STEPS, 6]
    assert any(not torch.equal(a, b) for a, b in zip(before, setup.model.parameters()))  # real steps were taken
    assert got["steps"] == 6 and got["profiled_steps"] == 2 and got["profile_attempts"] == 1  # a CPU: no retry
    for timed in (got, got["other_loader"]):  # the worker's batches, then the same collated in-process
        assert 0 < timed["data_ms"] and 0 < timed["issue_ms"]
        assert timed["data_ms"] + timed["issue_ms"] <= timed["wall_ms"]
    assert got["num_workers"] == 1 and setup.train_loader.num_workers == 1  # the run's own loader is left as it was
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]  # no worker left behind mid-epoch
    # a CPU: no kernels, no launches, no sync count (tests/test_host_syncs.py counts a CPU's would-be syncs)
    assert (got["kernel_ms"], got["kernels_per_step"], got["syncs_per_step"]) == (None, None, None)
    assert got["launches_per_step"] == 0 and got["launch_sources"] == []
    ops = [o["op"] for o in got["top_host"]]
    assert len(ops) == 10 and any(op.startswith("aten::") for op in ops)
    assert all(a["ms_per_step"] >= b["ms_per_step"] > 0 for a, b in zip(got["top_host"], got["top_host"][1:]))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # auto's 0 workers: nothing to compare with no workers
    quick = host_time.split(tiny_setup(tmp_path), steps=2, profiled=0)  # timed only
    assert quick["steps"] == 2 and (quick["profiled_steps"], quick["launch_ms"], quick["top_host"]) == (0, None, [])
    assert (quick["num_workers"], quick["other_workers"], quick["other_loader"]) == (0, None, None)
    table = host_time.markdown({"maxout": got, "eager": quick})
    assert table[2] == (f"| maxout | {got['wall_ms']:.2f} | {got['data_ms']:.2f} | {got['issue_ms']:.2f} | "
                        f"– | – | 0 (0.00) | {got['host_ops_ms']:.2f} | – | none |")  # a CPU blocks on no CUDA call
    assert sum(o["ms_per_step"] for o in got["top_host"]) <= got["host_ops_ms"]
    m = got["other_loader"]
    assert table[3] == (f"| maxout, batches collated in the training process (num_workers=0, not 1) | "
                        f"{m['wall_ms']:.2f} | {m['data_ms']:.2f} | {m['issue_ms']:.2f} | – | – | – | – | – | – |")
    assert table[4].startswith("| eager |") and table[4].endswith("| – | – | – | – | – | – |")  # timed only
    assert ops[0][:60] in table[-1] and "eager," not in "".join(table)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)  # in-process loading compared with auto's 1 worker
    workers = host_time.split(tiny_setup(tmp_path), steps=2, profiled=0)
    assert (workers["num_workers"], workers["other_workers"]) == (0, 1) and workers["other_loader"]["data_ms"] > 0
    assert "| maxout, batches from 1 worker process (num_workers=1, not 0) |" in \
        "\n".join(host_time.markdown({"maxout": workers}))
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_the_host_split_names_the_cuda_calls_that_block_the_host():
    """Torch's sync debug mode counted no sync in the H200's compiled batch-64 step, yet at micro-batch 1024 the
    compiled step idled the GPU ~30 ms a step: the profiler's blocking runtime calls cover the implicit syncs too."""
    blocking = ["cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree",
                "cudaMalloc", "cudaHostAlloc", "cudaFreeHost", "cuMemFree_v2"]
    queued = ["cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernelEx", "cudaMemsetAsync", "cudaEventRecord",
              "cudaStreamWaitEvent", "aten::copy_"]
    assert [n for n in blocking + queued if host_time.BLOCKING.match(n)] == blocking
    row = {"wall_ms": 175.0, "data_ms": 0.5, "issue_ms": 174.0, "kernel_ms": 144.0, "kernels_per_step": 880,
           "launch_ms": 6.0, "launches_per_step": 880, "host_ops_ms": 60.0, "syncs_per_step": 0.0, "top_host": [],
           "blocking": {"cudaStreamSynchronize": {"calls_per_step": 1.0, "ms_per_step": 120.5}}}
    assert host_time.markdown({"compiled": row})[2].endswith("| 0.0 | cudaStreamSynchronize 1.0 (120.50) |")
    # launches by the outermost op above each (a CPU profile has none: the H200's batch-64 step made 272, run 7)
    step = types.SimpleNamespace(name="Optimizer.step#AdamW.step", cpu_parent=None)
    fused = types.SimpleNamespace(name="aten::_fused_adamw_", cpu_parent=step)
    node = types.SimpleNamespace(name="autograd::engine::evaluate_function: AddmmBackward0", cpu_parent=None)
    events = [types.SimpleNamespace(name="cudaLaunchKernel", cpu_parent=fused) for _ in range(6)] + [
        types.SimpleNamespace(name="cudaLaunchKernel", cpu_parent=node), fused, node,
        types.SimpleNamespace(name="cudaEventRecord", cpu_parent=step)]
    assert host_time.launch_sources(events, steps=2) == [{"op": "Optimizer.step#AdamW.step", "per_step": 3.0},
                                                         {"op": node.name, "per_step": 0.5}]
    sourced = {**row, "top_host": [{"op": "aten::mm", "ms_per_step": 1.0}],
               "launch_sources": host_time.launch_sources(events, steps=2)}
    assert host_time.markdown({"c": sourced})[-1] == (
        "\nc, launch calls per step by the outermost op that made them: `Optimizer.step#AdamW.step` 3, "
        "`autograd::engine::evaluate_function: AddmmBackward0` 0.5.")
    # on the H200 the first host profile after the mfu section's kernel profile caught no kernel (runs 6, 7): the
    # split profiles again, and its table says so
    retried = {**row, "top_host": [{"op": "cudaGraphLaunch", "ms_per_step": 1.5}]}
    assert "(a second profile: the first caught no kernel)" not in host_time.markdown({"c": retried})[-1]
    assert "(a second profile: the first caught no kernel): `cudaGraphLaunch` 1.50." in host_time.markdown(
        {"c": {**retried, "profile_attempts": 2}})[-1]


def _trial(number, state, start, end, worker):
    from datetime import datetime

    from optuna.trial import FrozenTrial, TrialState

    return FrozenTrial(number, TrialState[state], 0.5 if state == "COMPLETE" else None,
                       datetime.fromtimestamp(start), None if end is None else datetime.fromtimestamp(end), {}, {},
                       {"worker": worker}, {}, {}, number)


def test_hpo_throughput_counts_trials_finished_before_the_stop_and_sums_the_workers_steady_rates():
    t0 = 1_800_000_000.0
    trials = [_trial(0, "COMPLETE", t0, t0 + 10, "h:1"), _trial(1, "PRUNED", t0 + 10, t0 + 20, "h:1"),
              _trial(2, "COMPLETE", t0 + 2, t0 + 12, "h:2"), _trial(3, "FAIL", t0 + 12, t0 + 14, "h:2"),
              _trial(4, "COMPLETE", t0 + 20, t0 + 31, "h:1"), _trial(5, "RUNNING", t0 + 14, None, "h:2")]
    done = hpo.finished(trials, before=t0 + 30)  # trial 4 ended after the SIGINT: it does not count
    assert [t.number for t in done] == [0, 1, 2]
    assert hpo.steady_per_hour(done) == pytest.approx(3600 * (2 / 20 + 1 / 10))  # per worker, then summed
    assert hpo.steady_per_hour([]) is None


def test_hpo_rows_pool_each_worker_counts_studies_against_one_worker():
    def study(n, trials, wall, steady):
        return {"workers": n, "trials": trials, "wall_s": wall, "steady_trials_per_hour": steady, "s_per_trial": 5.0,
                "device": {}, "left_behind": [], "trials_left_running": [], "tracked": {"trial_peak_allocated_gb": None,
                                                             "trial_utilization_mean": None, "running": []}}

    rows = hpo.summarize([study(1, 10, 100, 400.0), study(2, 30, 100, 1200.0), study(2, 10, 100, 800.0),
                          study(1, 5, 50, 400.0)])
    assert [r["workers"] for r in rows] == [1, 2] and [r["studies"] for r in rows] == [2, 2]
    assert [r["trials_per_hour"] for r in rows] == pytest.approx([15 * 3600 / 150, 40 * 3600 / 200])
    assert rows[1]["speed_up"] == pytest.approx(720 / 360) and rows[0]["speed_up"] == 1
    assert rows[1]["steady_speed_up"] == pytest.approx(1000 / 400)
    assert "| 2 | 40 | 200 | 720 | 2.00× | 1000 | 2.50× |" in hpo.markdown({"rows": rows})


def test_vs_trainer_runs_the_headline_first_and_both_orders_then_the_compiled_trainer():
    runs = vs_trainer.schedule(["demo", "long"], compiled=True)
    assert runs[:6] == [("demo", "maxout", "maxout first"), ("demo", "trainer_best", "maxout first"),
                        ("demo", "maxout_eager", "maxout first"), ("long", "maxout", "maxout first"),
                        ("long", "trainer_best", "maxout first"), ("long", "maxout_eager", "maxout first")]
    assert runs[6:10] == [("demo", "trainer_best", "maxout last"), ("demo", "maxout", "maxout last"),
                          ("long", "trainer_best", "maxout last"), ("long", "maxout", "maxout last")]
    assert [c for _, c, _ in runs[10:]] == ["trainer_best_compiled"] * 2
    assert vs_trainer.left_out_note("demo: trainer_best_compiled (last)", 39.4, 120.0, seen=False) == (
        "demo: trainer_best_compiled (last): 39 s left, it needs ~120 s (a guess: none of its runs has been seen)")
    assert vs_trainer.left_out_note("long: maxout (maxout last)", 5.0, 7.2, seen=True) == (
        "long: maxout (maxout last): 5 s left, its last run took 7 s")
    plan = [r for r in runs if r[1] != "maxout_eager"]
    done = [{"mix": m, "contender": c, "order": o, "samples_per_s": v} for (m, c, o), v in
            zip(plan[:6], [100.0, 50.0, 30.0, 20.0, 40.0, 120.0])]  # cut after the demo mix's second order
    done.append({"mix": "demo", "contender": "maxout_eager", "order": "maxout first", "samples_per_s": 90.0})
    got = vs_trainer.summarize(done)
    assert got["demo"]["ratio_vs_trainer_best"] == pytest.approx(110 / 45)
    assert [o["best"] for o in got["demo"]["ratios_per_order"]] == pytest.approx([2.0, 3.0])
    assert got["demo"]["ratio_vs_maxout_eager"] == pytest.approx(110 / 90)  # compile's gain
    assert got["demo"]["eager_ratio_vs_trainer_best"] == pytest.approx(90 / 45)
    assert got["long"]["ratio_vs_trainer_best"] == pytest.approx(1.5) and len(got["long"]["ratios_per_order"]) == 1
    assert "eager_ratio_vs_trainer_best" not in got["long"]
    table = vs_trainer.markdown({"runs": [{**r, "tokens_per_s": None, "peak_memory_gb": None, "compile_s": None,
                                           "seconds": 1.0, "batch": 64} for r in done], "mixes": got})
    assert "| demo | **2.44×** | maxout first 2.00×, maxout last 3.00× | – | 1.22 | 2.00 |" in table
    assert "| long | **1.50×** | maxout first 1.50× | – | – | – |" in table


def test_the_ablation_measures_cuda_graphs_against_default_mode_on_the_same_bucketed_widths(tmp_path, monkeypatch):
    """The H200 run of 2026-11-26 turned the Hopper profiles back to compile mode default: the ablation's first grid
    measures reduce-overhead against it, both cells compiled over the same 8 widths of bucketed dynamic padding on an
    H200, so the mode is all that differs, with the base's compile=off and warm-up replaced, not doubled."""
    from transformers import BertForSequenceClassification

    from benchmarks.gpu.registry import Context
    from benchmarks.gpu.sections import ablation
    from maxout import loading
    from maxout.insight import grid as grid_mod
    from maxout.optimizations import compile as compile_opt, named
    from maxout.train.setup import plan_decisions

    from .conftest import fake_cuda

    monkeypatch.setattr(workloads, "long_mix", lambda folder, rows: [])  # another grid's rows: not this test's
    monkeypatch.setattr(compile_opt, "has_triton", lambda: True)
    ctx = Context("ablation", "full", tmp_path, {}, time.time() + 60, tmp_path / "r.json")
    _, spec, extra, _, steps = ablation.grids(ctx, cuda=True)[0]
    assert spec == "compile_mode=default,reduce-overhead" and steps == 100
    overrides = ablation.merged(ablation.base_overrides(ctx), extra)
    assert [o for o in overrides if o.startswith(("hardware.compile=", "train.warmup_steps_excluded="))] == [
        "hardware.compile=true", "train.warmup_steps_excluded=40"]
    h200 = fake_cuda(name="NVIDIA H200", memory_gb=139.8, cc=(9, 0))
    base = loading.load(overrides, device=h200)
    got = {}
    for cell in grid_mod.cells(grid_mod.parse_grid(spec)):
        decisions = plan_decisions(cell.apply(base), h200, BertForSequenceClassification)
        got[cell.name] = tuple(named(decisions, n).effective for n in ("compile_mode", "pad_widths", "bucketing"))
    assert got == {"compile_mode=default": ("default", 8, True),
                   "compile_mode=reduce-overhead": ("reduce-overhead", 8, True)}


@pytest.mark.parametrize("seconds, ran", [(50, []), (150, ["g, round 1", "g, round 2"])])
def test_a_later_round_is_cheaper_only_after_a_round_of_its_grid_ran(tmp_path, monkeypatch, seconds, ran):
    """On the H200 (run 7) round 1 was left out with 130 s left for its ~130 s, then round 2 ran cold under the
    cached round's third: a round needs the grid's full estimate until one has run."""
    from benchmarks.gpu.registry import Context
    from benchmarks.gpu.sections import ablation
    from maxout.insight import benchmark

    monkeypatch.setattr(ablation, "grids", lambda ctx, cuda: [("g", "compile_mode=default", [], 100, 5)])
    fake = types.SimpleNamespace(table=pd.DataFrame([{"cell": "compile_mode=default"}]), baseline=None)
    monkeypatch.setattr(benchmark, "run", lambda *a, **k: fake)
    ctx = Context("compile_modes", "full", tmp_path, {}, time.time() + seconds, tmp_path / "r.json")
    ablation.run(ctx, first=1, rounds=2)
    grids = ctx.results["grids"]
    assert [k for k, g in grids.items() if "cells" in g] == ran
    assert all("needs ~100 s" in g["left_out"] for g in grids.values() if "left_out" in g)


def test_call3s_compile_modes_runs_that_grid_alone_in_two_rounds_recorded_one_by_one(tmp_path, monkeypatch):
    """The H200's batch-64 step was the host's (27-34 ms of wall for 8.5 ms of kernels, 2026-11-27): call 3 runs the
    ablation's CUDA-graph grid alone, in two rounds, each its own rows (a cut second round keeps the first), within
    the section's limit."""
    from benchmarks.gpu.registry import Context
    from benchmarks.gpu.sections import ablation

    calls = []
    monkeypatch.setattr(ablation, "run", lambda ctx, first=None, rounds=1: calls.append((first, rounds)))
    ctx = Context("compile_modes", "full", tmp_path, {}, time.time() + 60, tmp_path / "r.json")
    ablation.run_compile_modes(ctx)
    assert calls == [(1, 2)] and ablation.SECTION_COMPILE_MODES.needs == ("cuda",)
    assert isinstance(ctx.results["cudagraph_counters"], dict)  # recorded whatever the grid did
    (_, spec, _, needs_s, _), *_ = ablation.grids(ctx, cuda=True)
    assert spec == "compile_mode=default,reduce-overhead"
    # its first round fits the section's own limit, on a loan of its own (--sections compile_modes) since run 7
    assert needs_s <= ablation.SECTION_COMPILE_MODES.max_s["full"] - gpu_report.RESERVE_S
    cell = {"reason": None, "status": "ok", "steady samples/s": 2400.0, "padding efficiency": 0.92,
            "peak memory GiB": 6.3, "memory ratio": 1.0, "MFU": 0.05, "compile s": 50.0}
    table = ablation.markdown({
        "setup": {"model": "bert_base", "steps_per_cell": 60, "rounds": 2, "base_overrides": ["tracking=none"]},
        "grids": {"compile mode, round 1": {"grid": "compile_mode=default,reduce-overhead", "steps": 100,
                                            "baseline": "compile_mode=default", "cells": [
                                                {**cell, "cell": "compile_mode=default", "speed-up": 1.0},
                                                {**cell, "cell": "compile_mode=reduce-overhead", "speed-up": 2.5}]},
                  "compile mode, round 2": {"grid": "compile_mode=default,reduce-overhead",
                                            "left_out": "20 s left in the section, the grid needs ~43 s"}}})
    assert "2 rounds of each grid, its cells in the same order" in table
    assert "| compile mode, round 1, 100 steps | compile_mode=reduce-overhead | 2400.0 | 2.50× | 92% |" in table
    assert "| compile mode, round 1, 100 steps | compile_mode=default | 2400.0 | 1.00× | 92% |" in table
    assert "| compile mode, round 2 | `compile_mode=default,reduce-overhead` | | | | | | | | left out: 20 s" in table
    counted = ablation.markdown({"setup": {}, "cudagraph_counters": {"cudagraph_skips": 2}})
    assert counted.endswith("Inductor's CUDA-graph counters over the section: `cudagraph_skips` 2.")


def test_each_fused_kernel_flag_has_an_ablation_grid_that_turns_only_it_on_for_its_model(tmp_path, monkeypatch):
    """Issue 37: each fused-kernel flag is in the ablation. Liger's grid trains a Qwen3-0.6B-shaped decoder (the
    models Liger has kernels for), low-precision LayerNorm's BERT-base eager and compiled, inductor tuning's a compiled
    BERT-base; on an H200 with liger-kernel installed, each grid's cells differ in that one setting (low-precision
    LayerNorm is decided when the model is built: its requested value here)."""
    from transformers import BertForSequenceClassification, Qwen3ForSequenceClassification

    from benchmarks.gpu.registry import Context
    from benchmarks.gpu.sections import ablation
    from maxout import loading
    from maxout.insight import grid as grid_mod
    from maxout.optimizations import compile as compile_opt, liger_kernel, named
    from maxout.train.setup import plan_decisions

    from .conftest import fake_cuda

    monkeypatch.setattr(workloads, "long_mix", lambda folder, rows: [])  # another grid's rows: not this test's
    monkeypatch.setattr(compile_opt, "has_triton", lambda: True)
    monkeypatch.setattr(liger_kernel, "installed_kernels", lambda: ({"qwen3", "llama"}, ""))
    ctx = Context("ablation", "full", tmp_path, {}, time.time() + 60, tmp_path / "r.json")
    grids = {(spec, "hardware.compile=true" in extra): extra for _, spec, extra, _, _ in ablation.grids(ctx, cuda=True)}
    h200 = fake_cuda(name="NVIDIA H200", memory_gb=139.8, cc=(9, 0))
    for (spec, compiled), flag, model_class, model_type in [
            (("liger_kernel=off,on", False), "liger_kernel", Qwen3ForSequenceClassification, "qwen3"),
            *[(("low_precision_layernorm=off,on", compiled), "low_precision_layernorm", BertForSequenceClassification,
               "bert") for compiled in (False, True)],
            (("prepared_mask=off,on", False), "prepared_mask", BertForSequenceClassification, "bert"),
            (("inductor_tuning=off,on", True), "inductor_tuning", BertForSequenceClassification, "bert")]:
        base = loading.load(ablation.merged(ablation.base_overrides(ctx), grids[spec, compiled]), device=h200)
        assert (base.model.architecture.get("model_type", "bert"), base.model.tokenizer) == (model_type, "bundled")
        got = {}
        for cell in grid_mod.cells(grid_mod.parse_grid(spec)):
            decisions = plan_decisions(cell.apply(base), h200, model_class)
            got[cell.name] = {n: named(decisions, n).effective
                              for n in ("liger_kernel", "inductor_tuning", "compile", "prepared_mask")}
            got[cell.name]["low_precision_layernorm"] = cell.apply(base).hardware.low_precision_layernorm  # at build
        # the other grids keep the h200 profile's bf16 LayerNorm (a grid changes its one flag, the profile the rest)
        off = {"liger_kernel": False, "inductor_tuning": False, "compile": compiled,
               "low_precision_layernorm": flag != "low_precision_layernorm",
               "prepared_mask": flag != "prepared_mask"}  # the profile's
        assert got == {f"{flag}=off": off, f"{flag}=on": {**off, flag: True}}, spec
    qwen = loading.load(ablation.merged(ablation.base_overrides(ctx), grids["liger_kernel=off,on", False]), device=h200)
    assert qwen.model.architecture["hidden_size"] == 1024 and qwen.model.architecture["num_hidden_layers"] == 28


def test_a_cut_batch_finder_section_keeps_its_margin_line_and_a_rung_stops_at_its_first_oom():
    """2026-11-26, call 2: the finder fitted 2701 rows, training ran at 2048 and 2701, and the section was cut at 50 s
    while the 2837-row run went on at half the rows after its out-of-memory recovery, before the margin line. The
    margin is now written after every rung, and a rung ends when recovery fires: that is its answer."""
    import torch

    from benchmarks.gpu.sections import memory
    from maxout.train.oom import OOMRecovery

    finder = {"micro_batch": 2048, "max_batch": 2701, "probes": [], "sequence_length": 128}
    ladder = [{"rows": 2048, "oom": False, "peak_allocated_gb": 101.25, "note": ""},
              {"rows": 2701, "oom": False, "peak_allocated_gb": 133.10, "note": ""}]
    so_far = memory.margin(finder, ladder)
    assert so_far == {"first_oom_over_micro_batch": None, "first_oom_over_max_batch": None, "no_oom_up_to": 2701}
    cut = memory.markdown({"finder": finder, "ladder": ladder, "first_real_oom": None, "margin": so_far})
    assert ("**None**; margin over the micro-batch –×, over the finder's largest batch –× (no OOM up to 2701 rows)."
            in cut)

    tracker = memory.stop_at_first_oom()
    recovery = OOMRecovery()
    recovery.attach(tracker)
    batch = {"labels": torch.zeros(2837, dtype=torch.long), "input_ids": torch.zeros(2837, 128, dtype=torch.long)}
    with pytest.raises(memory.RanOutOfMemory, match="2837 -> 1419 rows per forward pass"):
        recovery.halve("CUDA out of memory", [batch], step=1, device_type="cpu")
    assert tracker.metrics["train/oom_events"] == [(1, 1.0)] and "2837 -> 1419" in tracker.tags["maxout.oom_recovery"]
    ladder.append({"rows": 2837, "oom": True, "peak_allocated_gb": None, "note": tracker.tags["maxout.oom_recovery"]})
    assert memory.margin(finder, ladder) == pytest.approx({"first_oom_over_micro_batch": 2837 / 2048,
                                                           "first_oom_over_max_batch": 2837 / 2701,
                                                           "no_oom_up_to": None})


def test_a_cut_tracking_section_keeps_the_summary_of_its_whole_repetitions():
    """2026-11-26, call 2: tracking was cut at 40 s after both repetitions but before its summary (the logging-path
    measure came last). The summary is now recorded after every run, from the repetitions that are whole."""
    from benchmarks import tracking_overhead
    from benchmarks.gpu.sections import tracking

    def run(samples_s):
        return {"samples_s": samples_s, "main_cpu_s": 1.5, "background_cpu_s": 0.6, "server_cpu_s": 0.4, "wall_s": 3.0}

    rows = [{"none": run(3482.37), "mlflow": run(3345.83)}, {"mlflow": run(3439.35), "none": run(3641.35)}]
    summary = tracking_overhead.summarize(rows, ["none", "mlflow"])
    assert summary["mlflow"]["ratios"] == pytest.approx([3345.83 / 3482.37, 3439.35 / 3641.35])
    assert tracking_overhead.summarize([], ["none", "mlflow"]) == {}
    partial = [*rows, {"none": run(3500.0)}]  # cut during the third repetition
    md = tracking.markdown({"utilization": {"mean": 10.65, "max": 24.0, "steps": 60, "model": "minilm"},
                            "overhead": {"model": "minilm", "steps": 60, "reps": 3, "store": "sqlite",
                                         "summary": summary, "rows": partial, "logging_path_ms": None}})
    assert "2 of 3 repetitions; logging path not measured" in md
    assert "| mlflow | 3392.6 | 0.953 (0.961, 0.945) |" in md
    assert "Runs in order (samples/s): none 3482.4, mlflow 3345.8, mlflow 3439.3, none 3641.3, none 3500.0." in md


def test_p8_is_packed_and_binned_over_bucketed_within_each_order():
    from benchmarks.gpu.sections import packing

    assert packing.ORDER == ("bucketed", "packed", "binned", "binned", "packed", "bucketed")
    runs = [{"mix": "m", "setting": s, "samples_per_s": v} for s, v in
            zip(packing.ORDER, [100.0, 150.0, 120.0, 130.0, 140.0, 110.0])]
    got = packing.ratio(runs, "m")
    assert got["packed_over_bucketed"] == pytest.approx(145 / 105)
    assert got["binned_over_bucketed"] == pytest.approx(125 / 105)
    assert got["per_order"]["packed"] == pytest.approx([1.5, 140 / 110])
    assert got["per_order"]["binned"] == pytest.approx([1.2, 130 / 110])
    cut = packing.ratio(runs[:2], "m")  # a section cut after two runs: packed measured, binned not, no full round
    assert cut["packed_over_bucketed"] == 1.5 and cut["binned_over_bucketed"] is None
    assert cut["per_order"] == {"packed": [], "binned": []}


def test_p8s_table_gives_the_bound_padding_alone_puts_on_it():
    """Packing saves the padded tokens: against bucketed batches at 80% padding efficiency that is at most 1.25x
    (the H200's demo mix: 87.8%, so 1.14x against a 1.3x goal)."""
    from benchmarks.gpu.sections import packing

    runs = [{"mix": "m", "setting": s, "samples_per_s": v, "tokens_per_s": v, "peak_memory_gb": 1.0,
             "padding_efficiency": e} for s, v, e in zip(packing.ORDER, [100.0, 120.0, 110.0, 111.0, 118.0, 101.0],
                                                          [0.8, 1.0, 0.95, 0.95, 1.0, 0.82])]
    table = packing.markdown({"runs": runs, "ratios": {"m": packing.ratio(runs, "m")}})
    assert "| m | **1.18×** | 1.20×, 1.17× | **1.10×** | 1.10×, 1.10× | 1.25× |" in table


def test_the_long_mix_lies_in_its_length_range(tmp_path):
    from maxout import loading, modeling

    overrides = workloads.long_mix(tmp_path, rows=6, low=40, high=64)
    assert overrides[-1] == "data.max_length=64"
    rows = pd.read_csv(tmp_path / "long-40-64-6-train.csv")
    tokenizer = modeling.load_tokenizer(loading.load(workloads.model("tiny")).model)
    lengths = [len(tokenizer(p, c, truncation=True, max_length=64)["input_ids"]) for p, c in
               zip(rows["post"], rows["criterion"])]
    assert len(lengths) == 6 and all(40 <= n <= 64 for n in lengths)


def test_the_wheel_pins_follow_the_lock_and_the_image_list_parses():
    lock = wheels.pins(ROOT / "constraints.txt")
    carried = wheels.pins()
    assert {n: v for n, v in carried.items() if lock.get(n) != v} == {}  # every pin is the lock's version
    image = wheels.image()
    assert image["torch"] is not None and str(image["transformers"]) == "5.17.0" and image["matplotlib"] is None
    assert not set(carried) & {n for n in image if n != "typing-extensions"}  # nothing the image has, but one


def test_the_rehearsals_replica_is_the_image_without_the_carried_wheels():
    """make gpu-rehearsal builds its replica from replica.txt: only what the image has, at the image's versions."""
    lines = [line.split("#", 1)[0].strip() for line in (ROOT / "benchmarks/gpu/replica.txt").read_text().splitlines()]
    replica = {canonicalize_name(line.partition("==")[0]): line.partition("==")[2] or None for line in lines if line}
    image = wheels.image()
    assert {"torch", "transformers", "numpy", "pytest"} <= set(replica) and set(replica) <= set(image)
    assert {n: v for n, v in replica.items() if v and str(image[n]) != v} == {}
    assert not set(replica) & set(wheels.pins())


def _installed(site, name: str, init: str) -> None:
    """A package ``name`` with its dist-info (the RECORD the closure guard reads owners from) in ``site``."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(init)
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


# How a carried package reaches a module besides an import statement: importlib.util.find_spec("a.b") imports "a"
# with no globals (`import mlflow` probes databricks.agents so), and an extension module importing from C passes the
# import machinery's globals (cryptography's Rust core imports _cffi_backend so). The rehearsal on a replica of the
# GPU image, not this guard, first found both.
PROBES = {"find_spec": "import importlib.util\nFOUND = importlib.util.find_spec('absent_probe.sub')\n",
          "from_c": "import builtins, importlib.util\nbuiltins.__import__('absent_probe', vars(importlib.util))\n"
                    "FOUND = None\n"}


@pytest.mark.parametrize("allowed", [False, True])
@pytest.mark.parametrize("probe", PROBES)
def test_the_closure_guard_sees_a_carried_package_import_outside_an_import_statement(tmp_path, probe, allowed):
    site = tmp_path / "site"
    _installed(site, "carried_probe", PROBES[probe])
    _installed(site, "absent_probe", "")
    script = (f"from benchmarks.gpu.closure import ImageOnly\n"
              f"ImageOnly(set(), {{'carried-probe'{', ' + repr('absent-probe') if allowed else ''}}}).install()\n"
              f"import carried_probe\nprint('found', carried_probe.FOUND)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])})
    if allowed:
        assert done.returncode == 0 and "found None" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
            "ModuleNotFoundError: No module named 'absent_probe': absent-probe is neither on the GPU image nor "
            "carried"), done.stderr[-2000:]


@pytest.mark.slow
def test_maxouts_gpu_paths_import_nothing_the_gpu_machine_lacks():
    """The carried set, checked with the venv's copies of the same versions (make gpu-wheels checks the files)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.closure", "--allow", ",".join(wheels.pins())],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "closure: ok: imports; tracked training on SQLite with the pyfunc model; optuna study" in done.stdout
    # hydra-core, not sqlalchemy (reached ~7 s later, in the tracked run): the workload's first imports refuse it
    without = ",".join(n for n in wheels.pins() if n != "hydra-core")
    refused = subprocess.run([sys.executable, "-m", "benchmarks.gpu.closure", "--allow", without], cwd=ROOT,
                             capture_output=True, text=True, timeout=900)
    assert refused.returncode == 1 and "closure: refused hydra (hydra-core)" in refused.stderr  # the check can fail


@pytest.mark.slow
def test_on_a_cpu_the_report_runs_what_it_can_and_says_why_not_the_rest(tmp_path):
    out = tmp_path / "report"
    # forked warm, and so are its sections (tests/warm_maxout.py): the imports of eight processes, ~35 CPU-s
    done = warm_maxout.run(["--out", str(out)], program="benchmarks.gpu_report", timeout=1800)
    got = entries(out)
    assert done.returncode == 0, done.stdout[-4000:]
    assert {n: e["status"] for n, e in got.items()} == {
        "environment": "ok", "gpu_tests": "skipped", "vs_trainer": "ok", "mfu": "skipped", "compile_modes": "skipped",
        "mfu_compiled": "skipped", "packing": "ok",
        "ablation": "ok", "batch_finder": "skipped", "tracking": "ok", "audit": "ok", "hpo": "ok"}
    assert got["gpu_tests"]["reason"] == "needs a CUDA device: every gpu-marked test would skip"
    assert got["mfu"]["reason"].startswith("needs a CUDA device: there is no meaningful peak")
    assert got["mfu_compiled"]["reason"] == got["mfu"]["reason"]
    assert got["environment"]["results"]["cuda"] is False and got["environment"]["results"]["matmul"]["bf16"][
        "measured_tflops"] > 0
    (mix,) = got["vs_trainer"]["results"]["mixes"].values()
    assert mix["ratio_vs_trainer_best"] > 0 and [o["order"] for o in mix["ratios_per_order"]] == [
        "maxout first", "maxout last"]
    p8 = got["packing"]["results"]
    assert [r["setting"] for r in p8["runs"]] == ["bucketed", "packed", "binned", "binned", "packed", "bucketed"]
    assert p8["decisions"]["opt.packing.effective"] == "mask"  # no varlen kernel on a CPU: the reason is logged
    assert "on CUDA only" in p8["decisions"]["opt.packing.reason"]
    assert list(p8["ratios"].values())[0]["packed_over_bucketed"] > 0
    assert list(p8["ratios"].values())[0]["binned_over_bucketed"] > 0
    (grid,) = got["ablation"]["results"]["grids"].values()
    assert [c["cell"] for c in grid["cells"]] == ["fused_adamw=off", "fused_adamw=on"]
    assert got["tracking"]["results"]["overhead"]["summary"]["mlflow"]["median_ratio"] > 0
    audited = got["audit"]["results"]["report"]
    assert {lever["name"] for lever in audited["levers"]} >= {"bucketing", "fused_adamw", "packing"}
    assert 0 < audited["verdict"]["share_of_best"] <= 1
    studies, rows = got["hpo"]["results"]["studies"], got["hpo"]["results"]["rows"]
    assert [r["workers"] for r in rows] == [1, 2] and [s["workers"] for s in studies] == [1, 2]  # one study per N
    for row, study in zip(rows, studies):
        assert row["trials"] == study["trials"] >= 2 * row["workers"] and row["wall_s"] > 0
        assert row["trials_per_hour"] == pytest.approx(row["trials"] * 3600 / row["wall_s"])
        assert row["steady_trials_per_hour"] > row["trials_per_hour"]  # start-up left out
        # Ctrl-C: every process gone, nothing left RUNNING in MLflow or the journal, no trial finished after it
        assert (study["stop"], study["left_behind"], row["running_runs"]) == ("SIGINT", [], 0)
        assert (study["trials_left_running"], study["finished_after_sigint"]) == ([], 0)
        assert study["workers_seen"] == row["workers"]  # each worker process ran trials
        # the supervisor and its workers were watched (forked warm here, so found by the trials they name)
        assert study["processes_seen"] >= 1 + (row["workers"] if row["workers"] > 1 else 0)
        tracked = study["tracked"]
        assert tracked["parent_runs"] == 1 and tracked["trial_runs_nested"] == tracked["trial_runs"] >= row["trials"]
    assert rows[0]["speed_up"] == 1 and rows[1]["speed_up"] > 0
    files = sorted(p.name for p in out.iterdir())
    assert files[:2] == ["ablation.png", "environment.png"] and {"report.json", "report.md"} <= set(files)
    assert len(files) <= 7 and all((out / f).stat().st_size < 16 * 2**20 for f in files)  # + the command's log
    report = (out / "report.md").read_text()
    for section in SECTIONS:
        assert f"## {section.title}" in report
    assert "scale **smoke**" in report and "| gpu_tests | skipped |" in report
