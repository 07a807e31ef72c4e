"""Prepared attention masks: an eager forward gets the masks its SDPA attention needs already built, so transformers
does not read the batch's padding mask on the host.

Why: before building a model's mask, transformers asks whether the batch has any padding at all
(``padding_mask.all()`` in masking_utils' ``_ignore_bidirectional_mask_sdpa`` and ``_ignore_causal_mask_sdpa``) so
that an unpadded batch can run without one. On a GPU that question is a host sync in every eager forward: the host
waits for the device to finish the previous step before it can launch the next one, and the device idles while the
host catches up. On the H200 (2026-11-28, run 7, BERT-base at micro-batch 1024, compile off) bucketed batches made
one sync a step where packed batches, which carry no padding mask, made none, and the bucketed step's device was busy
86% of the time. The collator already knows the answer on the host (its token counts), so this asks it there:

- a padded batch is handed the very masks transformers would build, from its own builders (``create_*_mask``) with
  the skip that needs the host read turned off, and the model takes them as they are: one 4D tensor, or a mapping by
  layer type where the model has layers of several kinds (ModernBERT's global and sliding-window layers, Qwen's
  sliding layers where its config has them). Under per-sample pooling (``model.pooling``, serving/pooling.py) the
  masks go to the backbone and the 2D mask still says which tokens each sample pools;
- an unpadded batch: an encoder's is handed no mask, which is what transformers decides after its read, and reads
  nothing. A decoder's keeps its 2D mask and transformers' own reads: without a mask it would read its position ids
  instead (``find_packed_sequence_indices``, once per mask it builds), and a built causal mask would trade the
  ``is_causal`` flash kernel for a masked one, a trade only a GPU can price. With bucketing nearly every batch is
  padded (CUDA pads widths to multiples of 8). Qwen2 and Qwen3, which take their masks by layer type, do better
  (unmasked_causal.py): padded or not, their full-attention layers get no mask at all, and run causal.

The model's outputs are unchanged. A compiled forward keeps the 2D mask (dynamo traces the checks away, and a new
input layout would compile another graph), so this serves eager runs and a compiled run's eager forwards; with
unmasked_causal a compiled model takes the prepared inputs too (the same layout every batch).

Scope (``MODEL_TYPES``): the encoders whose mask is transformers' plain bidirectional one, ModernBERT under
per-sample pooling (its own head may pool by the 2D mask: ``classifier_pooling=mean``, as its checkpoints set), and
the decoders whose layers take transformers' causal or sliding-window causal masks; with SDPA attention and padded
batches; the encoders with eager attention too, whose mask transformers builds from the same check (the CPU profile's
attention: on a GPU its read is a sync as SDPA's is). Eager attention builds a decoder's causal mask without the read,
Gemma 3 overlays masks of its own (its bidirectional switch, which a checkpoint may set), packed batches carry no
padding mask, and flash-attention 2 unpads each batch from its lengths on the host anyway.

An eager mask is additive, in the dtype of the embeddings the model computes: its embeddings' LayerNorm's output
under the forward's autocast (fp32 under autocast's own rules, the autocast dtype where low_precision_layernorm runs
it there): the preparer runs inside the same autocast and builds the mask in that dtype.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from transformers.masking_utils import (create_bidirectional_mask, create_bidirectional_sliding_window_mask,
                                        create_causal_mask, create_sliding_window_causal_mask)

from ..errors import ConfigError
from .lora import transformers_model
from .low_precision_layernorm import LowPrecisionLayerNorm

# Encoders whose base model builds its mask with create_bidirectional_mask(config, embeddings, attention_mask) alone
# and whose classification head never reads the 2D mask
ENCODERS = ("bert", "roberta", "xlm-roberta", "electra")
# ModernBERT: a global and a sliding-window bidirectional mask, taken as a mapping by layer type
SLIDING_ENCODERS = ("modernbert",)
# Decoders (transformers' generic head finds each row's last token from the input ids) whose layers take
# create_causal_mask's or create_sliding_window_causal_mask's mask: one tensor, or a mapping by layer type where the
# config lists the types
DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma")
MODEL_TYPES = ENCODERS + SLIDING_ENCODERS + DECODERS
# what each layer type's mask is built with: transformers' builders, given (config, embeddings, 2D mask), with the
# skip that needs the host read turned off (a causal builder's fourth argument is the cache: none)
BIDIRECTIONAL = {kind: functools.partial(build, allow_is_bidirectional_skip=False) for kind, build in (
    ("full_attention", create_bidirectional_mask), ("sliding_attention", create_bidirectional_sliding_window_mask))}
CAUSAL = {kind: functools.partial(build, past_key_values=None, allow_is_causal_skip=False) for kind, build in (
    ("full_attention", create_causal_mask), ("sliding_attention", create_sliding_window_causal_mask))}


def supported(model_type: str, attention: str, padding: str, pooling: Optional[str]) -> tuple[bool, str]:
    """``attention``, ``padding``: the attention and padding decisions' effective values; ``pooling``:
    model.pooling."""
    if padding == "packed":
        return False, "packed batches carry no padding mask: nothing to prepare"
    if attention == "flash_attention_2":
        return False, "flash-attention 2 unpads each batch from its lengths, read on the host anyway"
    if attention not in ("sdpa", "eager"):
        return False, f"attention {attention!r} is neither SDPA nor eager"
    if attention == "eager" and model_type in DECODERS:
        return False, "eager attention builds a decoder's causal mask without reading it on the host"
    if model_type not in MODEL_TYPES:
        return False, (f"model type {model_type!r} builds or reads its masks its own way; prepared masks cover "
                       f"{', '.join(MODEL_TYPES)}")
    if model_type in SLIDING_ENCODERS and not pooling:
        return False, (f"{model_type}'s own head may pool by the 2D mask (classifier_pooling=mean); with "
                       f"model.pooling set maxout pools, and the masks are prepared")
    return True, ""


def padded(batch: dict) -> Optional[bool]:
    """Whether a collated batch, still in host memory, has padding: from the collator's token counts, else from the
    host copy of its mask (out-of-memory recovery's row chunks carry no counts); None where the mask is on a device
    already (reading it would be the very sync this avoids)."""
    if "num_tokens" in batch:
        return batch["num_real_tokens"] < batch["num_tokens"]
    mask = batch.get("attention_mask")
    if mask is None:
        return False
    if mask.device.type != "cpu":
        return None
    return not mask.numpy().all()  # numpy: a read of host memory, not a tensor op that a sync counter would count


class MaskPreparer:
    """Turns a batch's model inputs (on the device) into the same inputs with the attention masks prepared; built by
    ``apply`` for one model. ``builders``: the builder for each layer type the model has (``BIDIRECTIONAL``,
    ``CAUSAL``); ``single``: the model takes one tensor rather than a mapping by layer type; ``causal``: a decoder's
    (its unpadded batches keep their 2D mask); ``key``: the input the masks go to (``backbone_mask`` under per-sample
    pooling, which keeps the 2D mask); ``always``: unpadded batches get their masks built too (compiled layers:
    ``apply``); ``unmasked``: the layer types handed no mask at all, every batch (unmasked_causal.py: a decoder's
    full-attention layers, which then run SDPA's causal kernel)."""

    def __init__(self, config: Any, dtype: torch.dtype, builders: dict[str, Callable], single: bool = True,
                 causal: bool = False, key: str = "attention_mask", always: bool = False,
                 norm: Optional[torch.nn.Module] = None, unmasked: frozenset = frozenset()):
        self.config, self.dtype, self.builders = config, dtype, builders
        self.single, self.causal, self.key, self.always = single, causal, key, always
        self.norm = norm  # eager attention: the embeddings' LayerNorm, whose output dtype is the additive mask's
        self.unmasked = unmasked

    @property
    def serves_compiled(self) -> bool:
        """Whether a compiled model takes these inputs too: where some layers get no mask, whose SDPA then runs its
        causal kernel; a graph traced with the 2D mask builds a masked one for them (dynamo traces transformers'
        skip away). Every batch gets the same layout, so the graph is traced once."""
        return bool(self.unmasked)

    def mask_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the embeddings the model will compute, which its own builders would read: the weights'
        (torch's LayerNorm hands back its input's dtype on a CPU and fp32 under CUDA autocast, and the embeddings sum
        fp32 weights), or the caller's autocast dtype where the embeddings' LayerNorm is low_precision_layernorm's.
        Asked of the module's type, not by running it: an FSDP-sharded module cannot run outside the forward."""
        if isinstance(self.norm, LowPrecisionLayerNorm) and torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.dtype

    def __call__(self, inputs: dict, has_padding: Optional[bool]) -> dict:
        """``inputs`` with the masks transformers would build when ``has_padding`` is True (or ``always``); when
        False, an encoder's without a mask and a decoder's as they are (the module docstring); as they are when None
        (unknown on the host)."""
        mask = inputs.get("attention_mask")
        if mask is None or mask.dim() != 2:
            return inputs
        if self.unmasked:  # padded or not, known or not: the built masks read nothing, the others are none
            return self._prepared(inputs, mask)
        if has_padding is None:
            return inputs
        if not has_padding and not self.always:
            if self.causal:
                return inputs
            prepared = dict(inputs)
            del prepared["attention_mask"]
            return prepared
        return self._prepared(inputs, mask)

    def _prepared(self, inputs: dict, mask: torch.Tensor) -> dict:
        prepared = dict(inputs)
        rows, width = mask.shape
        # only its shape, dtype and device are read: the embeddings the model will compute
        embeddings = torch.empty(rows, width, 0, dtype=self.mask_dtype(mask.device), device=mask.device)
        built = {kind: None if kind in self.unmasked else build(self.config, embeddings, mask)
                 for kind, build in self.builders.items()}
        prepared[self.key] = next(iter(built.values())) if self.single else built
        return prepared


def apply(model: torch.nn.Module, pooled: bool = False, always: bool = False) -> MaskPreparer:
    """A preparer for ``model`` (a transformers classifier of a type ``supported`` takes, peft-wrapped or not; its
    config names the attention implementation whose masks are built and the layer types they are built for, its
    embeddings' dtype is the masks' (an additive mask's minimum). ``pooled``: the loop calls it through per-sample
    pooling (serving/pooling.py), whose backbone takes the prepared masks as ``backbone_mask``. ``always``: masks for
    unpadded batches too, where the layers are compiled alone (regional_compile.py): a layer graph traced with a mask
    would compile a second graph for the first batch transformers hands no mask (an unpadded one), mid-run."""
    base = transformers_model(model)
    config, dtype = base.config, base.get_input_embeddings().weight.dtype
    key = "backbone_mask" if pooled else "attention_mask"
    norm = _embeddings_norm(base) if config._attn_implementation == "eager" else None
    if config.model_type in ENCODERS:
        return MaskPreparer(config, dtype, {"full_attention": BIDIRECTIONAL["full_attention"]}, key=key, always=always,
                            norm=norm)
    if config.model_type in SLIDING_ENCODERS:  # it builds both whatever its layers are: so does this
        return MaskPreparer(config, dtype, BIDIRECTIONAL, single=False, key=key, always=always, norm=norm)
    listed = getattr(config, "layer_types", None)
    if listed:  # a mapping by type, which these models take in place of building their own
        kinds = sorted(set(listed))
    else:  # one mask for every layer: Mistral slides when its config has a window, the others never do
        kinds = ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"]
    unknown = [kind for kind in kinds if kind not in CAUSAL]
    if unknown:
        raise ConfigError(f"hardware.prepared_mask: {config.model_type} has layers of type {unknown[0]!r}; it builds "
                          f"masks for {', '.join(CAUSAL)}")
    return MaskPreparer(config, dtype, {kind: CAUSAL[kind] for kind in kinds}, single=not listed, causal=True, key=key,
                        always=always)


def _embeddings_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The LayerNorm an encoder's embeddings end with (BERT-class: ``LayerNorm``; ModernBERT: ``norm``)."""
    embeddings = model.base_model.embeddings
    norm = getattr(embeddings, "LayerNorm", None) or getattr(embeddings, "norm", None)
    if not isinstance(norm, torch.nn.LayerNorm):
        raise ConfigError(f"hardware.prepared_mask: {model.config.model_type}'s embeddings end in no LayerNorm, "
                          f"whose dtype an eager mask takes; use hardware.prepared_mask=false")
    return norm
