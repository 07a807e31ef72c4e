"""Compile once per run (issue 37): a run compiles one graph over all its epochs, and the batch finder none; with
symbolic shapes inductor is kept from guarding on the batch size (checked on a GPU).

Graphs are counted by dynamo itself, with its eager backend standing in for inductor (the graphs dynamo captures
and its guards are the same; only the kernels are not generated), on the tiny model and the demo's real bucket
plan. Before the fix a run made 2 graphs (BERT writes config.problem_type on its first forward, and the guard on
it recompiled), and a 1-row batch (an epoch's remainder) made one more; so did a packed batch of one sample.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from maxout import loading
from maxout.optimizations import compile as compile_opt
from maxout.tracking.tracker import NullTracker
from maxout.train import train

from .conftest import TINY


def run(device, *overrides):
    cfg = loading.load([*TINY, "train.max_steps=-1", "train.epochs=2", "train.log_every=10", "hardware.compile=true",
                        "batch_finder.cache=false", *overrides], device=device)
    tracker = NullTracker()
    return train(cfg, tracker=tracker, progress=False, device=device, verbose=False), tracker


def test_two_epochs_of_the_bucket_plan_compile_one_graph(graphs, cpu_device, one_torch_thread):
    # 800 training rows in batches of 47: each epoch ends with a 1-row batch, which dynamo would specialize
    result, _ = run(cpu_device, "train.batch_size=47", "train.target_effective_batch=47")
    sampler = result.setup.sampler
    sizes = {len(batch) for epoch in (0, 1) for batch in _batches(sampler, epoch)}
    assert sizes == {47, 1}  # the plan really holds the full batches and the 1-row remainder
    assert len({batch_width(result.setup, b) for b in _batches(sampler, 0)}) > 3  # and many padded widths
    assert result.metrics["train/optimizer_steps"] == 2 * 18
    assert graphs.frame_count == 1
    assert result.metrics["time/compile_graphs"] == 1  # what every run logs: dynamo's own count, here the same


def test_the_batch_finder_compiles_nothing_and_the_run_one_graph(graphs, cpu_device, one_torch_thread):
    result, tracker = run(cpu_device, "train.batch_size=auto", "train.target_effective_batch=32")
    assert int(tracker.params["batch_finder.num_probes"]) >= 2  # the finder really probed
    assert tracker.params["opt.compile.effective"] == "true"
    assert graphs.frame_count == 1 and result.metrics["time/compile_graphs"] == 1


def test_packed_batches_compile_one_graph_and_a_one_sample_batch_runs_eager(graphs, cpu_device, one_torch_thread):
    # a token budget of 512 tokens: the second epoch ends with a batch of one sample, whose labels dynamo would
    # specialize (before: a second graph, "2 <= labels.size()[0]")
    result, _ = run(cpu_device, "data.padding=packed", "data.max_tokens_per_batch=512", "train.batch_size=8")
    assert result.setup.packed
    samples = [len(batch) for epoch in (0, 1) for batch in _batches(result.setup.sampler, epoch)]
    assert samples.count(1) == 1 and len(set(samples)) > 3  # the plan really holds one, among packed batches
    assert graphs.frame_count == 1 and result.metrics["time/compile_graphs"] == 1


def test_every_run_in_a_process_compiles_its_own_model(graphs, cpu_device, one_torch_thread):
    """Runs that differ in a constant dynamo guards (an HPO trial's dropout) each added an entry to one dynamo cache,
    keyed on the forward's code that every run's model shares: at dynamo's recompile limit (8; 2 here) the next run
    ran eager while it logged compile on (before: the third run here made 0 graphs). Each compile now starts from an
    empty cache: one graph a run."""
    with torch._dynamo.config.patch(recompile_limit=2):  # the config's own patch (monkeypatch deletes its keys)
        made = [run(cpu_device, "train.epochs=1", "train.max_steps=2", f"model.dropout={p}")[0].metrics[
            "time/compile_graphs"] for p in (0.1, 0.2, 0.3)]
    assert made == [1, 1, 1] and graphs.frame_count == 3


def flash_math_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                       window_size=None, *_rest):
    """torch_attn::_varlen_attn's result, as its flash kernel defines it, in fp32 on a CPU: (out, lse, rng state)."""
    scores, scale = _scores(query, key, cu_seq_q, window_size, scale)
    lse = scores.logsumexp(-1)  # [heads, tokens]
    out = torch.einsum("hts,shd->thd", (scores - lse[..., None]).exp(), value.float())
    # contiguous, as the flash kernel's outputs are and the op's fake kernel says (empty_like): the graph views them
    return out.to(query.dtype).contiguous(), lse.contiguous(), torch.zeros(2, dtype=torch.uint64)


def flash_math_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                        scale=None, window_size=None, *_rest):
    """torch_attn::_varlen_attn_backward's (dq, dk, dv): softmax attention's gradients, from the saved lse."""
    scores, scale = _scores(query, key, cu_seq_q, window_size, scale)
    probs = (scores - lse[..., None]).exp()
    grad_out = grad_out.float()
    d_value = torch.einsum("hts,thd->shd", probs, grad_out)
    d_probs = torch.einsum("thd,shd->hts", grad_out, value.float())
    d_scores = probs * (d_probs - (grad_out * out.float()).sum(-1).T[..., None])
    d_query = torch.einsum("hts,shd->thd", d_scores, key.float()) * scale
    d_key = torch.einsum("hts,thd->shd", d_scores, query.float()) * scale
    return tuple(grad.to(t.dtype).contiguous() for grad, t in ((d_query, query), (d_key, key), (d_value, value)))


