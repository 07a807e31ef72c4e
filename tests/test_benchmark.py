"""The ablation benchmark: a 2x2 grid makes 4 nested MLflow runs under one parent, a comparison table (markdown,
CSV) and bar charts; cells the device cannot honour are skipped with the reason; bad grids are one-line errors."""

from __future__ import annotations

import math

import mlflow
import pandas as pd
import pytest

from maxout import cli
from maxout.insight import benchmark, grid as grid_mod

from . import warm_maxout
from .conftest import runs_in

BASE = ["hardware=cpu", "model=tiny"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_2x2_grid_makes_4_child_runs_a_table_and_charts(mlflow_store, tmp_path, capsys, warm_starts):
    out = tmp_path / "bench"
    code = cli.main(["benchmark", *BASE, *mlflow_store["overrides"], "--grid", "bucketing=off,on fused_adamw=off,on",
                     "--steps", "5", "--out", str(out), "--no-progress"])
    assert code == 0
    # The cells share one warm start: the first tokenized the train and validation tables, the other three reused them
    assert len(warm_starts) == 1 and warm_starts[0].hits == 3 * 2
    runs = runs_in(mlflow_store["uri"])
    parents = [r for r in runs if r.data.tags.get("maxout.command") == "benchmark"]
    children = [r for r in runs if r.data.tags.get("maxout.command") == "benchmark-cell"]
    assert len(parents) == 1 and len(children) == 4 and len(runs) == 5
    parent = parents[0]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert {r.info.experiment_id for r in runs} == {parent.info.experiment_id}
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags["maxout.cell"] for r in children} == {
        "bucketing=off fused_adamw=off", "bucketing=off fused_adamw=on", "bucketing=on fused_adamw=off",
        "bucketing=on fused_adamw=on"}
    for child in children:  # each cell ran what it names, and measured the steady state
        cell = child.data.tags["maxout.cell"]
        assert child.data.params["opt.bucketing.effective"] == str("bucketing=on" in cell).lower()
        assert child.data.params["opt.fused_adamw.effective"] == str("fused_adamw=on" in cell).lower()
        assert child.data.metrics["perf/steady_samples_per_s"] > 0 and child.data.metrics["mem/peak_tensor_gb"] > 0

    table = pd.read_csv(out / "benchmark.csv")
    assert list(table["cell"])[0] == "bucketing=off fused_adamw=off" and len(table) == 4
    assert table["speed-up"].iloc[0] == pytest.approx(1.0) and table["memory ratio"].iloc[0] == pytest.approx(1.0)
    by_cell = {r.data.tags["maxout.cell"]: r.data.metrics for r in children}
    for row in table.to_dict("records"):  # the table is computed from what the runs logged
        assert row["steady samples/s"] == pytest.approx(by_cell[row["cell"]]["perf/steady_samples_per_s"])
        assert row["speed-up"] == pytest.approx(row["steady samples/s"] / table["steady samples/s"].iloc[0])
    markdown = (out / "benchmark.md").read_text()
    assert "| Cell | Samples/s |" in markdown and "baseline" in markdown and markdown.count("\n|") == 6
    for png in ("speedup.png", "memory.png"):
        assert (out / png).read_bytes()[:8] == PNG
    logged = {a.path for a in mlflow.MlflowClient(mlflow_store["uri"]).list_artifacts(parent.info.run_id, "benchmark")}
    assert logged == {"benchmark/benchmark.md", "benchmark/benchmark.csv", "benchmark/speedup.png",
                      "benchmark/memory.png"}
    assert "| bucketing=off fused_adamw=off |" in capsys.readouterr().out
    # The parent's run page shows the table itself (its description), and its name says what it compared.
    assert parent.data.tags["mlflow.note.content"] == markdown
    assert parent.info.run_name == "benchmark tiny-cpu"


def test_cells_the_device_cannot_honour_are_skipped_with_the_reason(cpu_device, tmp_path):
    report = benchmark.run([*BASE, "tracking=none"], grid_spec="precision=fp16 compile=off",
                           out_dir=str(tmp_path), device=cpu_device, progress=False)
    (row,) = report.rows
    assert row.status == "skipped" and "no CUDA device" in row.reason and row.samples == []
    assert "skipped: precision fp16: no CUDA device" in report.markdown()
    assert "one epoch per cell" in report.markdown() and report.baseline is None


