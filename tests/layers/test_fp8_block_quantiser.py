"""The weights' block quantiser (quantize_blocks_kernel) at every config of benchmarks/fp8_gemms.py's sweep: a block
read in row chunks (amax over all chunks, then each chunk read again and cast) writes the bytes the whole-block read
writes. Runs on the GPU or under Triton's interpreter (whose E4M3 cast is not the GPU's: the configs are held to one
another there; tests/layers/test_fp8_gpu.py holds them to the reference on the GPU)."""

from __future__ import annotations

import pytest
import torch
from triton_device import DEVICE as KERNEL_DEVICE  # tests/triton_device.py
from triton_device import needs_kernel


def _bytes(tensors):
    return [t.view(torch.uint8) if t.element_size() == 1 else t for t in tensors]


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("pair", [False, True])
def test_every_chunking_writes_the_whole_block_reads_bytes(pow2, pair):
    """Blocks, transposed blocks and both, one weight or a [w1; w3] pair into one buffer (the second weight's
    rows and columns start mid-buffer), outliers in single blocks."""
    from benchmarks.fp8_gemms import QUANT_BLOCKS_CONFIGS
    from spartron.layers.fp8 import triton_backend as tb

    g = torch.Generator().manual_seed(1)
    w1 = (torch.randn(2, 256, 384, generator=g) * 0.05).bfloat16()
    w1[0, 3, 5], w1[1, 200, 300] = 7.0, -9.0
    weights = (w1, torch.randn(2, 128, 384, generator=g).bfloat16()) if pair else (w1,)
    weights = tuple(w.to(KERNEL_DEVICE) for w in weights)
    assert QUANT_BLOCKS_CONFIGS[0][0] == 128  # the whole-block read: the others are held to it
    quantisers = {"both": lambda config: tb.quantize_blocks_both(weights, pow2, config=config),
                  "blocks": lambda config: tb.quantize_blocks_cat(weights, pow2, config=config),
                  "transposed": lambda config: tb.quantize_blocks_cat(weights, pow2, transpose=True, config=config)}
    for name, quantise in quantisers.items():
        want = _bytes(quantise(QUANT_BLOCKS_CONFIGS[0]))
        for config in QUANT_BLOCKS_CONFIGS[1:]:
            got = _bytes(quantise(config))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (name, config)
