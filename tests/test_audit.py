"""maxout audit: on a deliberately slow config (fp32, no bucketing, fused AdamW off) it finds those levers, measures
them as paired runs, recommends a config that really is faster, and its report agrees with its MLflow runs; levers
the device cannot use carry the training run's own reason; the budget is respected; bad input is one line."""

from __future__ import annotations

import json
import signal
import statistics
import time

import mlflow
import pytest

from maxout import cli, loading
from maxout.insight import audit, breakdown, levers
from maxout.optimizations import mix_order_reduction
from maxout.tracking.tracker import closing, start
from maxout.train import Callback, lineage, prepare, train

from .conftest import TINY, runs_in

SLOW = ["hardware=cpu", "model=tiny", "hardware.precision=fp32", "data.bucketing=false", "hardware.fused_adamw=false"]
PNG = b"\x89PNG\r\n\x1a\n"




def test_levers_the_device_cannot_use_carry_the_training_runs_reason(cpu_device):
    asked = ["hardware.tf32=true", "hardware.pin_memory=true", "hardware.cudnn_benchmark=true",
             "hardware.attn_implementation=flash_attention_2", "hardware.liger_kernel=true",
             "hardware.low_precision_layernorm=true"]
    result = train(loading.load([*TINY, *asked], device=cpu_device), progress=False, device=cpu_device, verbose=False)
    rows = {r.name: r for r in audit.plan_levers(loading.load(TINY, device=cpu_device), cpu_device)}
    for lever, param in [("tf32", "tf32"), ("pin_memory", "pin_memory"), ("cudnn_benchmark", "cudnn_benchmark"),
                         ("flash_attention", "attention"), ("liger_kernel", "liger_kernel")]:
        row = rows[lever]
        assert (row.status, row.decision) == (levers.CANNOT_USE, param), lever
        assert row.reason == result.params[f"opt.{param}.reason"], lever  # the same string, from the same code
    # decided when the model is built, so checked by the lever itself, with the same code and the same words
    lp_norm = rows["low_precision_layernorm"]  # the CPU profile has it: in use under bf16, refused in fp32
    if cpu_device.bf16:
        assert lp_norm.status == levers.IN_USE and result.params["opt.low_precision_layernorm.effective"] == "true"
    else:
        assert lp_norm.status == levers.CANNOT_USE
        assert lp_norm.reason == result.params["opt.low_precision_layernorm.reason"]
        assert "precision fp32" in lp_norm.reason
    if cpu_device.compiler:  # compiled, then tuned: only inductor's GPU kernels are tuned
        tuning = rows["inductor_tuning"]
        assert (tuning.status, tuning.decision) == (levers.CANNOT_USE, "inductor_tuning")
        assert tuning.reason.startswith("coordinate-descent tuning tunes inductor's Triton (GPU) kernels")
    mix_order = rows["mix_order_reduction"]  # a lever that turns a default off checks the device itself
    assert (mix_order.status, mix_order.reason) == (levers.CANNOT_USE,
                                                    mix_order_reduction.supported(cpu_device, compiled=True)[1])
    if cpu_device.compiler:  # without a C compiler, compile itself is what cannot be used
        assert (rows["cuda_graphs"].status, rows["cuda_graphs"].decision) == (levers.CANNOT_USE, "compile_mode")
        assert rows["cuda_graphs"].reason == "CUDA graphs need a CUDA device"


