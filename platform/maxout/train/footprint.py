"""The model a config describes, checked before any weight is allocated (prepare.py runs this before a run exists):
whether the libraries take its free-form values, and whether the machine can hold it.

``model.architecture`` goes to transformers' config class and ``model.lora_*`` to peft. Their own checks judge
the values, and each refusal becomes one line naming the maxout key and its value (``modeling.blame``). Two things
those checks do not see:

- Size. ``num_hidden_layers=2147483648`` is a valid int, and transformers builds layers until the machine runs out
  of memory. The model is built on the meta device (shapes only, no memory), with at most two layers where it
  asks for more: a layer's parameters do not depend on how many layers there are, so two builds give the rest by
  extrapolation, in milliseconds. Training holds the weights and, for what it trains, a gradient and AdamW's two
  moments (each in the parameter's dtype): at least 4x the weights' bytes for a full fine-tune, 1x with an adapter
  or a frozen encoder (activations come on top; the batch finder sizes those). More than the device's memory (the
  GPU's, else the host's) is refused, naming the key that makes it so.
- The first forward. Some values pass the config and the build and fail only there (``type_vocab_size=0``
  indexes an empty table, ``initializer_range=-1`` fails the real initialisation, a ``chunk_size_feed_forward``
  that does not divide the width). For source=config a one-layer copy is built for real on the CPU and runs a
  forward pass at widths 7 and 8: coprime, so a chunk size other than 1 cannot divide both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from transformers import AutoModelForSequenceClassification

from .. import modeling
from ..config import Config, ModelConfig
from ..errors import ConfigError
from ..optimizations import freeze, lora
from .distributed import env_world_size

LAYERS = "num_hidden_layers"  # transformers' name for the layer count (attribute_map aliases such as n_layer too)
PROBE_LAYERS = (1, 2)
SMOKE_WIDTHS = (7, 8)
# The adapter's settings: peft's refusal names one of them, or it is found by resetting each to its default.
ADAPTER_KEYS = ("adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
_DEFAULTS = ModelConfig()


@dataclass(frozen=True)
class Footprint:
    """What the model's parameters hold: counted on the meta device, or extrapolated from two such counts."""

    params: int
    weight_bytes: int
    trainable_bytes: int

    def training_bytes(self) -> int:
        """Weights, plus a gradient and AdamW's two moments per trained parameter (same dtype as the parameter)."""
        return self.weight_bytes + 3 * self.trainable_bytes

    def extrapolated(self, other: "Footprint", layers: int) -> "Footprint":
        """From the counts at one layer (self) and two (other): the model with ``layers`` layers."""
        return Footprint(*(a + (layers - 1) * (b - a) for a, b in zip(dataclasses.astuple(self),
                                                                        dataclasses.astuple(other))))


class _Overflow(Exception):
    """A tensor too large for torch to even describe (its byte count overflows int64)."""


def check(cfg: Config, tokenizer: Any, device: Any) -> Footprint:
    """The footprint of ``cfg``'s model, refused (ConfigError naming the key) where a library refuses a value or
    training it needs more than ``device``'s memory (under FSDP, each rank's share of it). smoke() runs the
    one-layer forward after the checks that build on this one."""
    mc = cfg.model
    found = estimate(mc, tokenizer)
    memory = device_memory(device)
    shards = env_world_size() if cfg.distributed.strategy == "fsdp" else 1  # FSDP splits the state over ranks
    if memory and (found is None or found.training_bytes() / shards > memory):
        raise _too_big(cfg, tokenizer, found, memory / shards, device)
    return found


def device_memory(device: Any) -> float:
    """Bytes of memory the model's training state must fit in: the GPU's, else the host's (0: unknown)."""
    return (device.total_memory_gb if device.is_cuda else device.host_memory_gb) * 2**30


def layer_key(mc: ModelConfig) -> Optional[str]:
    """The model.architecture key that counts layers (num_hidden_layers, or an alias such as GPT-2's n_layer)."""
    if mc.source != "config":
        return None
    aliases = getattr(modeling.config_class(mc), "attribute_map", {}) or {}
    return next((k for k in mc.architecture if k == LAYERS or aliases.get(k) == LAYERS), None)


