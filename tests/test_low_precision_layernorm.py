"""Low-precision LayerNorm (optimizations/low_precision_layernorm.py): under autocast every torch.nn.LayerNorm of an
encoder runs in the autocast dtype, with autocast off around the kernel so that CUDA's policy (layer_norm on its fp32
list) cannot send it back to fp32; outside autocast it is torch's LayerNorm to the bit, and the model's parameters and
saved state do not change. These tests check the mechanism (what the kernel is handed, and with autocast off), the
numbers, and the effect on both devices: a bf16 residual stream where it was fp32 (CPU autocast leaves layer_norm in
its input's dtype, and BERT's residual adds make that fp32)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForSequenceClassification

from maxout.hardware import DeviceInfo
from maxout.optimizations import low_precision_layernorm as lp

from .conftest import fake_cuda

ARCHITECTURES = {  # tiny random encoders with torch's LayerNorm, and a decoder without one
    "bert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "modernbert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       global_attn_every_n_layers=1, pad_token_id=0),
    "deberta-v2": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "qwen3": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  intermediate_size=64, pad_token_id=0),
}


def tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=100, max_position_embeddings=64, num_labels=3,
                                  **ARCHITECTURES[model_type])
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()


def batch() -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (4, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[2:, 8:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("model_type", ["bert", "modernbert", "deberta-v2"])
def test_every_layernorm_is_swapped_and_without_autocast_nothing_changes(model_type):
    model = tiny(model_type)
    norms = [n for n, m in model.named_modules() if type(m) is torch.nn.LayerNorm]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(**batch()).logits
    assert lp.apply(model) == len(norms) > 0
    assert [n for n, m in model.named_modules() if isinstance(m, lp.LowPrecisionLayerNorm)] == norms
    assert not any(type(m) is torch.nn.LayerNorm for m in model.modules())
    after_state = model.state_dict()
    assert list(after_state) == list(state) and all(torch.equal(after_state[k], v) for k, v in state.items())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay fp32 parameters
    with torch.no_grad():
        assert torch.equal(model(**batch()).logits, before)  # fp32: torch's LayerNorm to the bit
    assert lp.apply(model) == len(norms)  # applying twice changes nothing more


class LayerNormCalls(TorchFunctionMode):
    """Each F.layer_norm call's input, weight and bias dtypes, and whether CPU autocast was on at that moment."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.layer_norm:
            x, _, weight, bias = (list(args) + [kwargs.get("weight"), kwargs.get("bias")])[:4]
            self.calls.append(((x.dtype, weight.dtype, None if bias is None else bias.dtype),
                               torch.is_autocast_enabled("cpu")))
        return func(*args, **kwargs)


def test_under_autocast_the_kernel_gets_16_bit_tensors_with_autocast_off_and_fp32_grads_flow_back():
    model = tiny("bert").train()
    lp.apply(model)
    with LayerNormCalls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch(), labels=torch.tensor([0, 1, 2, 0]))
    assert len(seen.calls) == 5  # embeddings + 2 per layer
    assert set(seen.calls) == {((torch.bfloat16,) * 3, False)}  # no autocast policy can send it back to fp32
    out.loss.backward()
    norm = model.bert.encoder.layer[0].output.LayerNorm
    assert norm.weight.grad.dtype == torch.float32 and norm.weight.grad.abs().sum() > 0


def test_in_16_bits_a_layernorm_matches_fp32_to_bf16_rounding():
    torch.manual_seed(0)
    reference = torch.nn.LayerNorm(768)
    with torch.no_grad():
        reference.weight.normal_(1.0, 0.1)
        reference.bias.normal_(0.0, 0.1)
    x = torch.randn(64, 768) * 3 + 1
    low = torch.nn.LayerNorm(768)
    low.load_state_dict(reference.state_dict())
    lp.apply(low)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = low(x)
    assert got.dtype == torch.bfloat16
    error = (got.float() - reference(x)).abs().max().item()
    assert 0 < error < 0.05  # 16-bit output (bf16 keeps 8 bits of mantissa), fp32 accumulation inside the kernel


def test_compiled_under_autocast_it_is_one_graph_without_breaks():
    model = tiny("bert")
    lp.apply(model)
    inputs = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        explained = torch._dynamo.explain(model)(**inputs)
        expected = model(**inputs).logits
        got = torch.compile(model, backend="eager")(**inputs).logits
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert torch.equal(got, expected)


def residual_stream(device_type: str) -> dict:
    """{flag on: (the dtypes of tiny BERT's hidden states, its loss)} under bf16 autocast on ``device_type``."""
    device = torch.device(device_type)
    labels = torch.tensor([0, 1, 2, 0], device=device)
    inputs = {k: v.to(device) for k, v in batch().items()}
    runs = {}
    for low in (False, True):
        model = tiny("bert").to(device)
        if low:
            lp.apply(model)
        with torch.autocast(device_type, dtype=torch.bfloat16), torch.no_grad():
            out = model(**inputs, labels=labels, output_hidden_states=True)
        runs[low] = ({h.dtype for h in out.hidden_states}, out.loss.float().item())
    return runs


def test_on_a_cpu_the_residual_stream_is_fp32_without_it_and_bf16_with_it():
    """CPU autocast does not run BERT's LayerNorms in bf16 by itself (the reason this flag once gave for refusing
    CPUs): its hidden states are fp32 without the flag and bf16 with it, and the losses agree."""
    runs = residual_stream("cpu")
    assert runs[False][0] == {torch.float32} and runs[True][0] == {torch.bfloat16}
    assert runs[True][1] == pytest.approx(runs[False][1], rel=0.02)
    assert lp.supported(DeviceInfo(kind="cpu", name="cpu"), "bf16", tiny("bert")) == (True, "")


def test_supported_on_cuda_with_16_bit_autocast_and_a_layernorm_only():
    cuda = fake_cuda(name="NVIDIA H200", memory_gb=139.8, cc=(9, 0))
    assert lp.supported(cuda, "bf16", tiny("bert")) == (True, "")
    assert lp.supported(cuda, "fp16", tiny("modernbert")) == (True, "")
    assert lp.supported(cuda, "bf16") == (True, "")  # the grid's check, before a model exists
    assert lp.supported(cuda, "fp32", tiny("bert")) == (
        False, "precision fp32: no autocast, LayerNorm already runs in the model's own dtype")
    assert lp.supported(cuda, "bf16", tiny("qwen3")) == (
        False, "the model has no torch.nn.LayerNorm (decoders' RMSNorm: see liger_kernel)")


@pytest.mark.gpu
def test_on_cuda_the_residual_stream_is_bf16_and_the_loss_agrees():
    """What the flag is for: with it, BERT's hidden states between layers are bf16 under autocast; without it they
    are fp32 (autocast's layer_norm), and the two losses agree to bf16's precision."""
    runs = residual_stream("cuda")
    assert runs[False][0] == {torch.float32} and runs[True][0] == {torch.bfloat16}
    assert runs[True][1] == pytest.approx(runs[False][1], rel=0.02)
