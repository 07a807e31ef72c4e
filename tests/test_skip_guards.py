"""Skipping dynamo's guards for inputs already seen (issue 37: the host's time a step). A compiled training forward
runs the full guards for each new input signature and skips them for one already seen, while nothing has
recompiled; a run that skips trains exactly as one that does not.

Graphs are dynamo's own, with its eager backend standing in for inductor (as in test_compile_once): the guards are
the same, only the kernels are not generated.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch._dynamo.eval_frame as eval_frame
from torch._dynamo.testing import CompileCounterWithBackend

from maxout import loading
from maxout.optimizations import skip_guards
from maxout.tracking.tracker import NullTracker
from maxout.train import train

from .conftest import TINY


def run(device, *overrides):
    cfg = loading.load([*TINY, "train.max_steps=-1", "train.epochs=2", "train.log_every=4", "hardware.compile=true",
                        "batch_finder.cache=false", "train.batch_size=47", "train.target_effective_batch=47",
                        *overrides], device=device)
    tracker = NullTracker()
    return train(cfg, tracker=tracker, progress=False, device=device, verbose=False), tracker


def test_a_run_runs_the_guards_once_per_input_shape_and_trains_as_one_that_runs_them_always(graphs, cpu_device,
                                                                                            one_torch_thread):
    skipping, skipping_tracker = run(cpu_device)
    guarded, guarded_tracker = run(cpu_device, "hardware.skip_guards=false")
    assert skipping_tracker.params["opt.skip_guards.effective"] == "true"
    assert guarded_tracker.params["opt.skip_guards.effective"] == "false"
    assert isinstance(skipping.setup.forward, skip_guards.GuardSkippingForward)
    assert not isinstance(guarded.setup.forward, skip_guards.GuardSkippingForward)
    # the same losses at every log step, and the same model: the skipped calls ran the graph the guards chose
    assert skipping_tracker.metrics["train/loss"] == guarded_tracker.metrics["train/loss"]
    assert skipping.metrics["eval/accuracy"] == guarded.metrics["eval/accuracy"]
    assert graphs.frame_count == 2  # one graph a run
    # the guards ran once for each (rows, width) the bucket plan holds (1-row remainders run eager), and no more
    setup = skipping.setup
    shapes = set()
    for epoch in (0, 1):
        setup.sampler.set_epoch(epoch)
        shapes |= {(len(b), max(setup.train_loader.dataset.lengths[i] for i in b))
                   for b in setup.sampler.batches() if len(b) > 1}
    assert skipping.metrics["compile/forwards_guarded"] == len(shapes) < 18
    assert skipping.metrics["compile/forwards_guards_skipped"] == 2 * 17 - len(shapes) > 0
    assert "compile/forwards_guarded" not in guarded.metrics


def unsafe_stance() -> bool:
    return eval_frame._stance.skip_guard_eval_unsafe  # read at the call: set_stance replaces the object


def test_the_skipped_calls_run_under_torchs_stance_and_the_rest_do_not():
    stances = []
    forward = skip_guards.GuardSkippingForward(lambda **inputs: stances.append(unsafe_stance()),
                                               torch.nn.Linear(1, 1), graphs=lambda: 1)
    x, y = torch.zeros(2, 3), torch.zeros(2, 4)
    for inputs in ({"input_ids": x}, {"input_ids": x}, {"input_ids": y}, {"input_ids": x}, {"input_ids": y}):
        forward(**inputs)
    assert stances == [False, True, False, True, True]
    assert (forward.guarded, forward.skipped) == (2, 3)
    assert unsafe_stance() is False  # set back after each call
    with torch.no_grad():  # grad mode is part of the signature: the same shapes without it run the guards
        forward(input_ids=x)
    assert stances[-1] is False


def test_a_recompile_ends_the_skipping_for_the_rest_of_the_run():
    count = [1]
    forward = skip_guards.GuardSkippingForward(lambda **inputs: None, torch.nn.Linear(1, 1), graphs=lambda: count[0])
    x, y = torch.zeros(2, 3), torch.zeros(5, 3)
    forward(input_ids=x)
    forward(input_ids=x)
    assert forward.skipped == 1
    count[0] = 2  # a new input compiled a second graph: the differentiating guards alone would choose between two
    forward(input_ids=y)
    assert not forward.active
    for _ in range(3):
        forward(input_ids=x)
    assert (forward.guarded, forward.skipped) == (5, 1)


def test_a_state_no_graph_fits_recompiles_under_the_forward_while_torchs_bare_stance_runs_the_wrong_graph():
    """Why the rule: torch's stance keeps the guards on tensors (a new shape still recompiles, or raises under it) but
    skips those on module state, so with one graph cached a module switched to eval mode runs its training graph,
    dropout and all, without a word. Through the forward the training flag is part of the signature: the full
    guards run, and recompile."""
    class Dropped(torch.nn.Module):
        def forward(self, input_ids):
            return torch.nn.functional.dropout(input_ids, p=0.5, training=self.training)

    ones = torch.ones(64)
    torch._dynamo.reset()
    try:
        module = Dropped().train()
        bare = torch.compile(module, backend="eager")
        assert (bare(input_ids=ones) == 0).any()
        module.eval()
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            assert (bare(input_ids=ones) == 0).any()  # the training graph, in eval mode
        assert bare(input_ids=ones).equal(ones)  # with its guards: the eval graph

        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        module = Dropped().train()
        forward = skip_guards.GuardSkippingForward(torch.compile(module, backend=counter), module)
        forward(input_ids=ones)
        assert (forward(input_ids=ones) == 0).any() and forward.skipped == 1
        module.eval()
        assert forward(input_ids=ones).equal(ones)
        assert counter.frame_count == 2 and not forward.active and forward.skipped == 1
    finally:
        torch._dynamo.reset()


def test_an_input_the_signature_does_not_tell_apart_is_refused_by_torch_and_runs_again_with_the_guards():
    """torch's stance still checks the guards on tensors, which see more than the signature does (here an inference
    tensor's dispatch keys): it refuses to recompile under the stance (a RuntimeError, before anything runs), and the
    forward runs the call again with the full guards, as every later call."""
    torch._dynamo.reset()
    try:
        counter = CompileCounterWithBackend("eager")
        forward = skip_guards.GuardSkippingForward(torch.compile(lambda input_ids: input_ids * 2, backend=counter),
                                                   torch.nn.Linear(1, 1))
        x = torch.ones(3, 4)
        forward(input_ids=x)
        forward(input_ids=x)
        with torch.inference_mode():
            y = torch.ones(3, 4)
        assert skip_guards.signature({"input_ids": y}, forward.module) == skip_guards.signature({"input_ids": x},
                                                                                             forward.module)
        assert forward(input_ids=y).equal(2 * y)
        assert counter.frame_count == 2 and not forward.active and (forward.skipped, forward.guarded) == (1, 2)
    finally:
        torch._dynamo.reset()


def test_inputs_that_are_not_tensors_or_plain_values_always_run_the_guards():
    module = torch.nn.Linear(1, 1)
    assert skip_guards.signature({"input_ids": torch.zeros(2, 3), "labels": None}, module) is not None
    assert skip_guards.signature({"packing": object()}, module) is None
    # masks by layer type (unmasked_causal.py): a mapping's tensors are told apart like the inputs' own, and the
    # mapping falls to the full guards where one of its values is neither
    masks = [{"full_attention": None, "sliding_attention": torch.zeros(2, 1, width, width)} for width in (3, 4)]
    first, second = (skip_guards.signature({"attention_mask": m}, module) for m in masks)
    assert None not in (first, second) and first != second
    assert first == skip_guards.signature({"attention_mask": {**masks[0]}}, module)
    assert skip_guards.signature({"attention_mask": {"full_attention": object()}}, module) is None
    calls = []
    forward = skip_guards.GuardSkippingForward(lambda **inputs: calls.append(inputs), module, graphs=lambda: 1)
    for _ in range(3):
        forward(packing=object())
    assert (forward.guarded, forward.skipped) == (3, 0)


def test_the_decision_needs_compile_one_process_and_padded_batches():
    assert skip_guards.supported(compiled=True, packed=False) == (True, "")
    assert "compile is off" in skip_guards.supported(compiled=False, packed=False)[1]
    assert "packed batches" in skip_guards.supported(compiled=True, packed=True)[1]
    assert "DDP's gradient sync" in skip_guards.supported(compiled=True, packed=False, parallel="ddp")[1]
