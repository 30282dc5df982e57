"""The header of a pipeline stage boundary ([Note: pipeline transfers] in transfers.py): the count,
dtypes, requires_grad flags and shapes of the tensors a stage sends, as int64s, sent once per
micro-batch shape and mode (grad mode, autocast)."""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.int8, torch.int16]
HEADER_SLOTS = 64


def header(outs, stage: int) -> torch.Tensor:
    """[count, then per tensor: dtype index, requires_grad, ndim, *shape], zero-padded to HEADER_SLOTS."""
    vals = [len(outs)]
    for i, t in enumerate(outs):
        if t.dtype not in DTYPES:
            raise ValueError(f"zerofuse.pipeline: stage {stage}'s output {i} is a {t.dtype} tensor; expected the "
                             f"tensors crossing a stage boundary to be one of {[str(d) for d in DTYPES]}")
        vals += [DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(vals) > HEADER_SLOTS:
        shapes = [tuple(t.shape) for t in outs]
        raise ValueError(f"zerofuse.pipeline: a stage output of {len(outs)} tensors with shapes {shapes} does not fit "
                         f"a {HEADER_SLOTS}-slot header")
    return torch.tensor(vals + [0] * (HEADER_SLOTS - len(vals)), dtype=torch.int64)


def spec_of(outs) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
    """What a header says of ``outs``: each tensor's (shape, dtype, requires_grad)."""
    return [(tuple(t.shape), t.dtype, t.requires_grad) for t in outs]


def parse_header(head: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
    """The (shape, dtype, requires_grad) of each tensor the header describes."""
    vals = head.tolist()
    n, i, spec = vals[0], 1, []
    for _ in range(n):
        dtype, grad, ndim = DTYPES[vals[i]], bool(vals[i + 1]), vals[i + 2]
        spec.append((tuple(vals[i + 3:i + 3 + ndim]), dtype, grad))
        i += 3 + ndim
    return spec
