"""The header of a pipeline stage boundary ([Note: pipeline transfers] in runtime.py): the count,
dtypes and shapes of the tensors a stage sends, as int64s, sent once per micro-batch shape."""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
HEADER_SLOTS = 64


def header(outs) -> torch.Tensor:
    """[count, then per tensor: dtype index, ndim, *shape], zero-padded to HEADER_SLOTS."""
    vals = [len(outs)]
    for t in outs:
        vals += [DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(vals) > HEADER_SLOTS:
        shapes = [tuple(t.shape) for t in outs]
        raise ValueError(f"zerofuse.pipeline: a stage output of {len(outs)} tensors with shapes {shapes} does not fit "
                         f"a {HEADER_SLOTS}-slot header")
    return torch.tensor(vals + [0] * (HEADER_SLOTS - len(vals)), dtype=torch.int64)


def parse_header(head: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of each tensor the header describes."""
    vals = head.tolist()
    n, i, spec = vals[0], 1, []
    for _ in range(n):
        dtype, ndim = DTYPES[vals[i]], vals[i + 1]
        spec.append((tuple(vals[i + 2:i + 2 + ndim]), dtype))
        i += 2 + ndim
    return spec