def many_layers(mc: ModelConfig, above: int) -> tuple[Optional[str], Optional[int]]:
    """(the layer key, its count) where model.architecture asks for more than ``above`` layers, else (None, None)."""
    key = layer_key(mc)
    count = mc.architecture.get(key) if key else None
    if isinstance(count, int) and not isinstance(count, bool) and count > above:
        return key, count
    return None, None


def with_layers(mc: ModelConfig, key: str, count: int, layers: int) -> ModelConfig:
    """``mc`` with ``count`` layers instead of ``layers``; per-layer lists (layer_types) shrink with them."""
    arch = {k: (v[:count] if isinstance(v, list) and len(v) == layers else v) for k, v in mc.architecture.items()}
    arch[key] = count
    return dataclasses.replace(mc, architecture=arch)


def estimate(mc: ModelConfig, tokenizer: Any) -> Optional[Footprint]:
    """The footprint of ``mc``'s model (None: too large for torch to count), without allocating it."""
    key, layers = many_layers(mc, PROBE_LAYERS[-1])
    try:
        if key is None:
            return _measure(mc, tokenizer)
        probes = []
        for count in PROBE_LAYERS:
            try:
                probes.append(_measure(with_layers(mc, key, count, layers), tokenizer))
            except ConfigError as err:  # refused with fewer layers: say which, beside the user's own count
                raise ConfigError(f"model.architecture.{key}={layers!r} (counted with {count} layer(s), how maxout "
                                  f"sizes a model without building it): {err}") from None
        return probes[0].extrapolated(probes[1], layers)
    except _Overflow:
        return None


def _measure(mc: ModelConfig, tokenizer: Any) -> Footprint:
    model = _on_meta(mc, tokenizer)
    if mc.adapter != "none":
        model = _with_adapter(mc, model, tokenizer)
    elif mc.freeze_encoder and freeze.supported(model)[0]:
        freeze.apply(model)
    params = list(model.parameters())
    return Footprint(sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
                     sum(p.numel() * p.element_size() for p in params if p.requires_grad))


def _on_meta(mc: ModelConfig, tokenizer: Any) -> torch.nn.Module:
    """The model on the meta device: its shapes and dtypes, no memory. A build that transformers refuses names the
    model.architecture keys behind it (source=config; a pretrained model's own config builds)."""
    config = _config(mc, tokenizer)
    try:
        return _meta_build(config)
    except RuntimeError as err:
        if "overflow" in str(err).lower():  # "Storage size calculation overflowed": more bytes than int64 holds
            raise _Overflow() from None
        if mc.source != "config":
            raise
        failure: BaseException = err
    except Exception as err:  # the architecture's values are the user's: whatever the build raises is about them
        if mc.source != "config":
            raise
        failure = err
    raise _architecture_error(mc, failure, lambda sub: _meta_build(_config(sub, tokenizer)), "building the model")