def test_on_a_hopper_gpu_bf16_layernorm_is_a_lever_to_measure_unless_the_profile_has_it():
    """The h200 profile runs LayerNorm in bf16 (1.13x on the H200, 2026-11-27): in use there; a config that turns
    it off gets it measured; Liger's kernels cannot serve an encoder, with the reason a run would log."""
    from transformers import BertForSequenceClassification

    from maxout.train.setup import plan_decisions

    from .conftest import fake_cuda

    h200 = fake_cuda(name="NVIDIA H200", memory_gb=139.8, cc=(9, 0))
    by_name = {lever.name: lever for lever in levers.LEVERS}
    for extra, status, overrides in [([], levers.IN_USE, ()),
                                     (["hardware.low_precision_layernorm=false"], levers.MEASURE,
                                      ("hardware.low_precision_layernorm=true",))]:
        cfg = loading.load(["hardware=h200", "model=tiny", *extra], device=h200)
        ctx = levers.Context(h200, BertForSequenceClassification,
                             plan_decisions(cfg, h200, BertForSequenceClassification), 16, 1, lambda c: 16)
        row = levers.assess(by_name["low_precision_layernorm"], cfg, ctx)
        assert (row.status, tuple(row.overrides or ())) == (status, overrides), extra
    liger = levers.assess(by_name["liger_kernel"], cfg, ctx)
    assert liger.status == levers.CANNOT_USE and liger.decision == "liger_kernel"


def test_on_a_gpu_inductors_fused_layernorm_backward_is_measured_off_unless_the_config_has_it_off(monkeypatch):
    from transformers import BertForSequenceClassification

    from maxout.optimizations import compile as compile_opt
    from maxout.train.setup import plan_decisions

    from .conftest import fake_cuda

    monkeypatch.setattr(compile_opt, "has_triton", lambda: True)  # the GPU image has it
    h200 = fake_cuda(name="NVIDIA H200", memory_gb=139.8, cc=(9, 0))
    lever = next(lever for lever in levers.LEVERS if lever.name == "mix_order_reduction")
    measured = ("hardware.compile=true", "hardware.mix_order_reduction=false")
    for extra, status, overrides in [([], levers.MEASURE, measured),
                                     (["hardware.mix_order_reduction=false"], levers.IN_USE, ())]:
        cfg = loading.load(["hardware=h200", "model=tiny", *extra], device=h200)
        ctx = levers.Context(h200, BertForSequenceClassification,
                             plan_decisions(cfg, h200, BertForSequenceClassification), 16, 1, lambda c: 16)
        row = levers.assess(lever, cfg, ctx)
        assert (row.status, tuple(row.overrides or ())) == (status, overrides), extra


def test_levers_in_use_and_skipped_say_why(cpu_device):
    rows = {r.name: r for r in audit.plan_levers(loading.load(TINY, device=cpu_device), cpu_device)}
    assert rows["fast_dropout"].status == levers.IN_USE  # the CPU profile has it
    assert rows["micro_batch"].status == levers.IN_USE and "no accumulation" in rows["micro_batch"].reason
    assert rows["gradient_checkpointing"].status == levers.SKIPPED and "memory does not bind" in \
        rows["gradient_checkpointing"].reason
    assert rows["no_dropout"].lever.cost and rows["deterministic"].lever.cost  # never recommended silently
    slow = {r.name: r for r in audit.plan_levers(loading.load(SLOW, device=cpu_device), cpu_device,
                                                 only=("bucketing",))}
    assert slow["bucketing"].status == levers.MEASURE and slow["bucketing"].overrides == ("data.bucketing=true",)
    assert slow["fused_adamw"].status == levers.SKIPPED and slow["fused_adamw"].reason == "not among --levers"


def test_unmasked_causal_attention_is_a_lever_for_a_qwen_decoder_under_sdpa(cpu_device):
    def row(*overrides):
        cfg = loading.load([*TINY, *overrides], device=cpu_device)
        return {r.name: r for r in audit.plan_levers(cfg, cpu_device)}["unmasked_causal"]

    encoder = row()  # BERT: its decision's reason, word for word
    assert (encoder.status, encoder.decision) == (levers.CANNOT_USE, "unmasked_causal")
    assert "model type 'bert' is not a decoder that takes its masks by layer type" in encoder.reason
    qwen = ["model=tiny_qwen3", "hardware.attn_implementation=sdpa"]
    assert row(*qwen).status == levers.IN_USE  # every profile has it
    off = row(*qwen, "hardware.unmasked_causal=false")
    assert (off.status, off.overrides) == (levers.MEASURE, ("hardware.unmasked_causal=true",))
    assert row("model=tiny_qwen3").reason.startswith("attention 'eager'")  # the CPU profile's attention


