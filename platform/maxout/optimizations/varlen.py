"""Variable-length attention for packed batches (``data.padding=packed``): each row of a packed micro-batch attends only
to itself through torch's own variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10),
given the rows' boundaries instead of a mask. No [tokens x tokens] mask is built and no work is spent on pairs of
tokens from different rows: attention costs each row's length squared, not the packed row's. It is what transformers'
flash-attention-2 path does with ``DataCollatorWithFlattening``'s ``cu_seq_lens``, without the flash_attn package
(not on the GPU image, and a long CUDA build).

How it plugs in: transformers' attention interface. ``apply()`` registers NAME with ``AttentionInterface`` (``attend``
below) and ``AttentionMaskInterface``, and the model is built with ``attn_implementation=NAME``. BERT-class encoders,
ModernBERT and the decoders (Gemma, Qwen, Llama, Mistral) of transformers 5 call
``ALL_ATTENTION_FUNCTIONS[impl](module, q, k, v, mask, dropout=, scaling=, sliding_window=, **kwargs)`` in every layer
and pass the model's ``**kwargs`` down to it, so a packed forward hands each layer ``cu_seq_lens_q/k`` and
``max_length_q/k`` (PackedLayout.flash_kwargs(), the keys transformers' flash path takes).

- Packed (boundaries given): varlen_attn; causal for decoders (window (-1, 0)); a layer's sliding window w as
  (w - 1, 0) causal or (w - 1, w - 1) bidirectional, as transformers' flash path sets it; grouped-query attention's
  key/value heads passed as they are (``enable_gqa``, torch >= 2.12), or repeated first where varlen_attn has no
  ``enable_gqa`` (torch 2.11). Under autocast the inputs are cast to its dtype (a custom op is not autocast-aware,
  and RoPE in fp32 hands the layer fp32 queries). The longest row is the collator's fixed bound (data.max_length),
  so a compiled graph sees one value, not one per batch.
- Padded (evaluation, serving): the mask interface hands the layer the 2-D padding mask as it is (no host sync, no
  [tokens x tokens] mask per forward), and the layer runs SDPA with the same-row, causal and window mask built from it.
- No kernel (a CPU, fp32, torch < 2.10, a GPU before sm80): the same attention through SDPA with the block-diagonal
  mask built from the boundaries: equal results, no speed-up. That is what runs in the CPU tests
  (tests/test_packing.py), every piece but the kernel the same; the kernel is checked against it on a GPU.

What is lost: attention-probability dropout. varlen_attn has none (its dropout is fixed at 0), so a model's attention
dropout (BERT's attention_probs_dropout_prob, 0.1) is not applied to packed batches in training; the other dropouts
are. The packing decision's reason says so.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

NAME = "maxout_varlen"  # the attn_implementation the model is built with
HALF = (torch.bfloat16, torch.float16)


def kernel_available() -> tuple[bool, str]:
    """Whether this torch has the varlen kernel's Python API."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return False, f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)"
    return True, ""


KERNEL = kernel_available()[0]  # asked once: the attention function runs inside compiled graphs


def kernel_takes_grouped_heads() -> bool:
    """Whether this torch's varlen_attn takes fewer key/value heads than query heads (``enable_gqa``, torch >= 2.12;
    the GPU machine's torch 2.11 has not got it). The flash kernel then reads each key/value head for its group of
    query heads, and its backward sums their gradients itself."""
    if not KERNEL:
        return False
    from torch.nn.attention.varlen import varlen_attn  # lazy: torch >= 2.10 only, as KERNEL says

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


GROUPED_HEADS = kernel_takes_grouped_heads()  # asked once, as KERNEL is


def supported(device: Any, precision: str) -> tuple[bool, str]:
    """The kernel on this device and precision: CUDA, sm80 or newer (flash kernels), bf16 or fp16."""
    ok, why = kernel_available()
    if not ok:
        return ok, why
    if not device.is_cuda:
        return False, "torch's varlen attention runs flash kernels, on CUDA only"
    capability = tuple(device.compute_capability or (0, 0))
    if capability < (8, 0):
        return False, f"torch's varlen flash kernels need compute capability 8.0 or newer, the device has {capability}"
    if precision not in ("bf16", "fp16"):
        return False, f"torch's varlen flash kernels run in bf16/fp16 only; precision is {precision}"
    return True, ""


def model_supported(model_class: type) -> tuple[bool, str]:
    """The model calls transformers' attention interface, and needs nothing the kernel lacks (read from its config
    class's defaults: the decision is made before the model exists)."""
    if not getattr(model_class, "_supports_attention_backend", False):
        return False, f"{model_class.__name__} does not call transformers' attention interface"
    if getattr(model_class.config_class(), "attn_logit_softcapping", None):
        return False, f"{model_class.__name__} soft-caps its attention logits, which torch's varlen kernel cannot"
    return True, ""


def apply() -> str:
    """Register NAME with transformers (idempotent); returns the attn_implementation to build the model with."""
    AttentionInterface.register(NAME, attend)
    AttentionMaskInterface.register(NAME, padding_mask)
    return NAME


