"""Prepared attention masks: an eager forward gets the mask its SDPA attention needs already built, so transformers
never reads the batch's padding mask on the host.

Why: before building an encoder's mask, transformers asks whether the batch has any padding at all
(``padding_mask.all()`` in masking_utils' ``_ignore_bidirectional_mask_sdpa``) so that an unpadded batch can run
without one. On a GPU that question is a host sync in every eager forward: the host waits for the device to finish
the previous step before it can launch the next one, and the device idles while the host catches up. On the H200
(2026-11-28, run 7, BERT-base at micro-batch 1024, compile off) bucketed batches made one sync a step where packed
batches, which carry no padding mask, made none, and the bucketed step's device was busy 86% of the time. The
collator already knows the answer on the host (its token counts), so this asks it there instead: a batch without
padding is passed no mask (what transformers would decide), a padded one the very 4D mask transformers would build
(its own ``create_bidirectional_mask``, with the skip that needs the host read turned off), which the model takes
as it is. The model's outputs are unchanged; a compiled forward keeps the 2D mask (dynamo traces the check away,
and a new input layout would compile another graph), so this serves eager runs and a compiled run's eager forwards.

Scope: encoders whose attention mask is transformers' plain bidirectional one (``MODEL_TYPES``), with SDPA
attention, padded batches and the model's own head. ModernBERT's sliding-window layers and the decoders' causal
masks are built differently, per-sample pooling (``model.pooling``) reads the 2D mask itself, packed batches carry
no padding mask, eager attention builds its mask without the host read, and flash-attention 2 unpads each batch
from its lengths on the host anyway.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers.masking_utils import create_bidirectional_mask

from .lora import transformers_model

# Model types whose base model builds its attention mask with create_bidirectional_mask(config, embeddings,
# attention_mask) alone and whose classification head never reads the 2D mask
MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "electra")


def supported(model_type: str, attention: str, padding: str, pooling: Optional[str]) -> tuple[bool, str]:
    """``attention``, ``padding``: the attention and padding decisions' effective values; ``pooling``:
    model.pooling."""
    if padding == "packed":
        return False, "packed batches carry no padding mask: nothing to prepare"
    if attention != "sdpa":
        why = {"eager": "eager attention builds its mask without reading it on the host",
               "flash_attention_2": "flash-attention 2 unpads each batch from its lengths, read on the host anyway"}
        return False, why.get(attention, f"attention {attention!r} is not SDPA")
    if model_type not in MODEL_TYPES:
        return False, (f"model type {model_type!r} builds masks of its own (sliding-window or causal); prepared masks "
                       f"cover the plain bidirectional encoders: {', '.join(MODEL_TYPES)}")
    if pooling:
        return False, f"per-sample pooling (model.pooling={pooling}) reads the batch's 2D mask"
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
    """Turns a batch's model inputs (on the device) into the same inputs with the attention mask prepared; built by
    ``apply`` for one model."""

    def __init__(self, config: Any, dtype: torch.dtype):
        self.config, self.dtype = config, dtype

    def __call__(self, inputs: dict, has_padding: Optional[bool]) -> dict:
        """``inputs`` with its 2D ``attention_mask`` replaced: dropped when ``has_padding`` is False, the 4D mask
        transformers would build when True, left as it is when None (unknown on the host)."""
        mask = inputs.get("attention_mask")
        if mask is None or mask.dim() != 2 or has_padding is None:
            return inputs
        prepared = dict(inputs)
        if not has_padding:
            del prepared["attention_mask"]
            return prepared
        rows, width = mask.shape
        # only its shape, dtype and device are read: the embeddings the model will compute
        embeddings = torch.empty(rows, width, 0, dtype=self.dtype, device=mask.device)
        prepared["attention_mask"] = create_bidirectional_mask(self.config, embeddings, mask,
                                                               allow_is_bidirectional_skip=False)
        return prepared


def apply(model: torch.nn.Module) -> MaskPreparer:
    """A preparer for ``model`` (a transformers classifier, peft-wrapped or not): its config names the attention
    implementation whose mask is built, its embeddings' dtype the mask's (an additive mask's minimum)."""
    base = transformers_model(model)
    return MaskPreparer(base.config, base.get_input_embeddings().weight.dtype)
