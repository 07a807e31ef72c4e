"""A sequence classifier that pools each sample's hidden states itself: last / mean / first token, from a padded
batch or from a packed row, then applies the model's own classification head to the pooled vector.

Why not the model's head: transformers' heads pool once per *row*. A decoder's head reads the rightmost token that
is not the pad id (wrong when pad = eos and a row ends in eos), BERT's pooler reads row 0's first token, and in a
packed row (several samples flattened into one sequence, optimizations/packing.py) every one of them would pool
the whole row. Here the samples are found from the attention mask (padded) or the packing layout (packed), so one
code path pools both, and the head sees one vector per sample.

Keeping packed samples apart is the attention's job; per architecture:
- encoders (BERT, RoBERTa, ELECTRA, ModernBERT) build a bidirectional mask that ignores position ids, so this module
  passes them transformers' own block-diagonal mask (``packed_sequence_mask_function``; one per layer type where the
  model has sliding-window layers).
- decoders (transformers' ``GenericForSequenceClassification``: Gemma, Qwen, Llama, ...) would find packed samples
  from position ids that restart at 0 (``masking_utils``, when no mask and no cache are passed: ``use_cache=False``),
  with a host read of those ids in every forward. So they are handed their causal masks (sliding-window, Gemma 3's
  bidirectional overlays) restricted to each sample the same way, built from the layout.
- flash-attention 2, and an attention function that says it takes the boundaries (``varlen_boundaries``: maxout's
  own over torch's varlen kernel, optimizations/varlen.py): the kernel takes the sample boundaries
  (``cu_seq_lens_q/k``, ``max_length_q/k``) and needs no mask at all. A decoder is handed an all-true 2-D mask
  besides, which the function ignores: without one, transformers' mask code finds packed samples from the position
  ids with a host sync on every forward.

Bins (optimizations/bin_packing.py: rows of a fixed width, several samples each) take their masks the same way, one
block-diagonal mask per row; a bin's free tail is a sample of its own that nothing pools.

Training (packed or padded) and serving (padded) use this same module, so a logged model predicts exactly as it
was trained. Serving wing. May import: errors, serving.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from transformers.masking_utils import (create_bidirectional_mask, create_bidirectional_sliding_window_mask,
                                        create_causal_mask, create_sliding_window_causal_mask,
                                        packed_sequence_mask_function)
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import ConfigError, one_of

POOLINGS = ("last", "mean", "first")  # config.POOLINGS names the same three


def _bert_head(model: Any, pooled: torch.Tensor) -> torch.Tensor:
    # BERT's pooler (dense + tanh) reads token 0 of what it is given: here, the pooled vector.
    return model.classifier(model.dropout(model.bert.pooler(pooled[:, None])))


def _first_token_head(model: Any, pooled: torch.Tensor) -> torch.Tensor:
    return model.classifier(pooled[:, None])  # RoBERTa / ELECTRA heads read token 0 of what they are given


def _modernbert_head(model: Any, pooled: torch.Tensor) -> torch.Tensor:
    return model.classifier(model.drop(model.head(pooled)))


def _decoder_head(model: Any, pooled: torch.Tensor) -> torch.Tensor:
    return model.score(pooled)


# model_type -> (the head applied to one pooled vector per sample, the pooling the model's own head does)
HEADS: dict[str, tuple[Callable, str]] = {
    "bert": (_bert_head, "first"), "roberta": (_first_token_head, "first"),
    "xlm-roberta": (_first_token_head, "first"), "electra": (_first_token_head, "first"),
    "modernbert": (_modernbert_head, "first"),
}


def is_decoder(model_class: type) -> bool:
    """A decoder used as a classifier (transformers' generic head on a causal LM backbone)."""
    return issubclass(model_class, GenericForSequenceClassification)


def supported(model_class: type, model_type: str) -> tuple[bool, str]:
    """Whether this module can pool for the model (it needs the head's pieces by name)."""
    if is_decoder(model_class) or model_type in HEADS:
        return True, ""
    return False, (f"{model_class.__name__} ({model_type}) has no per-sample pooling head in maxout (it has: "
                   f"{', '.join(sorted(HEADS))} and decoders); leave model.pooling null to use its own head")


def check(model_class: type, model_type: str, pooling: Optional[str]) -> None:
    """A one-line error for ``model.pooling`` set on a model this module cannot pool for."""
    ok, reason = supported(model_class, model_type)
    if pooling is not None and not ok:
        raise ConfigError(f"model.pooling={pooling}: {reason}")


def native_pooling(model: Any) -> str:
    """What the model's own head pools: what a packed run with ``model.pooling`` null keeps doing."""
    if is_decoder(type(model)):
        return "last"
    if model.config.model_type == "modernbert":
        return "mean" if model.config.classifier_pooling == "mean" else "first"
    return HEADS[model.config.model_type][1]


def pool(hidden: torch.Tensor, sample_of_token: torch.Tensor, samples: int, kind: str) -> torch.Tensor:
    """One vector per sample from ``hidden`` [tokens, d]; ``sample_of_token`` [tokens] names each token's sample
    (``samples`` for padding, which is pooled into a spare slot and dropped). No host sync: no boolean indexing."""
    position = torch.arange(hidden.shape[0], device=hidden.device)
    if kind in ("first", "last"):
        start = torch.full((samples + 1,), hidden.shape[0] - 1 if kind == "first" else 0, device=hidden.device)
        index = start.scatter_reduce(0, sample_of_token, position, reduce="amin" if kind == "first" else "amax")
        return hidden[index[:samples]]
    if kind == "mean":  # summed in fp32: a bf16 running sum over hundreds of tokens loses digits
        total = torch.zeros(samples + 1, hidden.shape[1], device=hidden.device, dtype=torch.float32)
        total.index_add_(0, sample_of_token, hidden.float())
        # counted by index_add, not bincount: bincount's length depends on the ids' values, a graph break under compile
        count = torch.zeros(samples + 1, device=hidden.device).index_add_(
            0, sample_of_token, torch.ones(hidden.shape[0], device=hidden.device)).clamp(min=1)
        return (total / count[:, None])[:samples].to(hidden.dtype)
    raise ConfigError(f"pooling={one_of(kind, POOLINGS)}")


class PooledClassifier(torch.nn.Module):
    """``model`` (a transformers sequence classifier, peft's adapters inside it or not) with per-sample pooling.

    Called like the model (``input_ids``, ``attention_mask``, ``token_type_ids``, ``labels``) for padded batches,
    or with ``position_ids`` and ``packing`` (a layout with ``cu_seq_lens``, ``seq_idx``, ``max_length`` and
    ``flash_kwargs()``) for a packed row. Returns the model's output type: ``loss`` (cross-entropy) and ``logits``.
    ``backbone_mask``: the attention masks prepared for the backbone (optimizations/prepared_mask.py), passed to it
    in place of ``attention_mask``, which still says which tokens each sample pools.
    """

    def __init__(self, model: Any, pooling: str):
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling={one_of(pooling, POOLINGS)}")
        self.model, self.pooling = model, pooling
        self.decoder = is_decoder(type(model))
        self.head = _decoder_head if self.decoder else HEADS[model.config.model_type][0]
        self.takes_token_types = "token_type_ids" in inspect.signature(model.base_model.forward).parameters
        impl = model.config._attn_implementation or ""
        # the attention takes a packed row's sample boundaries itself (read once: a lookup, not in the traced forward)
        self.varlen = impl.startswith("flash") or getattr(ALL_ATTENTION_FUNCTIONS.get(impl), "varlen_boundaries", False)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def backbone(self) -> torch.nn.Module:  # a property: registered once, as part of ``model``
        return self.model.base_model

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, packing: Any = None,
                backbone_mask: Any = None) -> SequenceClassifierOutput:
        kwargs: dict[str, Any] = {}
        if self.takes_token_types and token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        if self.decoder:
            kwargs["use_cache"] = False  # a cache would also hide packed samples from the mask builder
        if packing is not None:  # a packed row, or bins of several samples each (sample ``samples``: padding)
            samples = packing.samples
            sample_of_token = packing.seq_idx.reshape(-1).long()
            kwargs.update(self._keep_apart(packing, *input_ids.shape), position_ids=position_ids)
        else:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            samples = input_ids.shape[0]
            rows = torch.arange(samples, device=input_ids.device)[:, None].expand_as(input_ids)
            sample_of_token = torch.where(mask.bool(), rows, samples).reshape(-1)
            if self.decoder:  # positions count real tokens only: a left-padded row sees the positions it has alone
                position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
            kwargs.update(attention_mask=attention_mask if backbone_mask is None else backbone_mask,
                          position_ids=position_ids)
        hidden = self.backbone(input_ids=input_ids, **kwargs).last_hidden_state
        pooled = pool(hidden.reshape(-1, hidden.shape[-1]), sample_of_token, samples, self.pooling)
        logits = self.head(self.model, pooled)
        loss = F.cross_entropy(logits.float(), labels.view(-1)) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def _keep_apart(self, packing: Any, rows: int, tokens: int) -> dict[str, Any]:
        """What keeps the samples of a packed row (``rows`` 1), or of each bin (``rows`` bins), from attending to each
        other (see the module docstring)."""
        if self.varlen and hasattr(packing, "flash_kwargs"):  # bins carry no boundaries: they take masks
            if self.decoder and not self.config._attn_implementation.startswith("flash"):
                every_token = torch.ones(1, tokens, dtype=torch.bool, device=packing.seq_idx.device)
                return {**packing.flash_kwargs(), "attention_mask": every_token}
            return packing.flash_kwargs()
        dtype = next(self.backbone.parameters()).dtype
        shape_only = torch.empty(rows, tokens, 0, dtype=dtype, device=packing.seq_idx.device)
        same_sample = packed_sequence_mask_function(packing.seq_idx.reshape(rows, tokens))
        if self.decoder:
            return {"attention_mask": self._causal_masks(shape_only, same_sample)}
        full = create_bidirectional_mask(self.config, shape_only, None, and_mask_function=same_sample)
        if "sliding_attention" not in (getattr(self.config, "layer_types", None) or ()):
            return {"attention_mask": full}
        sliding = create_bidirectional_sliding_window_mask(self.config, shape_only, None,
                                                           and_mask_function=same_sample)
        return {"attention_mask": {"full_attention": full, "sliding_attention": sliding}}

    def _causal_masks(self, shape_only: torch.Tensor, same_sample: Callable) -> Any:
        """A decoder's masks for packed samples, as its forward would build them from the restarting position ids,
        but from the layout: transformers' packed-sequence check (``find_packed_sequence_indices``) reads the
        position ids on the host once per mask it builds, a sync in every eager forward. Within one sample the
        tokens' indices differ as their positions do, so the causal and sliding-window rules on indices, restricted
        to the same sample, are the rules on positions. One tensor, or a mapping by layer type where the config
        lists the types (what the decoders take in place of building their own)."""
        config, window = self.config, getattr(self.config, "sliding_window", None)
        overlay: dict[str, dict] = {"full_attention": {}, "sliding_attention": {}}
        if getattr(config, "use_bidirectional_attention", False):  # Gemma 3's switch: the overlays its forward adds
            overlay = {"full_attention": {"or_mask_function": lambda *_: torch.tensor(True)},
                       "sliding_attention": {"or_mask_function": lambda _b, _h, q, kv: abs(q - kv) < window}}
        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        listed = getattr(config, "layer_types", None)
        kinds = set(listed) if listed else {"full_attention" if window is None else "sliding_attention"}
        masks = {kind: builders[kind](config, shape_only, None, None, and_mask_function=same_sample,
                                      **overlay[kind]) for kind in kinds}
        return masks if listed else masks.popitem()[1]