def test_packing_is_a_lever_unless_the_config_packs_already(cpu_device):
    cfg = loading.load(TINY, device=cpu_device)
    (row,) = [r for r in audit.plan_levers(cfg, cpu_device) if r.name == "packing"]
    # BERT keeps packed rows apart: a lever to measure, with the token budget packing needs
    assert (row.status, row.overrides) == (levers.MEASURE, ("data.padding=packed", "data.max_tokens_per_batch=auto"))
    packed = loading.load([*TINY, "data.padding=packed", "data.max_tokens_per_batch=auto"], device=cpu_device)
    (row,) = [r for r in audit.plan_levers(packed, cpu_device) if r.name == "packing"]
    assert row.status == levers.IN_USE and "data.padding=packed already" in row.reason


def test_bins_are_a_lever_beside_packing_with_the_reason_a_model_that_cannot_pack_logs(cpu_device):
    rows = {r.name: r for r in audit.plan_levers(loading.load(TINY, device=cpu_device), cpu_device)}
    assert (rows["bins"].status, rows["bins"].overrides) == (levers.MEASURE, (
        "data.padding=packed", "data.max_tokens_per_batch=auto", "data.packing_attention=bins"))
    # a config that packs through another path still measures bins: the packing decision differs
    packed = loading.load([*TINY, "data.padding=packed"], device=cpu_device)
    assert {r.name: r for r in audit.plan_levers(packed, cpu_device)}["bins"].status == levers.MEASURE
    binned = loading.load([*TINY, "data.padding=packed", "data.packing_attention=bins"], device=cpu_device)
    assert {r.name: r for r in audit.plan_levers(binned, cpu_device)}["bins"].status == levers.IN_USE
    deberta = loading.load(TINY, device=cpu_device)
    deberta.model.architecture = {**deberta.model.architecture, "model_type": "deberta-v2"}  # no packed path
    row = {r.name: r for r in audit.plan_levers(deberta, cpu_device)}["bins"]
    assert (row.status, row.decision) == (levers.CANNOT_USE, "padding") and "deberta-v2" in row.reason


def test_the_breakdown_counts_the_loops_loss_read_at_its_true_rate(cpu_device, one_torch_thread):
    cfg = loading.load([*TINY, "train.max_steps=-1"], device=cpu_device)
    checked = prepare.check(cfg)

    def probe(log_every):
        run_cfg = levers.with_overrides(cfg, [f"train.log_every={log_every}"])
        return breakdown.probe(run_cfg, cpu_device, checked.dataset, checked.tokenizer, 16, steps=4)

    every_step, every_fourth = probe(1), probe(4)
    # The model's own host reads (transformers checks its padding mask once per forward) are the same in both:
    # the difference is the loop's loss read, once per log interval.
    assert every_step.host_syncs_per_step - every_fourth.host_syncs_per_step == pytest.approx(1 - 1 / 4)
    assert every_fourth.sync_steps % 4 == 0 and every_fourth.host_syncs_per_step >= 0.25
    shares = every_step.shares()
    assert sum(shares.values()) == pytest.approx(1.0) and 0 < shares["optimizer"] < 1
    assert 0 <= shares["data_wait"] < 1 and every_step.step_ms > 0


