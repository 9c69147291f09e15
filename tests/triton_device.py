"""Where a test of a Triton kernel runs: the GPU (CUDA and triton), or this CPU under Triton's interpreter
(triton installed, TRITON_INTERPRET=1, as a developer checks a kernel without a GPU); CI has neither and
skips them with `needs_kernel`'s reason."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and HAS_TRITON and not INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
needs_kernel = pytest.mark.skipif(
    not (INTERPRET or CUDA),
    reason="needs CUDA + triton, or Triton's interpreter (triton installed, TRITON_INTERPRET=1)")
