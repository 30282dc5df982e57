"""Helpers shared by tests and benchmarks (import as ``from common import ...``)."""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Parametrise with DEVICES to run a test on CPU always and on CUDA when present (the gpu mark
# makes it skip cleanly without one).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