@pytest.mark.parametrize("args,message", [
    (["--budget-s", "10"], "--budget-s=10 is too small to measure anything"),
    (["--steps", "0"], "--steps=0 must be >= 1"),
    (["--levers", "precison"], "unknown lever 'precison' (valid: precision, bucketing,"),
    (["train.lr=-1", "train.epochs=0"], None),  # the same as maxout train says
])
def test_bad_input_is_one_line_and_leaves_no_run(args, message, mlflow_store, capsys):
    code = cli.main(["audit", "model=tiny", *mlflow_store["overrides"], *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("maxout: error: ") and "\n" not in err, err
    if message is None:
        cli.main(["train", "model=tiny", *mlflow_store["overrides"], *args])
        message = capsys.readouterr().err.strip().removeprefix("maxout: error: ")
        assert message.startswith("2 problems: train.epochs=0 must be >= 1; train.lr=-1.0 must be > 0")
    assert message in err, err
    assert runs_in(mlflow_store["uri"]) == []


class SteadyCpu(Callback):
    """CPU seconds of this process over the steady steps (after the warm-up): the work a step costs, which other
    jobs on a shared machine do not inflate the way they inflate wall time."""

    def __init__(self, warmup: int):
        self.warmup, self.began, self.cpu_s, self.steps = warmup, None, 0.0, 0

    def on_step_end(self, state) -> None:
        if state.step == self.warmup:
            self.began = time.process_time()
        elif self.began is not None:
            self.cpu_s, self.steps = time.process_time() - self.began, state.step - self.warmup


def samples_per_cpu_s(overrides, cpu_device, dataset):
    cfg = loading.load([*overrides, "tracking=none", "train.max_steps=23", "train.epochs=100"], device=cpu_device)
    meter = SteadyCpu(cfg.train.warmup_steps_excluded)
    result = train(cfg, callbacks=[meter], progress=False, device=cpu_device, verbose=False, dataset=dataset)
    return meter.steps * result.setup.micro_batch / meter.cpu_s, result.metrics["perf/steady_samples_per_s"]


@pytest.mark.slow
def test_audit_of_a_slow_config_finds_its_levers_and_recommends_a_faster_one(mlflow_store, tmp_path, cpu_device,
                                                                              one_torch_thread, capsys, warm_starts):
    out = tmp_path / "audit"
    chosen = "precision,bucketing,fused_adamw"
    code = cli.main(["audit", *SLOW, *mlflow_store["overrides"], "--levers", chosen, "--steps", "10",
                     "--budget-s", "900", "--out", str(out), "--no-progress"])
    assert code == 0
    report = json.loads((out / "audit.json").read_text())
    rows = {lever["name"]: lever for lever in report["levers"]}
    # Each of the slow config's levers is found: measured, or (bf16 on a CPU without it) listed with the reason.
    assert rows["bucketing"]["status"] == rows["fused_adamw"]["status"] == "measured"
    assert rows["precision"]["status"] == ("measured" if cpu_device.bf16 else "cannot use")
    # Bucketing on the demo's length mix: random batches pad 2.3x more tokens than bucketed ones.
    assert rows["bucketing"]["speedup"] > 1.0
    assert rows["tf32"]["status"] == "cannot use" and rows["tf32"]["reason"] == "no CUDA device"
    assert rows["compile"]["status"] == "skipped" and rows["compile"]["reason"] == "not among --levers"
    verdict = report["verdict"]
    assert "data.bucketing=true" in verdict["overrides"].split() and 0 < verdict["share_of_best"] < 1
    assert verdict["text"].startswith(f"you are at {verdict['share_of_best']:.0%} of the fastest configuration")
    current = report["current"]
    assert 0 < current["padding_efficiency"] < 1 and current["samples_per_s"] > 0 and current["mfu"] is None
    assert 0 < current["optimizer_share"] < 1 and current["host_syncs_per_step"] > 0
    assert current["peak_memory_gb"] > 0 and current["headroom_gb"] > 0

    # The report's figures agree with the MLflow runs: each measured lever's child run carries its figures, and
    # its training runs, paired with the current config's neighbouring runs, give the same speed-up.
    runs = runs_in(mlflow_store["uri"])
    (parent,) = [r for r in runs if r.data.tags.get("maxout.audit") == "true"]
    assert parent.data.tags["mlflow.note.content"].startswith(f"**Verdict: {verdict['text']}.**")
    assert parent.data.metrics["audit/share_of_best"] == pytest.approx(verdict["share_of_best"])
    logged = {a.path for a in mlflow.MlflowClient(mlflow_store["uri"]).list_artifacts(parent.info.run_id, "audit")}
    assert logged == {"audit/audit.md", "audit/audit.json", "audit/speedup.png", "audit/breakdown.png"}
    assert all((out / png).read_bytes()[:8] == PNG for png in ("speedup.png", "breakdown.png"))
    children = {r.info.run_id: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    trained = sorted((r for r in runs if r.data.tags.get("maxout.command") == "audit-run"),
                     key=lambda r: int(r.data.tags["maxout.audit.position"]))
    speed = [r.data.metrics["perf/steady_samples_per_s"] for r in trained]
    # One warm start for the audit: the breakdown's probe tokenized the two tables, and every run reused them
    assert len(warm_starts) == 1 and warm_starts[0].hits == 2 * len(trained) > 0
    # Every training run of the audit reads the same MLflow datasets: the training split a `maxout train` of this
    # config logs (same name and digest), and the validation split's first rows, a dataset of their own.
    full = prepare.check(loading.load(SLOW, device=cpu_device)).dataset
    expected = {i.context: (i.name, i.digest) for i in lineage.data_inputs(loading.load(SLOW), full)}
    inputs = {tuple(sorted((i.tags[0].value, (i.dataset.name, i.dataset.digest)) for i in r.inputs.dataset_inputs))
              for r in trained}
    assert len(inputs) == 1
    used = dict(next(iter(inputs)))
    assert used["training"] == expected["training"]
    assert used["validation"][0] == expected["validation"][0] and used["validation"][1] != expected["validation"][1]
    assert used["validation"][1].startswith(full.fingerprint)
    assert [r.info.run_id for r in trained] == [r["run_id"] for r in report["runs"]]
    for lever in (r for r in report["levers"] if r["status"] == "measured"):
        child = children[lever["run_id"]]
        assert child.data.metrics["audit/speedup"] == pytest.approx(lever["speedup"])
        assert child.data.params["audit.overrides"] == lever["overrides"]
        mine = [i for i, r in enumerate(trained) if r.data.tags["mlflow.parentRunId"] == lever["run_id"]]
        assert len(mine) == 2 and mine[1] == mine[0] + 1  # current, lever, lever, current
        assert {trained[mine[0] - 1].data.tags["maxout.audit.role"],
                trained[mine[1] + 1].data.tags["maxout.audit.role"]} == {"current"}
        ratios = [speed[mine[0]] / speed[mine[0] - 1], speed[mine[1]] / speed[mine[1] + 1]]
        assert statistics.median(ratios) == pytest.approx(lever["speedup"])
        assert [lever["speedup_after_current"], lever["speedup_before_current"]] == pytest.approx(ratios)
    (current_child,) = [r for r in children.values() if r.data.tags["maxout.audit.role"] == "current"]
    currents = [speed[i] for i, r in enumerate(trained) if r.data.tags["maxout.audit.role"] == "current"]
    assert current["samples_per_s"] == pytest.approx(statistics.median(currents))
    assert current_child.data.metrics["perf/steady_samples_per_s"] == pytest.approx(current["samples_per_s"])
    assert current_child.data.metrics["breakdown/optimizer_share"] == pytest.approx(current["optimizer_share"])
    assert "| bucketing | measured |" in (out / "audit.md").read_text()
    assert "Verdict" in capsys.readouterr().out

    # The recommendation, run afterwards, is faster than the config it started from: paired, both orders, in
    # samples per CPU-second of the steady steps (the machine is shared: other jobs stretch wall time by tens of
    # percent from run to run, CPU time much less). Bucketing alone cuts the processed tokens 2.3x on the demo's
    # length mix; a margin of 1.3x leaves that room to spare and still fails if the recommendation did nothing.
    recommended = [*SLOW, *verdict["overrides"].split()]
    dataset = prepare.check(loading.load(SLOW, device=cpu_device)).dataset
    order = [SLOW, recommended, recommended, SLOW]
    measured = [samples_per_cpu_s(o, cpu_device, dataset) for o in order]
    cpu_ratio = statistics.median([measured[1][0] / measured[0][0], measured[2][0] / measured[3][0]])
    wall_ratio = statistics.median([measured[1][1] / measured[0][1], measured[2][1] / measured[3][1]])
    print(f"recommended vs starting config: {cpu_ratio:.2f}x per CPU-second, {wall_ratio:.2f}x wall")
    assert cpu_ratio > 1.3, (cpu_ratio, wall_ratio)


@pytest.mark.slow
def test_the_budget_stops_the_audit_and_names_the_levers_it_did_not_reach(cpu_device, tmp_path, one_torch_thread):
    budget = audit.MIN_BUDGET_S
    started = time.monotonic()
    report = audit.run_audit([*SLOW, "tracking=none"], budget_s=budget, out_dir=str(tmp_path), steps=5,
                             device=cpu_device, progress=False)
    elapsed = time.monotonic() - started
    unreached = [r for r in report["levers"] if r["status"] == "not reached"]
    assert unreached and report["verdict"]["not_reached"] == [r["name"] for r in unreached]
    assert "compile" in report["verdict"]["not_reached"]  # minutes of compiling never fit a minute's budget
    # Each says why: not started for want of time; or, where load stretched a lever's runs past their estimate,
    # stopped by the budget's timer while it ran, and the levers after it never started
    reasons = ("budget: needs ~", "budget: spent while it ran (estimated ~", "budget: spent before its turn")
    assert all(r["reason"].startswith(reasons) for r in unreached), unreached
    assert unreached[0]["reason"].startswith(reasons[:2])  # the first names what it needed or what stopped it
    # A lever starts only when its estimate (three runs, timed from the runs so far) fits what is left: the audit
    # overruns by at most what one run's estimate missed (set-up and the report come out of the reserve).
    longest = max(run["wall_s"] for run in report["runs"])
    assert elapsed <= budget + longest, (elapsed, longest)
    assert "Not reached within the budget of 60 s" in (tmp_path / "audit.md").read_text()


def test_the_budget_timer_stops_at_the_next_safe_point_not_where_its_signal_lands():
    """Raised wherever SIGALRM landed, BudgetSpent broke torch's state: inside `with FastDropout()` a torch function
    mode was half pushed ("trying to pop from empty mode stack"; every later compile in that process recompiled,
    two test_compile_once tests failed after it), inside torch.save a zip record was half written. The timer only
    asks; the training loop's safe point (a step's end, an evaluation) raises. Nothing stays asked after the block."""
    from maxout import errors

    reached = []
    with pytest.raises(audit.BudgetSpent):
        with audit.budget_timer(0.05):
            busy_until = time.monotonic() + 0.5
            while time.monotonic() < busy_until:  # torch's own code, say: the signal lands here, nothing is raised
                pass
            reached.append("the safe point")
            errors.raise_if_stop_requested()
    assert reached == ["the safe point"]
    with audit.budget_timer(0.05):
        time.sleep(0.2)  # it rang, and the block ended before any safe point
    errors.raise_if_stop_requested()  # withdrawn with the block: nothing later is stopped by it


def test_a_run_still_going_when_the_budget_ends_is_stopped_and_ends_killed(mlflow_store, cpu_device):
    """Estimates can be wrong (a compile on a busy machine): the audit's timer stops whatever runs at the end of
    the budget, and the run is closed, not left RUNNING."""
    cfg = loading.load([*TINY, *mlflow_store["overrides"], "train.max_steps=100000", "train.epochs=1000"],
                       device=cpu_device)
    handler = signal.getsignal(signal.SIGALRM)
    began = time.monotonic()
    with pytest.raises(audit.BudgetSpent):
        tracker = start(cfg.tracking, run_name="long")
        with closing(tracker), audit.budget_timer(3):
            train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
    assert time.monotonic() - began < 60  # stopped, not 100000 steps later
    (run,) = runs_in(mlflow_store["uri"])
    assert run.info.status == "KILLED"
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with pytest.raises(audit.BudgetSpent):  # no time left: not even started
        with audit.budget_timer(0):
            pass