def test_bucketing_with_static_padding_is_skipped(cpu_device):
    grid = grid_mod.parse_grid("bucketing=on")
    from maxout import loading

    cfg = loading.load([*BASE, "data.padding=max_length"], device=cpu_device)
    assert "pads every row to the same length" in benchmark.skip_reason(grid_mod.cells(grid)[0], cpu_device, cfg)


def test_fast_dropout_with_compile_or_checkpointing_in_the_same_cell_is_skipped(cpu_device):
    from maxout import loading

    cfg = loading.load(BASE, device=cpu_device)
    grid = grid_mod.parse_grid("gradient_checkpointing=off,on fast_dropout=on")
    honoured, recomputed = (benchmark.skip_reason(cell, cpu_device, cfg) for cell in grid_mod.cells(grid))
    assert honoured == "" and recomputed.startswith("fast_dropout: gradient checkpointing recomputes dropout")
    compiled = grid_mod.cells(grid_mod.parse_grid("compile=on fast_dropout=on"))[0]
    assert "inductor" in benchmark.skip_reason(compiled, cpu_device, cfg) or \
        benchmark.skip_reason(compiled, cpu_device, cfg).startswith("compile:")  # no C compiler: compile says so first


def test_gpu_axes_are_asked_for_by_name_and_skip_what_the_device_cannot_honour(cpu_device):
    from maxout import loading
    from tests.conftest import fake_cuda

    grid = grid_mod.parse_grid("tf32=off,on compile_mode=default,reduce-overhead attention=sdpa,flash_attention_2")
    assert len(grid_mod.cells(grid)) == 8 and "tf32" not in grid_mod.parse_grid(None)
    cfg = loading.load([*BASE, "hardware.compile=true"], device=cpu_device)
    reasons = {c.name: benchmark.skip_reason(c, cpu_device, cfg) for c in grid_mod.cells(grid)}
    assert reasons["tf32=off compile_mode=default attention=sdpa"] == ""
    assert reasons["tf32=on compile_mode=default attention=sdpa"] == "tf32: no CUDA device"
    assert reasons["tf32=off compile_mode=reduce-overhead attention=sdpa"] == \
        "compile_mode reduce-overhead: CUDA graphs need a CUDA device"
    assert reasons["tf32=off compile_mode=default attention=flash_attention_2"].startswith(
        "attention flash_attention_2: no CUDA device")
    gpu = fake_cuda(name="NVIDIA H100 80GB HBM3", cc=(9, 0))
    (dynamic,) = grid_mod.cells(grid_mod.parse_grid("compile_mode=max-autotune"))
    assert benchmark.skip_reason(dynamic, gpu, cfg) == ""  # dynamic padding rounds to pad_widths (auto: 8)
    unrounded = loading.load([*BASE, "hardware.compile=true", "hardware.pad_widths=null"], device=cpu_device)
    assert benchmark.skip_reason(dynamic, gpu, unrounded) == (
        "compile_mode max-autotune: CUDA graphs record one graph per shape: round dynamic padding to a few widths "
        "(hardware.pad_widths=auto or 8) or set data.padding=max_length")
    static = loading.load([*BASE, "hardware.compile=true", "data.padding=max_length", "data.bucketing=false"],
                          device=cpu_device)
    assert benchmark.skip_reason(dynamic, gpu, static) == ""
    uncompiled = loading.load(BASE, device=cpu_device)
    assert benchmark.skip_reason(dynamic, gpu, uncompiled).startswith("compile_mode: compile is off")


def test_the_default_grid_is_every_value_of_every_axis():
    grid = grid_mod.parse_grid(None)
    assert "padding" not in grid  # opt-in: it overlaps bucketing
    assert grid["precision"] == ("fp32", "fp16", "bf16") and len(grid_mod.cells(grid)) == 3 * 2 ** 5
    assert grid_mod.cells(grid)[0].name == ("precision=fp32 compile=off gradient_checkpointing=off bucketing=off "
                                            "fused_adamw=off fast_dropout=off")


