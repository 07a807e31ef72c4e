"""Regional compilation (``hardware.compile_scope=layers``): torch.compile the model's repeated blocks (its encoder
or decoder layers) one by one instead of the whole model, so that compiling costs one layer, not the model.

Why: dynamo traces, and inductor fuses and generates kernels for, every op of the graph it is given, so a whole
12-layer encoder is twelve layers' worth of compile work and a 28-layer decoder twenty-eight. A model's layers are
instances of one class, and with their parameters as graph inputs (dynamo's ``inline_inbuilt_nn_modules``, on since
torch 2.5) the graph compiled for the first layer serves every other one: BERT-class encoders and the decoders
(Llama, Mistral, Qwen, Gemma) compile one graph for all their layers, ModernBERT two (its global and its
sliding-window layers). Whole-model compile took 56-71 s a run for BERT-base on the H200 (runs 5-7), paid again by
every HPO trial whose sampled dropout is a new constant in the graph.

What it costs: the rest of the model (embeddings, pooler, head, loss) runs eager; no fusion crosses a layer's
boundary; and each layer is a compiled call of its own (its guards checked, an autograd function for its backward),
host time that a step bound by the host pays. So it is a flag, measured (the ablation's ``compile_scope`` axis, the
GPU report's compiled MFU cases), and the profiles keep whole-model compile.

How: torch's recipe (pytorch.org/tutorials/recipes/regional_compilation.html). accelerate's ``compile_regions`` does
the same and compiles every other leaf module too, each a graph of its own (BERT's embeddings, pooler, dropout and
classifier: four more graphs to compile and guard, for little fused work), so only the blocks here. As for
whole-model compile, the trainer keeps the eager model for what runs eager (one-row batches, evaluation): the compiled
model is a second tree over the same modules and parameters, which only copies the modules on the way to the blocks
(the head, the backbone, the encoder; their ``training`` flag stays the eager model's) and holds the compiled blocks
in its block lists. ``state_dict`` and everything saved come from the eager model, unchanged.

Masks: the eager model hands its layers the attention mask transformers builds, and none for a batch without padding;
a layer graph traced with a mask would compile a second graph for the first such batch, mid-run. Prepared masks
(prepared_mask.py: the model types it covers, SDPA or an encoder's eager attention, every profile's default) give the
layers one for every batch (``always``); elsewhere (a decoder's eager attention, say) that second, one-layer graph is
compiled.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

Block = Callable[[torch.nn.Module], torch.nn.Module]  # torch.compile with the run's mode and backend


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """The names of the model's block lists: each ModuleList of two or more modules of one class (transformers'
    ``encoder.layer``, ``model.layers``), outermost first; a list inside another one's blocks is theirs."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(_inside(name, outer) for outer in found):
            continue
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            found.append(name)
    return found


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` lies below module ``outer`` ("" is the root)."""
    return name != outer and (not outer or name.startswith(f"{outer}."))


def supported(compiled: bool, parallel: str, model: torch.nn.Module | None = None) -> tuple[bool, str]:
    """``compiled``: the compile decision; ``parallel``: the data_parallel decision's value; ``model``: the built model
    (None: not checked yet)."""
    if not compiled:
        return False, "compile is off"
    if parallel != "none":
        return False, (f"data_parallel={parallel} wraps the model's own modules (gradient hooks, FSDP's per-block "
                       "gathers), which a second tree of the blocks would bypass: the whole model is compiled")
    if model is not None and not repeated_blocks(model):
        return False, f"{type(model).__name__} has no list of repeated blocks (a ModuleList of one class) to compile"
    return True, ""


def apply(model: torch.nn.Module, compile_block: Block) -> torch.nn.Module:
    """A module that runs ``model`` with each repeated block replaced by ``compile_block(block)``; ``model`` itself
    is left as it was. Raises ValueError where it has no repeated blocks (``supported`` says so first)."""
    lists = repeated_blocks(model)
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of repeated blocks to compile")
    return _rebuilt(model, "", lists, compile_block)


def _rebuilt(module: torch.nn.Module, name: str, lists: list[str], compile_block: Block) -> torch.nn.Module:
    if name in lists:
        return torch.nn.ModuleList([compile_block(block) for block in module])
    if not any(_inside(found, name) for found in lists):
        return module  # nothing compiled below: the eager module itself
    twin = _twin_class(type(module)).__new__(_twin_class(type(module)))
    twin.__dict__.update(module.__dict__)
    del twin.__dict__["training"]  # read from the eager module (the class's property)
    twin.__dict__["_eager_module"] = module
    # methods bound to the eager module as instance attributes (peft binds some) are bound to the twin instead
    for key, value in module.__dict__.items():
        if getattr(value, "__self__", None) is module and hasattr(value, "__func__"):
            twin.__dict__[key] = value.__func__.__get__(twin)
    twin.__dict__["_modules"] = {key: _rebuilt(child, f"{name}.{key}" if name else key, lists, compile_block)
                                 for key, child in module._modules.items()}
    return twin


def _training(self: torch.nn.Module) -> bool:
    return self.__dict__["_eager_module"].training


def _set_training(self: torch.nn.Module, mode: bool) -> None:
    self.__dict__["_eager_module"].training = mode


@functools.cache
def _twin_class(cls: type) -> type:
    """``cls`` with ``training`` read from (and written to) the eager module the twin copies: ``model.train()`` and
    ``model.eval()`` reach the compiled tree's copies too, which a forward branching on ``self.training`` reads."""
    return type(cls.__name__, (cls,), {"training": property(_training, _set_training), "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})

