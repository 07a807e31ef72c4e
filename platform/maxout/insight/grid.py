"""The benchmark's grid: its axes, each an optimization with its values, and the cells they span.

Pure values, no torch: the CLI lists the axes in ``maxout benchmark --help`` without importing the trainer. Each
axis is named after the optimization decision it sets (``optimizations.NAMES``), so a cell's request can be
checked against the decision the run logged.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..errors import ConfigError, one_of

if TYPE_CHECKING:  # for annotations only: importing config would load omegaconf into `maxout --help`
    from ..config import Config

BOOLS = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}


@dataclass(frozen=True)
class Axis:
    key: str  # the config key the axis sets
    values: tuple  # every valid value, baseline first
    settings: Optional[dict] = None  # value -> {config key: value}, for an axis that sets several keys
    in_default: bool = True  # part of the default grid (every value of every such axis)

    def assignments(self, value: Any) -> dict:
        return self.settings[value] if self.settings else {self.key: value}


AXES: dict[str, Axis] = {
    "precision": Axis("hardware.precision", ("fp32", "fp16", "bf16")),
    "compile": Axis("hardware.compile", (False, True)),
    "gradient_checkpointing": Axis("hardware.gradient_checkpointing", (False, True)),
    "bucketing": Axis("data.bucketing", (False, True)),
    "fused_adamw": Axis("hardware.fused_adamw", (False, True)),
    "fast_dropout": Axis("hardware.fast_dropout", (False, True)),
    # GPU axes, asked for by name (they would multiply the default grid by 24): TF32 matmuls for fp32, the compile
    # mode (with compile=on), the attention kernels
    "tf32": Axis("hardware.tf32", (False, True), in_default=False),
    "compile_mode": Axis("hardware.compile_mode", ("default", "reduce-overhead", "max-autotune",
                                                   "max-autotune-no-cudagraphs"), in_default=False),
    "attention": Axis("hardware.attn_implementation", ("eager", "sdpa", "flash_attention_2"), in_default=False),
    # what compile compiles (with compile=on): the whole model, or each of its layers (one layer's compile time)
    "compile_scope": Axis("hardware.compile_scope", ("model", "layers"), in_default=False),
    # Fused kernels for the memory-bound ops (issue 37): Liger's for decoders, inductor's tuned ones (with compile)
    "liger_kernel": Axis("hardware.liger_kernel", (False, True), in_default=False),
    "inductor_tuning": Axis("hardware.inductor_tuning", (False, True), in_default=False),
    # and inductor's fused LayerNorm backward (one kernel for both reductions), its default, against two kernels
    "mix_order_reduction": Axis("hardware.mix_order_reduction", (False, True), in_default=False),
    # and LayerNorm in the autocast dtype instead of fp32 (encoders: a 16-bit residual stream)
    "low_precision_layernorm": Axis("hardware.low_precision_layernorm", (False, True), in_default=False),
    # and eager forwards handed their attention mask built, without transformers' host read of it (a sync a forward)
    "prepared_mask": Axis("hardware.prepared_mask", (False, True), in_default=False),
    # and a right-padded decoder batch's causal attention without a padding mask (SDPA's causal kernel: Qwen2/3)
    "unmasked_causal": Axis("hardware.unmasked_causal", (False, True), in_default=False),
    # and compiled forwards that skip dynamo's guards for inputs already seen (the host's time a step, with compile)
    "skip_guards": Axis("hardware.skip_guards", (False, True), in_default=False),
    # How rows become batches: padded to the batch's longest row (random or length-bucketed batches), packed
    # without padding by a token budget (data.max_tokens_per_batch, auto when unset), or packed into bins of
    # data.max_length tokens (bin_packing.py). It sets data.bucketing too, so it is not in the default grid, and a
    # grid names either it or bucketing.
    "padding": Axis("data.padding", ("dynamic", "bucketed", "packed", "binned"), settings={
        "dynamic": {"data.padding": "dynamic", "data.bucketing": False},
        "bucketed": {"data.padding": "dynamic", "data.bucketing": True},
        "packed": {"data.padding": "packed", "data.bucketing": False},
        "binned": {"data.padding": "packed", "data.bucketing": False, "data.packing_attention": "bins"}},
        in_default=False),
}


def parse_grid(spec: Optional[str]) -> dict[str, tuple]:
    """``"precision=fp32,bf16 compile=off,on"`` -> {"precision": ("fp32", "bf16"), "compile": (False, True)}.
    None or empty: every value of every axis in the default grid."""
    if not spec or not spec.strip():
        return {name: axis.values for name, axis in AXES.items() if axis.in_default}
    grid: dict[str, tuple] = {}
    for token in spec.replace(";", " ").split():
        name, sep, raw = token.partition("=")
        if not sep or not raw:
            raise ConfigError(f"grid entry {token!r} is malformed: write axis=value1,value2 "
                              f"(axes: {', '.join(AXES)})")
        if name not in AXES:
            raise ConfigError(f"unknown grid key {one_of(name, AXES)}")
        if name in grid:
            raise ConfigError(f"grid key {name!r} is given twice: list all its values once, e.g. {name}=a,b")
        grid[name] = tuple(_value(name, v) for v in raw.split(",") if v)
    if "padding" in grid and "bucketing" in grid:
        raise ConfigError("grid keys 'padding' and 'bucketing' both set data.bucketing: name one of them "
                          "(padding=dynamic,bucketed,packed covers bucketing=off,on)")
    return grid


def _value(axis: str, raw: str) -> Any:
    valid = AXES[axis].values
    if isinstance(valid[0], bool):
        if raw.lower() not in BOOLS:
            raise ConfigError(f"grid {axis}={raw!r} is invalid (valid: on, off, true, false)")
        return BOOLS[raw.lower()]
    if raw not in valid:
        raise ConfigError(f"grid {axis}={raw!r} is invalid (valid: {', '.join(valid)})")
    return raw


@dataclass(frozen=True)
class Cell:
    values: tuple  # ((axis, value), ...) in grid order

    @property
    def name(self) -> str:
        return " ".join(f"{a}={show(v)}" for a, v in self.values)

    def apply(self, base: "Config") -> "Config":
        """``base`` (a typed Config) with this cell's settings, validated; the same keys as the overrides
        ``hardware.precision=bf16 ...`` (cheaper than composing Hydra once per cell)."""
        cfg = copy.deepcopy(base)
        for axis, value in self.values:
            for dotted, setting in AXES[axis].assignments(value).items():
                section, key = dotted.split(".")
                setattr(getattr(cfg, section), key, setting)
        if cfg.data.padding == "packed" and cfg.data.max_tokens_per_batch is None:
            cfg.data.max_tokens_per_batch = "auto"  # the micro-batch's samples on average: equal work per step
        return cfg.validate()


def show(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def cells(grid: dict[str, tuple]) -> list[Cell]:
    names = list(grid)
    return [Cell(tuple(zip(names, combo))) for combo in itertools.product(*(grid[n] for n in names))]
