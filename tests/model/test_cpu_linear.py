"""The decoder's linear layers through oneDNN with reordered weights (model/cpu_linear.py), and the heap kept for
reuse on CPU (engine/memory.py: keep_freed_heap)."""

from __future__ import annotations

import resource

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.checkpoints import make_checkpoint
from tokenfleet.engine.memory import keep_freed_heap
from tokenfleet.model import cpu_linear
from tokenfleet.model.cpu_linear import PACKED_MIN_ROWS, PackedLinear, pack_cpu_linears
from tokenfleet.model.loader import load_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")


@needs_onednn
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not cpu_linear.packable(torch.bfloat16), reason="oneDNN bfloat16 needs AVX-512 on this CPU"
            ),
        ),
    ],
)
@pytest.mark.parametrize("shape", [(192, 320), (1024, 1536)], ids=["small", "large"])
@pytest.mark.parametrize("rows", [1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 700])
def test_a_packed_linear_computes_what_the_linear_did(dtype, shape, rows):
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=True).to(dtype)
    x = torch.randn(rows, shape[0], dtype=dtype)
    expected = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), expected, atol=tolerance, rtol=tolerance)


@needs_onednn
def test_a_large_layer_keeps_only_its_reordered_weight_and_a_small_one_both(monkeypatch):
    monkeypatch.setattr(cpu_linear, "SMALL_LAYER_ELEMENTS", 1000)
    assert PackedLinear(nn.Linear(64, 64)).weight is None  # 4,096 elements: large here
    small = PackedLinear(nn.Linear(16, 16))
    assert isinstance(small.weight, nn.Parameter) and small.weight.shape == (16, 16)


@needs_onednn
def test_the_loader_swaps_the_decoders_linears_on_cpu_but_not_the_lm_head(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "llama", "llama"), device="cpu")
    layer = model.layers[0]
    swapped = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(m, PackedLinear) for m in swapped)
    assert model.lm_head is None or type(model.lm_head) is nn.Linear
    assert "layers.0.mlp.gate_up_proj.weight" in dict(model.named_parameters())  # small: still there
    assert pack_cpu_linears(model) == 0  # nothing left to swap


def test_the_heap_is_kept_so_activation_sized_buffers_do_not_fault_in_again():
    """Without it each 8 MB buffer is a fresh mmap: ~2,000 page faults per allocation."""
    assert keep_freed_heap()
    for _ in range(3):
        torch.empty(2 << 20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.empty(2 << 20).fill_(1.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 500
