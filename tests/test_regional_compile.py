"""Regional compilation (``hardware.compile_scope=layers``, issue 37): each layer compiled alone, one graph shared by
every layer of a model, the eager model left as it was. Graphs are counted by dynamo with its eager backend standing in
for inductor (the graphs and guards are the same, only no kernels are generated), on models of more layers than
dynamo's recompile limit (8): a layer whose guards failed would compile a graph of its own, and past the limit run
eager, which the count would show."""

from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.testing import CompileCounterWithBackend

from maxout import loading, modeling
from maxout.optimizations import compile as compile_opt, named, regional_compile
from maxout.tracking.tracker import NullTracker
from maxout.train import train
from maxout.train.distributed import World
from maxout.train.setup import plan_decisions
from transformers import BertForSequenceClassification

from .conftest import TINY

LAYERS = 10  # more than dynamo's recompile limit (8)
GEMMA_TYPES = "[" + ",".join(["sliding_attention", "full_attention"] * (LAYERS // 2)) + "]"


@pytest.fixture
def counter():
    torch._dynamo.reset()
    yield CompileCounterWithBackend("eager")
    torch._dynamo.reset()


def tiny_model(group: str, *overrides: str) -> torch.nn.Module:
    cfg = loading.load(["hardware=cpu", f"model={group}", "model.tokenizer=bundled",
                        f"model.architecture.num_hidden_layers={LAYERS}", *overrides])
    tokenizer = modeling.load_tokenizer(cfg.model)
    config = modeling.build_config(cfg.model, ["a", "b", "c"], len(tokenizer), tokenizer.pad_token_id)
    torch.manual_seed(0)
    return modeling.load_model(cfg.model, config, "sdpa").train()


def batch(width: int, pad: int = 3) -> dict:
    generator = torch.Generator().manual_seed(width)
    ids = torch.randint(1000, 2000, (4, width), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, width - pad:] = 0  # one padded row
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 0])}