def _scores(query, key, bounds, window_size, scale):
    """[heads, tokens, tokens] scaled scores, -inf where query i may not attend key j: another row of the pack, or
    outside the window (left, right; -1: no limit; (-1, 0) is causal)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    position = torch.arange(query.shape[0])
    row = torch.searchsorted(bounds[1:].long(), position, right=True)
    ahead = position[None, :] - position[:, None]  # j - i
    left, right = window_size or (-1, -1)
    keep = (row[:, None] == row[None, :]) & ((ahead >= -left) | (left < 0)) & ((ahead <= right) | (right < 0))
    scores = torch.einsum("thd,shd->hts", query.float(), key.float()) * scale
    return scores.masked_fill(~keep, float("-inf")), scale


@functools.cache
def flash_math_on_the_cpu():
    """CPU kernels for torch's varlen custom ops (theirs are CUDA's flash kernels), registered once for the process:
    maxout never hands them CPU tensors (varlen._half keeps a CPU forward off the kernel branch), so only a test that
    forces that branch reaches them."""
    from torch.nn.attention import varlen as torch_varlen

    torch_varlen._varlen_attn.register_kernel("cpu", flash_math_forward)
    torch_varlen._varlen_attn_backward.register_kernel("cpu", flash_math_backward)


# The packed path a GPU runs, through torch's own varlen custom op (its fake kernels, its autograd formula, the rows'
# boundaries and the longest row as dynamo sees them), with aot_eager tracing forward and backward as inductor's AOT
# autograd does. Packed batches hold different numbers of samples (boundaries of another length every step) and
# tokens; only the kernels are stand-ins. Run 7 never finished the compiled packed GPU test (cut at call 2's limit).
# aot_eager also runs the pass that turns float inputs into tensors, whose failure restarts dynamo's analysis: a
# second backend call for the same graph (before compile.constant_floats: 2 calls, then 1).
@pytest.mark.parametrize("scope", ["model", "layers"])  # the whole model, or its layers alone (call 3 measures both)
def test_packed_batches_through_torchs_varlen_op_compile_one_graph(scope, cpu_device, one_torch_thread, monkeypatch):
    from maxout.optimizations import varlen

    flash_math_on_the_cpu()
    monkeypatch.setattr(varlen, "supported", lambda device, precision: (True, ""))  # the packing decision: varlen
    monkeypatch.setattr(varlen, "_half", lambda *tensors: torch.float32)  # the kernel's branch, in fp32 here
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compile_opt, "apply", functools.partial(compile_opt.apply, backend=counter))
    torch._dynamo.reset()
    try:
        result, tracker = run(cpu_device, "data.padding=packed", "data.max_tokens_per_batch=512", "train.batch_size=8",
                              "train.epochs=1", f"hardware.compile_scope={scope}")
    finally:
        torch._dynamo.reset()
    assert tracker.params["opt.packing.effective"] == "varlen" and result.setup.packed
    assert tracker.params["opt.compile_scope.effective"] == scope
    samples = {len(batch) for batch in _batches(result.setup.sampler, 0)}
    assert len(samples) > 3  # boundaries of several lengths
    assert counter.frame_count == 1 and result.metrics["time/compile_graphs"] == 1
    losses = [value for _, value in tracker.metrics["train/loss"]]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def _batches(sampler, epoch):
    sampler.set_epoch(epoch)
    return sampler.batches()


def batch_width(setup, rows):
    return max(setup.train_loader.dataset.lengths[i] for i in rows)


def test_with_symbolic_shapes_inductor_is_kept_from_guarding_on_the_batch_size(monkeypatch):
    """compile.apply turns inductor's size checks for fusing a LayerNorm backward's reductions, and its shape
    padding, off for dynamic shapes (each is a guard on the batch's size, and a recompile for the first batch across
    it), and leaves them on for static shapes, where they are decided once without a guard."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.triton, "mix_order_reduction_non_strict_mode", False)
    monkeypatch.setattr(inductor_config, "shape_padding", True)
    monkeypatch.delenv("TORCHINDUCTOR_SHAPE_PADDING", raising=False)
    compile_opt.apply(torch.nn.Linear(2, 2), "default", dynamic=True)
    assert inductor_config.triton.mix_order_reduction_non_strict_mode is True
    assert inductor_config.shape_padding is False  # its compute-bound check guards on the rows (torch 2.11)
    compile_opt.apply(torch.nn.Linear(2, 2), "default", dynamic=None)
    assert inductor_config.triton.mix_order_reduction_non_strict_mode is False
    assert inductor_config.shape_padding is True
    monkeypatch.setenv("TORCHINDUCTOR_SHAPE_PADDING", "0")  # a user's own switch stays off
    compile_opt.apply(torch.nn.Linear(2, 2), "default", dynamic=None)
    assert inductor_config.shape_padding is False