@pytest.mark.parametrize("grid,message", [
    ("precison=fp32", "unknown grid key 'precison' (valid: precision, compile, gradient_checkpointing, bucketing, "
                      "fused_adamw, fast_dropout, tf32, compile_mode, attention, compile_scope, liger_kernel, "
                      "inductor_tuning, mix_order_reduction, low_precision_layernorm, prepared_mask, "
                      "unmasked_causal, skip_guards, padding)"),
    ("padding=packed bucketing=on", "grid keys 'padding' and 'bucketing' both set data.bucketing: name one of them"),
    ("padding=unpadded", "grid padding='unpadded' is invalid (valid: dynamic, bucketed, packed, binned)"),
    ("precision=fp8", "grid precision='fp8' is invalid (valid: fp32, fp16, bf16)"),
    ("compile=maybe", "grid compile='maybe' is invalid (valid: on, off, true, false)"),
    ("compile", "grid entry 'compile' is malformed: write axis=value1,value2"),
    ("compile=on compile=off", "grid key 'compile' is given twice"),
])
def test_bad_grids_are_one_line_usage_errors_and_run_nothing(grid, message, no_mlflow_store, capsys):
    mlflow_store = no_mlflow_store
    assert cli.main(["benchmark", *BASE, *mlflow_store["overrides"], "--grid", grid, "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"maxout: error: {message}") and "\n" not in err, err
    assert not (mlflow_store["dir"] / "mlflow.db").exists()  # rejected before anything touched the store


def test_a_failing_cell_is_recorded_and_the_others_still_run(cpu_device, tmp_path, monkeypatch):
    real_train = benchmark.train

    def train(cfg, **kwargs):
        if cfg.hardware.fused_adamw:
            raise RuntimeError("kernel exploded\nsecond line")
        return real_train(cfg, **kwargs)

    monkeypatch.setattr(benchmark, "train", train)
    report = benchmark.run([*BASE, "tracking=none"], grid_spec="fused_adamw=off,on", steps=4, out_dir=str(tmp_path),
                           device=cpu_device, progress=False)
    ok, failed = report.rows
    assert ok.status == "ok" and ok.median("perf/steady_samples_per_s") > 0
    assert (failed.status, failed.reason) == ("failed", "RuntimeError: kernel exploded")
    markdown = report.markdown()
    assert "| fused_adamw=on | – |" in markdown and "failed: RuntimeError: kernel exploded" in markdown


def test_rounds_run_the_cells_in_alternating_order(cpu_device, tmp_path, monkeypatch):
    """A B, B A, A B: each cell is first in a round as often as it is last (a drift across a round favours none)."""
    from maxout.optimizations import Decision

    seen = []

    def measure(cfg, device, dataset, tracker, warm):
        fused = cfg.hardware.fused_adamw
        seen.append(fused)
        return benchmark.Measured({"perf/steady_samples_per_s": 2.0 if fused else 1.0}, [
            Decision("fused_adamw", fused, fused)], {})

    monkeypatch.setattr(benchmark, "measure", measure)
    report = benchmark.run([*BASE, "tracking=none"], grid_spec="fused_adamw=off,on", steps=4, repeats=3,
                           out_dir=str(tmp_path), device=cpu_device, progress=False)
    assert seen == [False, True, True, False, False, True]
    off, on = report.rows
    assert len(off.samples) == len(on.samples) == 3 and on.median("perf/steady_samples_per_s") == 2.0


def test_the_padding_axis_sets_padding_bucketing_and_a_token_budget(cpu_device):
    from maxout import loading

    cfg = loading.load(BASE, device=cpu_device)
    dynamic, bucketed, packed, binned = grid_mod.cells(grid_mod.parse_grid("padding=dynamic,bucketed,packed,binned"))
    assert (dynamic.apply(cfg).data.padding, dynamic.apply(cfg).data.bucketing) == ("dynamic", False)
    assert (bucketed.apply(cfg).data.padding, bucketed.apply(cfg).data.bucketing) == ("dynamic", True)
    assert (packed.apply(cfg).data.padding, packed.apply(cfg).data.max_tokens_per_batch) == ("packed", "auto")
    assert (binned.apply(cfg).data.padding, binned.apply(cfg).data.packing_attention) == ("packed", "bins")
    assert benchmark.skip_reason(packed, cpu_device, cfg) == ""  # BERT keeps packed rows apart
    assert benchmark.skip_reason(binned, cpu_device, cfg) == ""
    cfg.model.architecture = {"model_type": "deberta-v2", "hidden_size": 32, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "intermediate_size": 64}
    assert benchmark.skip_reason(packed, cpu_device, cfg).startswith("padding packed: model type 'deberta-v2'")


@pytest.mark.slow
def test_padding_comparison_reports_padding_efficiency_of_each_cell(cpu_device, tmp_path):
    report = benchmark.padding_comparison([*BASE, "tracking=none"], steps=5, out_dir=str(tmp_path),
                                          device=cpu_device, progress=False)
    table = report.table.set_index("cell")
    assert list(table.index) == ["padding=dynamic", "padding=bucketed", "padding=packed"]
    assert (table["status"] == "ok").all()
    efficiency = table["padding efficiency"]
    assert efficiency["padding=packed"] == 1.0 and efficiency["padding=dynamic"] < efficiency["padding=bucketed"] < 1
    assert "| padding=packed |" in report.markdown() and "100.0%" in report.markdown()


# ------------------------------------------------------------------------------------------------ time-to-best


def synthetic_curves(n: int, reports: int, seed: int):
    """Learning curves of ``n`` trials of ``reports`` epochs, one report per epoch, in hpo_pruning's Curve form."""
    import random

    from benchmarks.hpo_pruning import Curve

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start, slope = rng.uniform(0.2, 0.5), rng.uniform(-0.05, 0.12)
        values = [(k, round(min(1.0, start + slope * k + rng.uniform(-0.02, 0.02)), 4)) for k in range(1, reports + 1)]
        out.append(Curve(values, [float(k) for k in range(1, reports + 1)], float(reports)))
    return out


def test_the_time_to_best_replay_on_one_worker_is_the_sequential_replay_and_more_workers_finish_sooner():
    """The discrete-event simulation with one worker makes the same reports in the same order as hpo_pruning's
    sequential replay, so the same trials are pruned; with two workers a trial's decisions see fewer finished
    trials, and the study's clock is shorter at the same costs per worker."""
    from benchmarks.hpo_pruning import Setting, replay
    from benchmarks.hpo_time_to_best import Costs, bootstrap, simulate

    recorded = synthetic_curves(12, 4, seed=3)
    trials = bootstrap(recorded, 40, seed=1)
    assert len(trials) == 40 and all(t in recorded for t in trials)
    costs = Costs(epoch_s=2.0, eval_s=0.5, setup_s=1.0)
    pruned_any = False
    for setting in (Setting(1, 1, 3, None), Setting(1, 2, 2, 0), Setting(2, 1, 3, None)):
        one = simulate(trials, setting, costs, 1, "s")
        sequential = replay(trials, setting, "s")
        for key in ("epochs", "evaluations", "pruned", "best", "planned"):
            assert one[key] == pytest.approx(sequential[key]), (setting, key)
        assert one["epochs"] <= one["planned"] == 160
        # One worker's clock is exactly the work: set-up per trial, then each trained epoch and each evaluation.
        assert one["clock_s"] == pytest.approx(40 * costs.setup_s + one["epochs"] * costs.epoch_s
                                               + one["evaluations"] * costs.eval_s)
        two = simulate(trials, setting, costs, 2, "s")
        assert two["epochs"] <= two["planned"] and two["clock_s"] < one["clock_s"]
        pruned_any = pruned_any or one["pruned"] > 0
    assert pruned_any  # the curves differ enough for Hyperband to stop some trials
    unpruned = simulate(trials, None, costs, 1, "s", target=max(max(v for _, v in t.values) for t in trials) - 0.01)
    assert unpruned["pruned"] == 0 and unpruned["epochs"] == unpruned["planned"]
    assert 0 < unpruned["time_to_best_s"] <= unpruned["clock_s"]


@pytest.mark.slow
def test_the_time_to_best_smoke_runs_both_studies_on_the_same_configurations(tmp_path):
    """benchmarks/hpo_time_to_best.py --smoke: the plain and maxout studies through the real CLI, interleaved in
    two segments; its figures hold together (time-to-best within the clock, the clock the segments' sum, the
    replay never runs more than it planned, its one-worker prediction of the real maxout study exact)."""
    import json

    import optuna

    from benchmarks.hpo_pruning import open_journal

    out, figure, found_json = tmp_path / "store", tmp_path / "ttb.png", tmp_path / "ttb.json"
    # --threads 1: the other xdist worker shares the two cores, and torch's two threads per process spinning
    # against it cost ~3 CPU-s a segment (11.0 against 13.0-14.5 for three tiny trials, measured 2026-11-28)
    # forked warm, and so are its four segments' maxout commands (tests/warm_maxout.py): ~25 CPU-s of imports
    done = warm_maxout.run(["--smoke", "--threads", "1", "--out", str(out), "--figure", str(figure), "--json",
                            str(found_json)], program="benchmarks.hpo_time_to_best")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(found_json.read_text())
    configs = found["configurations"]
    assert len(configs) == 6 and len({json.dumps(c, sort_keys=True) for c in configs}) == 6
    # Both studies trained exactly the queued configurations, in the queued order.
    storage = open_journal([f"hpo.storage={out / 'optuna.journal'}"])
    for name in ("plain", "maxout"):
        trials = sorted(optuna.load_study(study_name=name, storage=storage).get_trials(), key=lambda t: t.number)
        assert [t.params for t in trials[:6]] == configs
        assert all(t.state.is_finished() for t in trials[:6])
    assert found["plain"]["params"] == found["maxout"]["params"] == configs
    # Interleaved: P M, then M P; each study's clock is its segments' walls summed.
    assert [(s["study"], s["n_trials"]) for s in found["segments"]] == [("plain", 3), ("maxout", 3), ("maxout", 6),
                                                                        ("plain", 6)]
    plain, maxout = found["plain"], found["maxout"]
    for study in (plain, maxout):
        walls = [s["wall_s"] for s in found["segments"] if s["study"] == study["name"]]
        assert study["clock_s"] == pytest.approx(sum(walls)) and study["segments_s"] == walls
        assert [at for at, _ in study["timeline"]] == sorted(at for at, _ in study["timeline"])
        assert all(0 <= at <= study["clock_s"] for at, _ in study["timeline"])
        if study["time_to_best_s"] is not None and not math.isnan(study["time_to_best_s"]):
            assert 0 < study["time_to_best_s"] <= study["clock_s"]
            first = next(at for at, value in study["timeline"] if value >= found["target"] - 1e-12)
            assert study["time_to_best_s"] == pytest.approx(first)
        assert study["trial_epochs"] <= study["planned_epochs"] == 6 * 2
        assert study["compile"]["opt.compile.effective"] == "false"  # hardware=cpu: compile off
    assert found["target"] == pytest.approx(plain["best"] - 0.01)
    assert not math.isnan(plain["time_to_best_s"])  # the plain study reaches its own best
    assert plain["pruned"] == 0 and plain["trial_epochs"] == 12 and plain["evaluations"] == 12
    assert plain["workers"] == 1
    levers = found["levers"]
    assert levers["measured_clock"] == pytest.approx(plain["clock_s"] / maxout["clock_s"])
    assert levers["pruning"] == pytest.approx(plain["trial_epochs"] / maxout["trial_epochs"])
    replay = found["replay"]
    assert replay["n"] == 20 and replay["rows"]
    for row in replay["rows"]:
        assert row["planned"] == 20 * 2 and row["most_epochs"] <= row["planned"]
        assert 0 <= row["kept"] <= 1 and row["pruned"] <= 20 and row["workers"] in (1, 2)
    assert replay["chosen"] in replay["rows"]
    predicted = replay["prediction"]
    if maxout["workers"] == 1:  # one worker: the replay of the real trial order is exact
        assert predicted["epochs"] == pytest.approx(maxout["all_trial_epochs"])
        assert predicted["pruned"] == maxout["all_pruned"] and predicted["best"] == pytest.approx(maxout["best"])
    assert maxout["all_trial_epochs"] >= maxout["trial_epochs"] and maxout["extra_trials"] < max(1, maxout["workers"])
    assert predicted["sequential"]["epochs"] <= predicted["planned"]
    assert figure.read_bytes()[:8] == PNG
    assert "## Time-to-best" in done.stdout and "| plain (" in done.stdout and "## Replay" in done.stdout