def step(model, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward from a fixed seed (dropout's masks): the logits and the gradients."""
    torch.manual_seed(1)
    out = model(**inputs)
    grads = torch.autograd.grad(out.loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return out.logits.detach(), grads


# BERT-class encoders and the decoders (use_cache=False, as maxout builds them: a KV cache's per-layer state was a guard
# per layer) share one graph; ModernBERT has two kinds of layer (global and sliding-window attention), and ELECTRA's
# first layer takes a view where its embeddings are projected
@pytest.mark.parametrize("group, overrides, graphs", [
    ("tiny", [], 1),
    ("tiny", ["+model.architecture.model_type=roberta"], 1),
    ("tiny", ["+model.architecture.model_type=electra", "+model.architecture.embedding_size=32"], 1),
    # ELECTRA-small's shape (embeddings narrower than the layers): the first layer's input is a view of the
    # projection's output, and dynamo guards on a view's base
    ("tiny", ["+model.architecture.model_type=electra", "+model.architecture.embedding_size=16"], 2),
    ("tiny_modernbert", [], 2),
    ("tiny_qwen3", [], 1),
    ("tiny_qwen3", ["model.architecture.model_type=llama", "~model.architecture.head_dim"], 1),
    ("tiny_qwen3", ["model.architecture.model_type=mistral", "~model.architecture.head_dim",
                    "+model.architecture.sliding_window=8"], 1),
    ("tiny_gemma", [f"model.architecture.layer_types={GEMMA_TYPES}"], 1),
], ids=["bert", "roberta", "electra", "electra_projected", "modernbert", "qwen3", "llama", "mistral", "gemma3"])
def test_every_layer_runs_one_shared_graph_and_computes_what_the_eager_model_does(group, overrides, graphs,
                                                                                   counter, one_torch_thread):
    model = tiny_model(group, *overrides)
    compiled = compile_opt.apply(model, "default", dynamic=True, backend=counter, scope="layers")
    blocks = [m for m in compiled.modules() if isinstance(m, OptimizedModule)]
    assert len(blocks) == LAYERS
    for width in (24, 32):  # two padded widths: symbolic, no recompile
        eager_logits, eager_grads = step(model, batch(width))
        logits, grads = step(compiled, batch(width))
        assert torch.equal(logits, eager_logits)
        assert all(g is None and e is None or torch.equal(g, e) for g, e in zip(grads, eager_grads))
    assert counter.frame_count == graphs


def test_the_eager_model_is_left_as_it_was_and_shares_its_parameters_and_training_flag(counter):
    model = tiny_model("tiny")
    keys = list(model.state_dict())
    compiled = compile_opt.apply(model, "default", dynamic=True, backend=counter, scope="layers")
    assert not any(isinstance(m, OptimizedModule) for m in model.modules())  # the eager model compiles nothing
    assert list(model.state_dict()) == keys  # what is saved
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in model.parameters()}
    assert isinstance(compiled, BertForSequenceClassification)  # transformers' own checks still hold
    # only the modules on the way to the blocks are copied; their training flag is the eager module's
    assert compiled is not model and compiled.bert is not model.bert
    assert compiled.bert.embeddings is model.bert.embeddings
    model.eval()
    assert compiled.training is False and compiled.bert.encoder.training is False
    compiled.train()
    assert model.training is True and model.bert.encoder.training is True


def test_a_model_without_repeated_blocks_is_refused_with_the_reason():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert regional_compile.repeated_blocks(mlp) == []
    assert regional_compile.supported(True, "none", mlp) == (
        False, "Sequential has no list of repeated blocks (a ModuleList of one class) to compile")
    with pytest.raises(ValueError, match="no list of repeated blocks"):
        regional_compile.apply(mlp, torch.compile)
    nested = torch.nn.ModuleList([torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
                                  for _ in range(2)])
    assert regional_compile.repeated_blocks(nested) == [""]  # the outer list; the lists inside are its blocks'


@pytest.mark.parametrize("overrides, world, effective, reason", [
    (["hardware.compile_scope=layers"], None, "model", "compile is off"),
    (["hardware.compile_scope=layers", "hardware.compile=true"], None, "layers", ""),
    (["hardware.compile_scope=layers", "hardware.compile=true"], World(size=2, local_size=2, backend="gloo"),
     "model", "data_parallel=ddp wraps the model's own modules"),
])
def test_the_decision(overrides, world, effective, reason, cpu_device):
    cfg = loading.load(["hardware=cpu", "model=tiny", *overrides], device=cpu_device)
    decision = named(plan_decisions(cfg, cpu_device, BertForSequenceClassification, world or World()),
                     "compile_scope")
    assert decision.effective == effective and decision.reason.startswith(reason)


def test_a_run_compiles_its_layers_once_over_two_epochs_and_learns_what_whole_model_compile_learns(
        cpu_device, one_torch_thread, monkeypatch):
    """The run's own path (setup, the loop, evaluation eager): one graph over two epochs of the demo's bucket plan
    (batches of 47: each epoch ends with a one-row batch, which runs eager), and with dynamo's eager backend the very
    losses whole-model compile gives."""
    counter = CompileCounterWithBackend("eager")
    monkeypatch.setattr(compile_opt, "apply", functools.partial(compile_opt.apply, backend=counter))
    losses, graphs = {}, {}
    for scope in ("layers", "model"):
        torch._dynamo.reset()
        counter.frame_count = 0
        cfg = loading.load([*TINY, "train.max_steps=-1", "train.epochs=2", "train.log_every=6",
                            "hardware.compile=true", f"hardware.compile_scope={scope}", "train.batch_size=47",
                            "train.target_effective_batch=47", "hardware.attn_implementation=sdpa"],
                           device=cpu_device)
        tracker = NullTracker()
        result = train(cfg, tracker=tracker, progress=False, device=cpu_device, verbose=False)
        assert tracker.params["opt.compile_scope.effective"] == scope
        losses[scope] = [value for _, value in tracker.metrics["train/loss"]]
        graphs[scope] = (counter.frame_count, result.metrics["time/compile_graphs"])
    torch._dynamo.reset()
    assert graphs == {"layers": (1, 1), "model": (1, 1)}
    assert len(losses["layers"]) == 6 and losses["layers"] == losses["model"]


@pytest.mark.parametrize("prepared, graphs", [(True, 1), (False, 2)])
def test_unpadded_batches_reach_the_layers_with_a_mask_so_they_compile_no_second_graph(prepared, graphs, cpu_device,
                                                                                      one_torch_thread, monkeypatch):
    """Batches of 4 bucketed demo rows: some have rows of one length, no padding, and transformers hands the layers
    no mask for them. Compiled layers traced with a mask then compiled a second graph mid-run (dynamo: "expected
    type of 'args[1]' to be a tensor type, but found NoneType"); prepared masks hand them one for every batch."""
    counter = CompileCounterWithBackend("eager")
    monkeypatch.setattr(compile_opt, "apply", functools.partial(compile_opt.apply, backend=counter))
    torch._dynamo.reset()
    cfg = loading.load([*TINY, "train.max_steps=60", "hardware.compile=true", "hardware.compile_scope=layers",
                        "train.batch_size=4", "train.target_effective_batch=4", "hardware.attn_implementation=sdpa",
                        f"hardware.prepared_mask={str(prepared).lower()}"], device=cpu_device)
    result = train(cfg, tracker=NullTracker(), progress=False, device=cpu_device, verbose=False)
    torch._dynamo.reset()
    sampler, lengths = result.setup.sampler, result.setup.train_loader.dataset.lengths
    sampler.set_epoch(0)
    unpadded = [b for b in sampler.batches()[:60] if len({lengths[i] for i in b}) == 1]
    assert unpadded  # the plan really holds batches without padding
    assert counter.frame_count == graphs
