"""Causal attention without a padding mask: a decoder's right-padded batch runs SDPA's causal kernel, handed no mask.

Why it is safe: maxout pads every row on the right (data.Collator; modeling.with_pad_token sets the tokenizer's side),
and causal attention already keeps each real token from every token after it, the pads included. A padding mask
changes only what the pads themselves attend to, and no loss reads a pad's output: transformers' head takes each
row's last real token (found from the input ids), maxout's pooling pools by the 2D mask. So the logits and the loss
are the same, and so are the gradients (tests/test_unmasked_causal.py: equal on a CPU, to bf16 on a GPU).

Why it is faster: a mask decides SDPA's kernel. Handed one, SDPA cannot run its flash kernels (nor cuDNN's: they take
``is_causal``, not an arbitrary mask), and transformers expands grouped key/value heads to every query head first
(``repeat_kv``; ``enable_gqa`` only without a mask, ``use_gqa_in_sdpa``): two copies of K and V a layer for
Qwen3-0.6B's 16 query over 8 key/value heads. Handed none, transformers' ``sdpa_attention_forward`` sets
``is_causal``. Compiled, the graph also stops building the 4D mask every step, so a compiled model takes these inputs
too (prepared_mask.MaskPreparer.serves_compiled). Unpadded batches no longer keep a 2D mask that transformers reads
on the host either.

Scope: the decoders whose forward takes a mapping of masks by layer type (Qwen2, Qwen3: ``config.layer_types``).
Their full-attention layers get None; sliding-window layers keep a built mask (a window is more than causal). Llama,
Mistral and Gemma build one mask from the 2D one inside their forward: handed none, they look for packed samples in
the position ids, read on the host (``find_packed_sequence_indices``, a sync a forward), so they keep prepared masks.
SDPA only: eager attention adds the mask it is handed and has no causal flag, flash-attention 2 unpads each batch
from the 2D mask. Not packed batches: their samples need block masks. It works through prepared masks
(prepared_mask.py), which build the other layer types' masks.
"""

from __future__ import annotations

import copy

from ..errors import ConfigError
from .prepared_mask import MaskPreparer

# decoders whose base model takes {layer type: mask} in place of building its masks (Qwen2Model, Qwen3Model)
MODEL_TYPES = ("qwen2", "qwen3")
UNMASKED = frozenset({"full_attention"})  # the layer types handed no mask: causal attention alone


def supported(model_type: str, attention: str, padding: str, prepared: bool) -> tuple[bool, str]:
    """``attention``, ``padding``, ``prepared``: the attention, padding and prepared_mask decisions' effective
    values."""
    if model_type not in MODEL_TYPES:
        return False, (f"model type {model_type!r} is not a decoder that takes its masks by layer type "
                       f"({', '.join(MODEL_TYPES)}); a decoder handed no mask reads its position ids on the host")
    if attention != "sdpa":
        return False, f"attention {attention!r}: only SDPA's kernels take causal attention without a mask"
    if padding == "packed":
        return False, "packed batches keep their samples apart with block masks"
    if not prepared:
        return False, "prepared_mask is off: the masks of the layers that keep one are built through it"
    return True, ""


def apply(preparer: MaskPreparer) -> MaskPreparer:
    """A copy of ``preparer`` (a decoder's, handing a mapping by layer type) that hands the full-attention layers no
    mask, every batch."""
    if not preparer.causal or preparer.single or not UNMASKED <= set(preparer.builders):
        raise ConfigError("hardware.unmasked_causal: the model takes no mapping of masks with full-attention layers "
                          f"(it covers {', '.join(MODEL_TYPES)}); use hardware.unmasked_causal=false")
    unmasked = copy.copy(preparer)
    unmasked.unmasked = UNMASKED
    return unmasked