def _meta_build(config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")


def _config(mc: ModelConfig, tokenizer: Any) -> Any:
    return modeling.build_config(mc, ["0", "1"], len(tokenizer), tokenizer.pad_token_id)


def _architecture_error(mc: ModelConfig, err: BaseException, attempt: Callable[[ModelConfig], Any], what: str
                        ) -> ConfigError:
    """modeling.architecture_error for a failure of ``attempt(mc)``: the user's keys and values, each tried
    without the others' faults by resetting it to the library's default."""
    fields = {k: v for k, v in mc.architecture.items() if k != "model_type"}
    kept = {k: v for k, v in mc.architecture.items() if k == "model_type"}
    return modeling.architecture_error(
        fields, err, lambda sub: attempt(dataclasses.replace(mc, architecture={**kept, **sub})), what,
        modeling.config_class(mc))


def _with_adapter(mc: ModelConfig, model: torch.nn.Module, tokenizer: Any) -> torch.nn.Module:
    """peft's LoRA/DoRA on the meta model: peft's refusal (no such target module, a dropout outside [0, 1], ...)
    becomes one line naming the model.lora_* keys behind it."""
    try:
        return _adapt(mc, model)
    except Exception as err:  # peft judges the user's adapter settings: whatever it raises is about them
        message = " ".join(str(err).split())[:300] or type(err).__name__
        fields = {k: getattr(mc, k) for k in ADAPTER_KEYS}

        def passes(sub: dict) -> bool:
            reset = dataclasses.replace(mc, **{k: sub.get(k, getattr(_DEFAULTS, k)) for k in fields})
            try:
                _adapt(reset, _meta_build(_config(reset, tokenizer)))
                return True
            except Exception:  # still refused: this key alone is not the cause
                return False

        keys = modeling.blame(fields, message, passes)
        named = ", ".join(f"model.{k}={fields[k]!r}" for k in keys)
        raise ConfigError(f"{named}: peft refuses the adapter ({type(err).__name__}: {message}); fix the value (see "
                          f"the model.lora_* settings)") from None


def _adapt(mc: ModelConfig, model: torch.nn.Module) -> torch.nn.Module:
    supported, why = lora.supported(mc.adapter)
    if not supported:
        return model  # the run turns the adapter off with this reason (setup.build_model); so does the estimate
    targets = lora.target_modules(model, mc.lora_target_modules)
    return lora.apply(model, mc.adapter, mc.lora_r, mc.lora_alpha, mc.lora_dropout, targets)


def _too_big(cfg: Config, tokenizer: Any, found: Optional[Footprint], memory: float, device: Any) -> ConfigError:
    mc = cfg.model
    if mc.source == "config":
        fields = {k: v for k, v in mc.architecture.items() if k != "model_type"}

        def fits(sub: dict) -> bool:
            kept = {k: v for k, v in mc.architecture.items() if k == "model_type"}
            try:
                smaller = estimate(dataclasses.replace(mc, architecture={**kept, **sub}), tokenizer)
            except Exception:  # another refusal: not a size that fits
                return False
            return smaller is not None and smaller.training_bytes() <= memory

        keys = [k for k in fields if fits({o: v for o, v in fields.items() if o != k})]
        keys = keys or [k for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool)]
        what = modeling.architecture_keys(fields, keys) if keys else f"model.architecture of {mc.name!r}"
    else:
        what = f"model={mc.name} ({mc.path or mc.name_or_path})"
    where = f"GPU ({device.name})" if device.is_cuda else "machine's RAM"
    if found is None:
        size = "more parameter bytes than torch can count (int64)"
    else:
        trains = "the weights alone, as the encoder is frozen or adapted" if found.trainable_bytes * 100 < \
            found.weight_bytes else "weights, gradients and AdamW's two moments"
        size = (f"{found.params:.3g} parameters: training needs at least {_gib(found.training_bytes())} GiB "
                f"({trains})")
    return ConfigError(f"{what}: model {mc.name!r} would have {size}, more than the {_gib(memory)} GiB of this "
                       f"{where}; make the model smaller (fewer or narrower layers), or train an adapter "
                       f"(model.adapter=lora)")


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g}" if math.isfinite(n) else "inf"


def smoke(cfg: Config, tokenizer: Any) -> None:
    """source=config: a one-layer copy of the model, built for real on the CPU, runs a forward pass at each of
    SMOKE_WIDTHS; what transformers raises there names the model.architecture keys behind it."""
    mc = cfg.model
    if mc.source != "config":
        return
    try:
        _forward(mc, tokenizer)
    except Exception as err:  # the architecture's values are the user's: whatever the forward raises is about them
        raise _architecture_error(mc, err, lambda sub: _forward(sub, tokenizer), "a first forward pass") from None


def _forward(mc: ModelConfig, tokenizer: Any) -> None:
    key, layers = many_layers(mc, 1)
    small = with_layers(mc, key, 1, layers) if key else mc
    config = _config(small, tokenizer)
    with torch.random.fork_rng(devices=[]):  # the run seeds its own initialisation: leave the global RNG as it was
        model = modeling.load_model(small, config, "eager").eval()
        with torch.no_grad():
            for width in SMOKE_WIDTHS:
                ids = torch.arange(1, width + 1)[None] % len(tokenizer)
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                          "labels": torch.zeros(1, dtype=torch.long)}
                if "token_type_ids" in tokenizer.model_input_names:
                    inputs["token_type_ids"] = torch.zeros_like(ids)
                model(**inputs)
