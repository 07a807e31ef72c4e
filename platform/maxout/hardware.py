"""Detect the device, pick a hardware profile for ``hardware=auto``, and know each device's peak FLOP/s.

Detection uses torch for what kernels can run (bf16, TF32, compute capability) and NVML for what torch does
not report (driver version, the device's marketing name as the driver knows it).

Ground floor. May import: errors, paths.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import psutil
import pynvml
import torch
from omegaconf import OmegaConf

from .errors import HardwareError
from .paths import CONF_DIR, CPU_BF16_FORCED, CPU_BF16_VAR, in_container


@dataclass
class DeviceInfo:
    kind: str  # "cuda" | "cpu"
    name: str
    count: int = 0
    total_memory_gb: float = 0.0
    compute_capability: Optional[tuple] = None
    bf16: bool = False
    tf32: bool = False
    flash_attention: bool = False
    flash_attention_reason: str = ""
    driver_version: Optional[str] = None
    cuda_version: Optional[str] = None
    cudnn_version: Optional[int] = None
    torch_version: str = ""
    cpu_count: int = 1
    torch_threads: int = 1  # torch's intra-op threads (OMP_NUM_THREADS, else its own count of the cores)
    host_memory_gb: float = 0.0
    in_container: bool = False
    compiler: Optional[str] = None  # C compiler for torch.compile's CPU backend
    notes: list = field(default_factory=list)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def torch_device(self) -> str:
        return "cuda" if self.is_cuda else "cpu"

    def to_dict(self) -> dict:
        return asdict(self)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _nvml_driver() -> Optional[str]:
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or no driver: not an error, just unknown
        return None


def _flash_attention(cc: Optional[tuple]) -> tuple[bool, str]:
    if cc is None:
        return False, "no CUDA device"
    if cc < (8, 0):
        return False, f"flash-attention 2 needs compute capability >= 8.0, device has {cc[0]}.{cc[1]}"
    if importlib.util.find_spec("flash_attn") is None:
        return False, "the flash_attn package is not installed (pip install flash-attn)"
    return True, ""


def _cpuinfo_flags() -> set[str]:
    """The CPU feature flags the Linux kernel reports (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_bf16() -> tuple[bool, str]:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX-BF16), and what said so.

    torch's CPU capability level ("AVX512") is not the answer: Skylake and Cascade Lake report AVX512 and have no
    bf16 instructions, so autocast there emulates bf16, slower than fp32. torch's own cpuid check answers where this
    torch has it (AMX tiles come with AMX-BF16 on every CPU that has them); the kernel's flags otherwise.

    MAXOUT_CPU_BF16=0 or 1 overrides the detection: 0 runs a bf16 CPU as one without (CI does, so that the suite
    proves it passes on CPUs it was not written on); 1 runs bf16 autocast where it is only emulated (slower, same
    results). Any other value is refused by loading.load.
    """
    forced = os.environ.get(CPU_BF16_VAR, "")
    if forced in CPU_BF16_FORCED:
        on = CPU_BF16_FORCED[forced]
        return on, f"{'native' if on else 'emulated'}: forced by {CPU_BF16_VAR}={forced}"
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if avx512_bf16 is not None and amx is not None:
        found = [name for name, check in (("AVX512-BF16", avx512_bf16), ("AMX", amx)) if check()]
        source = "torch's cpuid check"
    else:
        flags = _cpuinfo_flags()
        found = [name for name, flag in (("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16")) if flag in flags]
        source = "/proc/cpuinfo flags"
    if found:
        return True, f"native ({' and '.join(found)}, from {source})"
    return False, f"emulated: no AVX512-BF16 or AMX-BF16 instructions ({source})"


# This process's share of its device, a fraction in (0, 1]: `maxout hpo --workers N` sets it for each worker it
# starts (hpo/placement.py). The batch finder searches within it (its CPU budget, and on a GPU the allocator's
# limit that apply_device_share sets), and its cache keys name it: a share's batch is not the whole device's.
DEVICE_SHARE_VAR = "MAXOUT_DEVICE_SHARE"


def device_share() -> float:
    raw = os.environ.get(DEVICE_SHARE_VAR, "")
    if not raw:
        return 1.0
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise HardwareError(f"{DEVICE_SHARE_VAR}={raw!r} is not valid (valid: a fraction in (0, 1], the share of "
                            f"the device this process may use; unset: all of it)")
    return share


def apply_device_share(device: DeviceInfo) -> float:
    """Hold this process to its share of a GPU: CUDA's caching allocator refuses allocations beyond share x the
    device's memory with the usual out-of-memory error, so the batch finder's probes (and out-of-memory recovery)
    meet the share as they would meet a smaller GPU. CPU threads are shared through OMP_NUM_THREADS, which must be
    set before torch starts (the supervisor sets it in the worker's environment)."""
    share = device_share()
    if device.is_cuda and share < 1.0:
        torch.cuda.set_per_process_memory_fraction(share)
    return share


def detect() -> DeviceInfo:
    info = DeviceInfo(
        kind="cpu", name=platform.processor() or platform.machine(), torch_version=torch.__version__,
        cpu_count=_cpu_count(), torch_threads=torch.get_num_threads(),
        host_memory_gb=round(psutil.virtual_memory().total / 2**30, 1),
        in_container=in_container(), compiler=shutil.which("cc") or shutil.which("gcc"),
    )
    info.flash_attention_reason = "no CUDA device"
    if not torch.cuda.is_available():
        info.bf16, why = cpu_bf16()
        info.notes.append(f"bf16 on this CPU: {why}")
        if info.in_container:
            info.notes.append("no CUDA device visible inside this container: pass -A gpus=all to mlflow run "
                              "(docker run --gpus all)")
        return info
    props = torch.cuda.get_device_properties(0)
    cc = (props.major, props.minor)
    info.kind = "cuda"
    info.name = props.name
    info.count = torch.cuda.device_count()
    info.total_memory_gb = round(props.total_memory / 2**30, 1)
    info.compute_capability = cc
    info.bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    info.tf32 = cc >= (8, 0)
    info.flash_attention, info.flash_attention_reason = _flash_attention(cc)
    info.driver_version = _nvml_driver()
    info.cuda_version = torch.version.cuda
    info.cudnn_version = torch.backends.cudnn.version()
    return info


# --------------------------------------------------------------------------------------------- profiles


def load_profiles() -> dict[str, Any]:
    """Every hardware profile YAML, by name (raw, for matching; typed configs come from loading.load)."""
    return {p.stem: OmegaConf.load(p) for p in sorted((CONF_DIR / "hardware").glob("*.yaml"))}


def pick_profile(device: DeviceInfo, profiles: dict[str, Any]) -> tuple[str, str]:
    """The profile ``auto`` resolves to, and why. Name match first, then small-memory GPUs, then generic."""
    if not device.is_cuda:
        return "cpu", "no CUDA device visible"
    name = device.name.lower()
    for profile, spec in profiles.items():
        if any(m.lower() in name for m in spec.get("match") or []):
            return profile, f"device name {device.name!r} matches profile {profile!r}"
    for profile, spec in profiles.items():
        limit = spec.get("max_memory_gb")
        if limit and device.total_memory_gb <= limit:
            return profile, f"{device.name} has {device.total_memory_gb} GiB <= {limit} GiB"
    return "gpu", f"no profile matches {device.name!r}: generic GPU profile"


def check_profile(hw: Any, device: DeviceInfo) -> None:
    if hw.requires_cuda and not device.is_cuda:
        hint = " Inside a container, pass -A gpus=all to mlflow run." if device.in_container else ""
        raise HardwareError(
            f"hardware profile {hw.name!r} needs a CUDA GPU (hardware.requires_cuda=true) but none is visible "
            f"(torch.cuda.is_available() is False); use hardware=cpu or hardware=auto.{hint}")


# ------------------------------------------------------------------------------------------ peak FLOP/s

# Dense peak TFLOP/s per device: (bf16/fp16 tensor core, TF32 tensor core, plain FP32), from the vendor data
# sheets, without sparsity, with FP32 accumulation where the sheet distinguishes. A key matches whole words of the
# device name ("l4" is the L4, not the L40 or L40S); the first key that matches wins, so longer names come first.
PEAK_TFLOPS: dict[str, tuple[float, float, float]] = {
    "h100 pcie": (756.0, 378.0, 51.0),
    "h100 nvl": (835.5, 417.5, 60.0),  # the 94 GiB PCIe card of NVL pairs: lower clocks than SXM
    "h200 nvl": (835.5, 417.5, 60.0),
    "h100": (989.4, 494.7, 66.9),  # SXM ("NVIDIA H100 80GB HBM3"); the data sheet's 1979 is with sparsity
    "h200": (989.4, 494.7, 66.9),  # SXM
    "gh200": (989.4, 494.7, 66.9),
    "b200": (2250.0, 1100.0, 80.0),
    "a100": (312.0, 156.0, 19.5),
    "a10g": (70.0, 35.0, 31.2),
    "a10": (125.0, 62.5, 31.2),
    "l40s": (362.0, 183.0, 91.6),
    "l40": (181.0, 90.5, 90.5),
    "l4": (121.0, 60.0, 30.3),
    "rtx 5090": (209.5, 104.8, 104.8),
    "rtx 4090": (165.2, 82.6, 82.6),
    "rtx 3090": (71.0, 35.6, 35.6),
    "rtx a6000": (154.8, 77.4, 38.7),
    "v100": (125.0, 15.7, 15.7),  # no TF32: fp32 matmuls run at the FP32 rate
    "t4": (65.0, 8.1, 8.1),
}


def peak_flops(device: DeviceInfo, precision: str, tf32: bool) -> Optional[float]:
    """Peak FLOP/s for the precision the matmuls actually run in; None where unknown (and on CPU)."""
    if not device.is_cuda:
        return None
    name = device.name.lower()
    for key, (half, tf32_peak, fp32) in PEAK_TFLOPS.items():
        if re.search(rf"(?<![a-z0-9]){re.escape(key)}(?![a-z0-9])", name):
            tflops = half if precision in ("bf16", "fp16") else (tf32_peak if tf32 else fp32)
            return tflops * 1e12
    return None


# -------------------------------------------------------------------------------------- GPUs and links

# NVML's answer to "what is the closest thing these two GPUs share?" (nvmlDeviceGetTopologyCommonAncestor).
PCIE_LEVELS = {0: "same board", 10: "PCIe, one switch", 20: "PCIe, several switches", 30: "PCIe host bridge",
               40: "PCIe across host bridges (same NUMA node)", 50: "across CPU sockets (SMP interconnect)"}


@dataclass
class GpuLink:
    a: int
    b: int
    kind: str  # "NVLink" or a PCIE_LEVELS description


@dataclass
class Topology:
    """Every GPU NVML sees (limited to CUDA_VISIBLE_DEVICES when that lists indices) and how each pair is linked."""

    gpus: list = field(default_factory=list)  # dicts: index, name, memory_gb, nvlinks (active NVLink links)
    links: list = field(default_factory=list)  # GpuLink per pair
    error: str = ""  # why there is nothing to list (no NVML, no driver)

    @property
    def all_nvlink(self) -> bool:
        return bool(self.links) and all(link.kind == "NVLink" for link in self.links)

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "links": [asdict(link) for link in self.links], "error": self.error}


