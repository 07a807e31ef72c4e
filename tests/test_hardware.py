"""Device facts: native bf16 on a CPU comes from its bf16 instructions, not its AVX-512 level; the peak FLOP/s
table matches device names by whole words."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from maxout import hardware

from .conftest import fake_cuda


@pytest.fixture(autouse=True)
def _detect_bf16(monkeypatch):
    """These tests read the detection itself: the override CI sets (MAXOUT_CPU_BF16=0) would answer first."""
    monkeypatch.delenv(hardware.CPU_BF16_VAR, raising=False)


def kernel_flags() -> set[str]:
    """The test's own reading of the CPU's flags (the code under test asks torch's cpuid check first)."""
    line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    return set(line.partition(":")[2].split())


@pytest.mark.skipif(torch.cuda.is_available() or not Path("/proc/cpuinfo").is_file(),
                    reason="CPU detection on a Linux machine without a visible GPU")
def test_this_cpus_bf16_is_what_its_kernel_flags_say():
    flags = kernel_flags()
    device = hardware.detect()
    assert device.bf16 == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert any(n.startswith("bf16 on this CPU: ") for n in device.notes)


@pytest.mark.parametrize("cpu, avx512_bf16, amx, expected", [
    ("Skylake / Cascade Lake: AVX-512, no bf16 instructions", False, False, False),
    ("Cooper Lake / Zen 4: AVX512-BF16", True, False, True),
    ("Sapphire Rapids: AMX", True, True, True),
])
def test_cpu_bf16_asks_for_the_bf16_instructions_not_the_avx512_level(monkeypatch, cpu, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # all three report this
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    ok, why = hardware.cpu_bf16()
    assert ok is expected, cpu
    assert why.startswith("native" if expected else "emulated") and "torch's cpuid check" in why


def test_cpu_bf16_falls_back_to_the_kernel_flags_where_torch_has_no_cpuid_check(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.setattr(hardware, "_cpuinfo_flags", lambda: {"avx512f", "avx512_vnni"})  # Cascade Lake
    assert hardware.cpu_bf16() == (False, "emulated: no AVX512-BF16 or AMX-BF16 instructions (/proc/cpuinfo flags)")
    monkeypatch.setattr(hardware, "_cpuinfo_flags", lambda: {"avx512f", "amx_tile", "amx_bf16"})
    assert hardware.cpu_bf16() == (True, "native (AMX, from /proc/cpuinfo flags)")


@pytest.mark.parametrize("value, native", [("0", False), ("1", True)])
def test_the_override_answers_before_the_detection(monkeypatch, value, native):
    monkeypatch.setenv(hardware.CPU_BF16_VAR, value)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: not native)  # the opposite of the override
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    ok, why = hardware.cpu_bf16()
    assert ok is native and why == f"{'native' if native else 'emulated'}: forced by MAXOUT_CPU_BF16={value}"


def test_a_bad_override_is_one_line_that_names_the_valid_values(monkeypatch, capsys):
    from maxout import cli

    monkeypatch.setenv(hardware.CPU_BF16_VAR, "yes")
    code = cli.main(["train", "--cfg", "hardware=cpu", "model=tiny", "tracking=none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err == ("maxout: error: MAXOUT_CPU_BF16='yes' is not valid (valid: 0 = no native bf16, "
                   "1 = bf16 as if native, or unset to detect it)")


@pytest.mark.parametrize("name, precision, tf32, tflops", [
    ("NVIDIA L4", "bf16", True, 121.0),
    ("NVIDIA L40", "bf16", True, 181.0),  # "l4" used to match it
    ("NVIDIA L40S", "fp16", True, 362.0),
    ("NVIDIA H100 80GB HBM3", "bf16", True, 989.4),
    ("NVIDIA H100 PCIe", "bf16", True, 756.0),
    ("NVIDIA H100 NVL", "bf16", True, 835.5),  # "h100" used to match it: the SXM peak, MFU understated
    ("NVIDIA H200 NVL", "fp16", True, 835.5),
    ("NVIDIA H200", "bf16", True, 989.4),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 66.9),
    ("NVIDIA GH200 480GB", "fp32", True, 494.7),
    ("NVIDIA A10G", "bf16", True, 70.0),
    ("NVIDIA A10", "fp32", False, 31.2),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0),
    ("Tesla T4", "fp16", False, 65.0),
    ("NVIDIA GeForce RTX 4090", "bf16", True, 165.2),
])
def test_peak_flops_matches_whole_words_of_the_device_name(name, precision, tf32, tflops):
    assert hardware.peak_flops(fake_cuda(name=name), precision, tf32) == pytest.approx(tflops * 1e12)


def test_peak_flops_is_unknown_for_unlisted_devices_and_cpus(cpu_device):
    assert hardware.peak_flops(fake_cuda(name="NVIDIA L4000 Imaginary"), "bf16", True) is None
    assert hardware.peak_flops(fake_cuda(name="NVIDIA T40"), "bf16", True) is None  # not a T4
    assert hardware.peak_flops(cpu_device, "bf16", False) is None
