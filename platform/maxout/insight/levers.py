"""The levers ``maxout audit`` pulls: every speed-up it considers, as one table with a row per lever.

A row names the config values it would set for this config on this device (``target``) and the optimization
decisions that must honour them (``decisions``, read from train/setup.plan_decisions, the trainer's own), so a
lever the device cannot use is listed with the very reason a training run logs as ``opt.<name>.reason``. A row with
a known ``cost`` (accuracy, reproducibility) is measured and shown but never recommended silently. A new lever is
one more row (packing, ``data.padding=packed``, came that way, and bins after it).

``assess`` turns each row into what the audit does with it: ``measure`` (its overrides), ``in use`` (the config has
it already, or nothing better exists here), ``cannot use`` (a decision falls back: the reason), or ``skipped``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from omegaconf import OmegaConf

from ..config import Config
from ..errors import ConfigError, first_line, one_of
from ..hardware import DeviceInfo
from ..optimizations import ATTENTION, low_precision_layernorm, mix_order_reduction, named
from ..optimizations.dataloader import auto_workers
from ..train.setup import plan_decisions

MEASURE, IN_USE, CANNOT_USE, SKIPPED = "measure", "in use", "cannot use", "skipped"


@dataclass
class Context:
    """What the targets look at besides the config: the device, what the current config gets, the batch it runs."""

    device: DeviceInfo
    model_class: type
    current: list  # the current config's planned decisions
    micro_batch: int
    accumulation: int
    finder: Callable[[Config], int]  # the batch finder's micro-batch for a config (it searches once per key)


@dataclass(frozen=True)
class Target:
    """What a lever would do here: ``overrides`` to try, or none, and why (``status``: in use or skipped)."""

    overrides: tuple = ()
    status: str = MEASURE
    note: str = ""


def _try(*overrides: str) -> Target:
    return Target(tuple(overrides))


@dataclass(frozen=True)
class Lever:
    name: str
    target: Callable[[Config, Context], Target]
    decisions: tuple = ()  # the optimizations (opt.<name>) that must honour the target
    cost: str = ""  # a known cost beyond speed: measured and shown, never recommended silently
    what: str = ""  # one line for the report
    searches: bool = False  # its target may run the batch finder (probes): not assessed unless selected


def _switch(key: str) -> Callable[[Config, Context], Target]:
    return lambda cfg, ctx: _try(f"{key}=true")


def _precision(cfg: Config, ctx: Context) -> Target:
    # bf16 where native (no loss scaling); fp16 + GradScaler on GPUs without it. A CPU without native bf16 is
    # asked for bf16 anyway, so the row says why not (its fp16 is no lever: no CUDA device).
    device = ctx.device
    return _try(f"hardware.precision={'bf16' if device.bf16 or not device.is_cuda else 'fp16'}")


def _attention(impl: str) -> Callable[[Config, Context], Target]:
    def target(cfg: Config, ctx: Context) -> Target:
        current = named(ctx.current, "attention").effective
        if ATTENTION.index(current) < ATTENTION.index(impl):
            return Target(status=IN_USE, note=f"{current} runs already (faster than {impl})")
        return _try(f"hardware.attn_implementation={impl}")
    return target


def _packing(cfg: Config, ctx: Context) -> Target:
    # A model type or attention kernel that cannot keep packed rows apart falls back: the row then says why, with
    # the reason a run would log as opt.padding.reason.
    if cfg.data.padding == "packed":
        return Target(status=IN_USE, note="data.padding=packed already")
    return _try(*_packed(cfg))


def _packed(cfg: Config) -> tuple[str, str]:
    """Packed batches with the config's token budget, else auto: as many tokens per step as the current micro-batch
    carries on average (a fair comparison)."""
    return "data.padding=packed", f"data.max_tokens_per_batch={cfg.data.max_tokens_per_batch or 'auto'}"


def _bins(cfg: Config, ctx: Context) -> Target:
    # Bins trade the flat row's one mask for a mask per row of data.max_length tokens: whether that beats bucketing
    # or varlen depends on the kernels' tiles at these lengths, which only a measurement on this device can say.
    if cfg.data.padding == "packed" and cfg.data.packing_attention == "bins":
        return Target(status=IN_USE, note="data.padding=packed data.packing_attention=bins already")
    return _try(*_packed(cfg), "data.packing_attention=bins")


def _workers(cfg: Config, ctx: Context) -> Target:
    best, current = auto_workers(ctx.device.cpu_count), named(ctx.current, "num_workers").effective
    if current >= best:
        return Target(status=IN_USE, note=f"{current} workers; auto = max(0, {ctx.device.cpu_count} cores - 2) "
                                          f"= {best}")
    return _try(f"hardware.num_workers={best}")


def _micro_batch(cfg: Config, ctx: Context) -> Target:
    if ctx.accumulation == 1:
        return Target(status=IN_USE, note=f"micro-batch {ctx.micro_batch} is the whole effective batch: "
                                          f"no accumulation to save")
    safe = ctx.finder(cfg)
    if safe <= ctx.micro_batch:
        return Target(status=IN_USE, note=f"the batch finder's safe micro-batch is {safe} "
                                          f"(runs: {ctx.micro_batch} x {ctx.accumulation})")
    return _try(f"train.batch_size={safe}")


def _checkpointing(cfg: Config, ctx: Context) -> Target:
    # Checkpointing trades compute for memory: a speed-up only where memory binds the micro-batch, and then
    # only through the larger micro-batch it lets fit (fewer accumulation steps).
    if ctx.accumulation == 1 or cfg.hardware.gradient_checkpointing:
        return Target(status=SKIPPED, note="memory does not bind: the effective batch fits one micro-batch"
                      if ctx.accumulation == 1 else "checkpointing is on already")
    without = ctx.finder(cfg)
    target = cfg.train.target_effective_batch or ctx.micro_batch
    if without >= target:
        return Target(status=SKIPPED, note=f"memory does not bind: {target} rows fit one micro-batch")
    with_ckpt = ctx.finder(with_overrides(cfg, ["hardware.gradient_checkpointing=true"]))
    if with_ckpt <= max(without, ctx.micro_batch):
        return Target(status=SKIPPED, note=f"checkpointing would not raise the micro-batch ({with_ckpt})")
    return _try("hardware.gradient_checkpointing=true", f"train.batch_size={with_ckpt}")


def _low_precision_layernorm(cfg: Config, ctx: Context) -> Target:
    # Decided when the model is built (it looks for the model's LayerNorms), so not in plan_decisions: the device
    # and the precision are checked here with the same code; a model without one logs why when its run builds it.
    # Asked for or not, an unsupported one cannot be used (the CPU profile asks for it, and a CPU in fp32 refuses it).
    ok, why = low_precision_layernorm.supported(ctx.device, named(ctx.current, "precision").effective)
    if not ok:
        return Target(status=CANNOT_USE, note=why)
    if cfg.hardware.low_precision_layernorm:
        return Target(status=IN_USE, note="hardware.low_precision_layernorm=true already")
    return _try("hardware.low_precision_layernorm=true")


def _mix_order_off(cfg: Config, ctx: Context) -> Target:
    # A lever that turns a default off: a request of "off" needs no support check in its decision, so the device
    # is checked here, with the decision's own code (with compile: the lever compiles)
    if not cfg.hardware.mix_order_reduction:
        return Target(status=IN_USE, note="hardware.mix_order_reduction=false already")
    ok, why = mix_order_reduction.supported(ctx.device, compiled=True)
    if not ok:
        return Target(status=CANNOT_USE, note=why)
    return _try("hardware.compile=true", "hardware.mix_order_reduction=false")


def _off(key: str, on: Callable[[Config], bool], value: str) -> Callable[[Config, Context], Target]:
    def target(cfg: Config, ctx: Context) -> Target:
        return _try(f"{key}={value}") if on(cfg) else Target(status=IN_USE, note=f"{key}={value} already")
    return target


# In the order the audit measures them: big and cheap first, compile (minutes of compiling) last.
LEVERS: tuple = (
    Lever("precision", _precision, ("precision",), what="bf16 autocast (fp16 + GradScaler where bf16 is not native)"),
    Lever("bucketing", _switch("data.bucketing"), ("bucketing",), what="length-bucketed batches: less padding"),
    Lever("packing", _packing, ("padding",), what="several rows per sequence: no padding"),
    Lever("bins", _bins, ("padding", "packing"),
          what="several rows per row of data.max_length tokens, a mask per row: one batch shape"),
    Lever("micro_batch", _micro_batch, what="the batch finder's safe micro-batch, fewer accumulation steps",
          searches=True),
    Lever("fused_adamw", _switch("hardware.fused_adamw"), ("fused_adamw",), what="one fused AdamW kernel"),
    Lever("fast_dropout", _switch("hardware.fast_dropout"), ("fast_dropout",),
          what="CPU dropout masks from bulk random bits"),
    Lever("flash_attention", _attention("flash_attention_2"), ("attention",), what="flash-attention 2 kernels"),
    Lever("sdpa", _attention("sdpa"), ("attention",), what="PyTorch's fused attention (SDPA)"),
    Lever("tf32", _switch("hardware.tf32"), ("tf32",), what="TF32 tensor cores for fp32 matmuls"),
    Lever("cudnn_benchmark", _switch("hardware.cudnn_benchmark"), ("cudnn_benchmark",),
          what="cuDNN picks the fastest kernel per shape"),
    Lever("num_workers", _workers, ("num_workers",), what="DataLoader worker processes"),
    Lever("pin_memory", _switch("hardware.pin_memory"), ("pin_memory",), what="pinned host memory for copies"),
    Lever("low_precision_layernorm", _low_precision_layernorm,
          what="LayerNorm in the autocast dtype: a 16-bit residual stream (encoders)"),
    Lever("prepared_mask", _switch("hardware.prepared_mask"), ("prepared_mask",),
          what="eager forwards' attention masks built without a host read (one sync a forward)"),
    Lever("unmasked_causal", _switch("hardware.unmasked_causal"), ("unmasked_causal",),
          what="a decoder's right-padded batches through SDPA's causal kernel, with no padding mask"),
    Lever("liger_kernel", _switch("hardware.liger_kernel"), ("liger_kernel",),
          what="Liger's fused Triton kernels (decoders' RMSNorm, SwiGLU, RoPE, cross-entropy)"),
    Lever("gradient_checkpointing", _checkpointing, ("gradient_checkpointing",),
          what="recompute activations to fit a larger micro-batch", searches=True),
    Lever("deterministic", _off("train.deterministic", lambda c: c.train.deterministic, "false"),
          cost="gives up bit-for-bit reproducible runs", what="non-deterministic (faster) kernels"),
    Lever("no_dropout", _off("model.dropout", lambda c: c.model.dropout != 0.0, "0.0"),
          cost="changes the regularization: check accuracy before using it", what="no dropout at all"),
    Lever("compile", _switch("hardware.compile"), ("compile",), what="torch.compile (inductor)"),
    Lever("cuda_graphs", lambda cfg, ctx: _try("hardware.compile=true", "hardware.compile_mode=reduce-overhead"),
          ("compile", "compile_mode"), what="torch.compile with CUDA graphs (reduce-overhead)"),
    Lever("inductor_tuning", lambda cfg, ctx: _try("hardware.compile=true", "hardware.inductor_tuning=true"),
          ("compile", "inductor_tuning"), what="torch.compile with inductor's coordinate-descent kernel tuning"),
    Lever("mix_order_reduction", _mix_order_off, ("compile", "mix_order_reduction"),
          what="torch.compile with a LayerNorm backward's two reductions in two kernels, not inductor's fused one"),
)
NAMES = tuple(lever.name for lever in LEVERS)


def parse_levers(spec: Optional[str]) -> Optional[tuple]:
    """``"precision,bucketing"`` -> those names (None or empty: every lever); an unknown name is a usage error."""
    if not spec or not spec.strip():
        return None
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ConfigError(f"unknown lever {one_of(unknown[0], NAMES)}")
    return names


def with_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with ``key=value`` overrides merged onto it, typed and validated (what the same Hydra overrides on
    the command line give, without composing the whole config again)."""
    if not overrides:
        return cfg
    try:
        merged = OmegaConf.merge(OmegaConf.structured(copy.deepcopy(cfg)), OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged).validate()
    except ConfigError:
        raise
    except Exception as err:  # OmegaConf's own errors (a wrong type, an unknown key): one line
        raise ConfigError(f"overrides {' '.join(overrides)!r} do not apply: {first_line(err)}") from None


