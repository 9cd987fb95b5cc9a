"""Slicing packed (quantized) weights on their tiles and blocks gives exactly the sliced weight's values."""

from __future__ import annotations

import pytest
import torch

from specserve.checks import ConfigError
from specserve.models.quant import PackedWeight, QuantizationError, QuantLinear, quantize_dense
from specserve.parallel.shard import Span, input_columns


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packed_slices_are_the_weights_slices(kind):
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    packed = PackedWeight.from_codes(quantize_dense(weight, kind))
    whole = packed.dequantize()
    assert torch.equal(packed.output_slice(16, 48).dequantize(), whole[16:48])
    assert torch.equal(packed.output_slice(0, 16, copy=False).dequantize(), whole[:16])
    assert torch.equal(packed.input_slice(64, 128).dequantize(), whole[:, 64:128])
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    halves = [packed.input_slice(0, 64).matmul(x[:, :64], out_fp32=True),
              packed.input_slice(64, 128).matmul(x[:, 64:], out_fp32=True)]
    torch.testing.assert_close(halves[0] + halves[1], packed.matmul(x, out_fp32=True), rtol=1e-5, atol=1e-4)


def test_slices_off_the_tiles_and_blocks_are_refused():
    packed = PackedWeight.from_codes(quantize_dense(torch.randn(48, 128), "int8"))
    with pytest.raises(QuantizationError, match="tiles of 16"):
        packed.output_slice(8, 48)
    with pytest.raises(QuantizationError, match="blocks of 32"):
        packed.input_slice(0, 48)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants_slice_on_their_super_blocks(kind):
    """A K-quant keeps one d per 256 inputs: its slices fall on those super-blocks, exactly, or are refused."""
    from tests.models.test_quant import packed_weight

    packed, _ = packed_weight(kind, rows=48, cols=768)
    whole = packed.dequantize()
    assert torch.equal(packed.input_slice(256, 768).dequantize(), whole[:, 256:])
    assert torch.equal(packed.output_slice(16, 48).dequantize(), whole[16:48])
    with pytest.raises(QuantizationError, match="blocks of 256"):
        packed.input_slice(0, 384)
    with pytest.raises(ConfigError, match="tensor_parallel_size.*blocks of 256"):  # a rank's share names the setting
        input_columns(QuantLinear(packed), Span(384, 384))