def padding_mask(*_args: Any, attention_mask: Optional[torch.Tensor] = None, kv_length: Optional[int] = None,
                 **_kwargs: Any) -> Optional[torch.Tensor]:
    """The mask interface's answer: the 2-D padding mask as given, or None (a packed forward ignores either: the
    boundaries keep its rows apart)."""
    if attention_mask is None or kv_length is None:
        return attention_mask
    return attention_mask[:, -kv_length:]


def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
           sliding_window: Optional[int] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q, k, v are [batch, heads, tokens, head_dim]; returns the output as
    [batch, tokens, heads, head_dim] (and no weights)."""
    causal = kwargs.pop("is_causal", None)
    causal = getattr(module, "is_causal", True) if causal is None else causal
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is not None:  # packed: one row of several samples
        dtype = _half(query, key, value)
        if dtype is not None:  # max_length_q as given: int() would pin a compiled graph to one value
            return _varlen(query, key, value, bounds, kwargs["max_length_q"], scaling, sliding_window, causal,
                           dtype), None
        sample = _sample_of_token(bounds, query.shape[2])[None]
    elif attention_mask is not None and attention_mask.dim() == 4:  # a mask someone prepared: SDPA takes it as is
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=causal, **kwargs)
    elif attention_mask is not None:  # padded: real tokens are sample 0 of their row, padding -1 (never attended)
        sample = attention_mask.to(torch.long) - 1
    elif sliding_window is not None and query.shape[2] > sliding_window:
        sample = torch.zeros(query.shape[0], query.shape[2], dtype=torch.long, device=query.device)
    else:  # whole rows, no padding, no window: plain SDPA (causal for decoders)
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=causal, **kwargs)
    keep = same_sample_mask(sample, causal, sliding_window)
    return sdpa_attention_forward(module, query, key, value, keep[:, None], dropout=dropout, scaling=scaling,
                                  is_causal=False, **kwargs)


attend.varlen_boundaries = True  # serving/pooling.py hands a packed row's boundaries to an implementation marked so


def same_sample_mask(sample: torch.Tensor, causal: bool, sliding_window: Optional[int]) -> torch.Tensor:
    """[batch, tokens, tokens] bool: query i may attend key j. Same sample; causal: j <= i; a window w (transformers'
    meaning: the flash path's (w - 1) tokens either side): |i - j| < w. A padding token (sample -1) attends the other
    padding of its row, so no row of the softmax is empty."""
    position = torch.arange(sample.shape[-1], device=sample.device)
    distance = position[:, None] - position[None, :]
    keep = sample[:, :, None] == sample[:, None, :]
    if causal:
        keep = keep & (distance >= 0)
    if sliding_window is not None:
        keep = keep & (distance.abs() < sliding_window)
    return keep


def _sample_of_token(bounds: torch.Tensor, tokens: int) -> torch.Tensor:
    """[tokens]: the sample each token of a packed row belongs to, from cu_seq_lens."""
    return torch.searchsorted(bounds[1:].to(torch.long), torch.arange(tokens, device=bounds.device), right=True)


def _half(*tensors: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype the kernel runs in here, or None where it cannot run (CPU, no kernel, all fp32). Under autocast the
    projections come out in its dtype, but RoPE multiplies queries and keys by fp32 cos/sin (they follow the fp32
    hidden states), so a decoder's or ModernBERT's q and k arrive in fp32 and v in bf16: the first half dtype wins."""
    if not KERNEL or not tensors[0].is_cuda:
        return None
    return next((t.dtype for t in tensors if t.dtype in HALF), None)


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, longest: Any,
            scaling: Optional[float], sliding_window: Optional[int], causal: bool, dtype: torch.dtype) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn  # lazy: torch >= 2.10, and only where the kernel runs

    q, k, v = (_tokens_first(t).to(dtype).contiguous() for t in (query, key, value))
    grouped = {}
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves q_heads / kv_heads queries
        if GROUPED_HEADS:  # the kernel reads the shared heads: no repeated copy of k and v, no sum in backward
            grouped = {"enable_gqa": True}
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    left = sliding_window - 1 if sliding_window is not None else -1
    # (-1, 0) is causal to varlen_attn (torch 2.11 reads is_causal from exactly that); (w - 1, 0) a causal window
    window = (left, 0) if causal else (left, left)
    bounds = bounds.to(torch.int32)
    out = varlen_attn(q, k, v, bounds, bounds, longest, longest, scale=scaling, window_size=window, **grouped)
    return out.unsqueeze(0)


def _tokens_first(packed: torch.Tensor) -> torch.Tensor:
    """[1, heads, tokens, head_dim] -> [tokens, heads, head_dim] through views alone, so that backward moves no data.
    For BERT's projections (a [1, tokens, heads, head_dim] view, transposed) the result is contiguous; RoPE's outputs
    ([1, heads, tokens, head_dim]) still need the caller's one copy. ``packed[0].transpose(0, 1)`` gave the same
    tensor, but select's backward allocates zeros of the input's size and copies the gradient into them, and the
    transposed copy that follows is another strided copy: per layer, two full-size copies and a fill for each of q,
    k and v. On an H200 (run 7) a strided copy kernel took 8.3% of packed BERT-base's kernel time and none of the
    padded one's, which is what those copies would cost: ~0.4 GB moved per tensor a layer at 56k tokens a step."""
    return packed.transpose(1, 2).flatten(0, 1)