@dataclass
class Assessment:
    """What the audit does with one lever, and later what it measured."""

    lever: Lever
    status: str
    overrides: tuple = ()
    reason: str = ""  # why it is in use, cannot be used, was skipped, not reached, or failed
    decision: str = ""  # the optimization whose reason it is (cannot use): opt.<decision>.reason in a run
    result: dict = field(default_factory=dict)  # filled by the audit for measured levers

    @property
    def name(self) -> str:
        return self.lever.name


def assess(lever: Lever, cfg: Config, ctx: Context) -> Assessment:
    target = lever.target(cfg, ctx)
    if target.status != MEASURE:
        return Assessment(lever, target.status, reason=target.note)
    candidate = with_overrides(cfg, target.overrides)
    planned = plan_decisions(candidate, ctx.device, ctx.model_class)
    for name in lever.decisions:
        decision = named(planned, name)
        if decision.changed:
            return Assessment(lever, CANNOT_USE, target.overrides, decision.reason, name)
    same = (all(named(planned, n).effective == named(ctx.current, n).effective for n in lever.decisions)
            if lever.decisions else candidate == cfg)
    if same:
        return Assessment(lever, IN_USE, target.overrides, "the config has it already")
    return Assessment(lever, MEASURE, target.overrides)


def assess_all(cfg: Config, ctx: Context, only: Optional[Sequence[str]] = None) -> list[Assessment]:
    """Every lever; with ``only``, the others are listed but not measured (nor searched for)."""
    out = []
    for lever in LEVERS:
        chosen = only is None or lever.name in only
        row = Assessment(lever, SKIPPED) if lever.searches and not chosen else assess(lever, cfg, ctx)
        if not chosen and (row.status == MEASURE or lever.searches):
            row.status, row.reason = SKIPPED, "not among --levers"
        out.append(row)
    return out