@pytest.mark.gpu
@pytest.mark.parametrize("guarded", [False, True])
def test_on_a_gpu_a_layernorm_backward_compiles_once_across_the_size_thresholds(guarded, monkeypatch):
    """The pattern behind the guards: a LayerNorm forward and backward on [rows, 768] with rows symbolic, called at
    1,024 rows and then at 16,384 (across rows >= 4096 and rows x 768 >= 5 x 2**20). Through compile.apply: one graph.
    With the size checks left on (``guarded``), the count is printed, not asserted: it says whether this torch
    version's Triton code generation guards there at all."""
    import torch._inductor.config as inductor_config

    norm = torch.nn.LayerNorm(768).cuda()
    step = compile_opt.apply(lambda x: norm(x).float().square().mean(), "default", dynamic=True)
    if guarded:
        monkeypatch.setattr(inductor_config.triton, "mix_order_reduction_non_strict_mode", False)
    graphs = graphs_over(step, (1024, 16384, 2048), torch.float32)  # fp32: as autocast runs LayerNorm
    print(f"graphs with the size checks {'on' if guarded else 'off'}: {graphs}")
    if not guarded:
        assert graphs == 1


def graphs_over(step, rows: tuple, dtype) -> int:
    """Graphs dynamo compiles for ``step`` run forward and backward on [n, 768] inputs for each n of ``rows``."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for n in rows:
        step(torch.randn(n, 768, device="cuda", dtype=dtype, requires_grad=True)).backward()
    graphs = counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    return graphs


@pytest.mark.gpu
@pytest.mark.parametrize("guarded", [False, True])
def test_on_a_gpu_a_partial_last_batch_reuses_the_graph_of_full_ones(guarded, monkeypatch):
    """The H200's second graph at micro-batch 1024 (2026-11-27): BERT's pooler, a bf16 [batch, 768] x [768, 768]
    matmul, at 1,024 rows and then at an epoch's partial last batch of 512, across shape padding's compute-bound
    guard (``769 <= batch`` there). Through compile.apply: one graph. With shape padding left on (``guarded``) the
    count is printed, not asserted: it says whether this torch version guards there."""
    import torch._inductor.config as inductor_config

    pooler = torch.nn.Linear(768, 768).cuda().to(torch.bfloat16)
    step = compile_opt.apply(lambda x: torch.tanh(pooler(x)).float().square().mean(), "default", dynamic=True)
    if guarded:
        monkeypatch.setattr(inductor_config, "shape_padding", True)
    graphs = graphs_over(step, (1024, 512, 2048), torch.bfloat16)
    print(f"graphs with shape padding {'on' if guarded else 'off'}: {graphs}")
    if not guarded:
        assert graphs == 1