def nvml_index(cuda_index: int) -> int:
    """NVML numbers every GPU of the machine, CUDA only the visible ones: CUDA device ``cuda_index`` is NVML's
    device CUDA_VISIBLE_DEVICES names at that position (when it lists indices; UUIDs keep NVML's order)."""
    parts = [p.strip() for p in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts) and cuda_index < len(parts):
        return int(parts[cuda_index])
    return cuda_index


def _visible(count: int) -> list[int]:
    wanted = os.environ.get("CUDA_VISIBLE_DEVICES")
    if wanted is None or not all(p.strip().isdigit() for p in wanted.split(",") if p.strip()):
        return list(range(count))  # unset, or UUIDs: NVML's own order
    return [i for i in (int(p) for p in wanted.split(",") if p.strip()) if i < count]


def _active_nvlinks(nvml: Any, handle: Any) -> int:
    active = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            active += nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED
        except nvml.NVMLError:  # past the device's last link, or no NVLink at all
            break
    return active


def topology(nvml: Any = pynvml) -> Topology:
    """The GPUs and their interconnect, from NVML (``nvml`` is the module, replaceable by a fake in tests)."""
    try:
        nvml.nvmlInit()
    except Exception as err:  # noqa: BLE001 - no NVML library or driver: a machine without NVIDIA GPUs
        return Topology(error=f"NVML not available ({type(err).__name__}): no NVIDIA GPU visible")
    try:
        indices = _visible(nvml.nvmlDeviceGetCount())
        handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        gpus = []
        for i, h in handles.items():
            name = nvml.nvmlDeviceGetName(h)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_gb": round(nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
                         "nvlinks": _active_nvlinks(nvml, h)})
        links = []
        for a in indices:
            for b in (b for b in indices if b > a):
                try:
                    nvlink = nvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], nvml.NVML_P2P_CAPS_INDEX_NVLINK) \
                        == nvml.NVML_P2P_STATUS_OK
                except nvml.NVMLError:
                    nvlink = False
                if nvlink:
                    links.append(GpuLink(a, b, "NVLink"))
                    continue
                try:
                    level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b])
                    links.append(GpuLink(a, b, PCIE_LEVELS.get(int(level), f"PCIe (NVML level {level})")))
                except nvml.NVMLError as err:
                    links.append(GpuLink(a, b, f"unknown ({err})"))
        return Topology(gpus, links)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
