"""Bucket copy-in / copy-out: zerofuse::flatten_into / unflatten_from vs torch.

Providers (zerofuse last, so its extra_info carries the speedup over each peer measured in the
same run): ``torch_cat`` (torch.cat of the flattened tensors, then one copy into the bucket: what
hand-written bucketing does), ``foreach_copy`` (torch._foreach_copy_ into views of the bucket),
``torch_loop`` (one copy_ per tensor, for copy-out), ``zerofuse``.
Cases: many small tensors (a model's biases and norms), a few large ones (its matrices), mixed;
same dtype (fp32 -> fp32 bucket) and cast (bf16 grads -> fp32 bucket). The floor is the bytes
read plus written over the device's measured bandwidth (``roofline_ratio``, bench/conftest.py).
"""
import pytest
import torch

import zerofuse
from zerofuse import reference


def _sizes(case: str, smoke: bool) -> list[int]:
    small = [(i * 7919) % 16381 + 1 for i in range(50 if smoke else 1000)]  # odd sizes, ~8K avg
    large = [(10_007 if smoke else 8_388_617)] * 4
    return {"many_small": small, "few_large": large, "mixed": small + large}[case]


def _inputs(case, dtype, device, smoke):
    sizes = _sizes(case, smoke)
    tensors = [torch.randn(n, device=device).to(dtype) for n in sizes]
    offsets, total = zerofuse.packed_offsets(sizes)  # no padding, so torch.cat matches the layout
    flat = torch.empty(total, device=device, dtype=torch.float32)
    moved = sum(t.numel() * (t.element_size() + flat.element_size()) for t in tensors)
    return tensors, offsets, flat, moved


CASES = ["many_small", "few_large", "mixed"]
DTYPES = {"fp32": torch.float32, "bf16->fp32": torch.bfloat16}


@pytest.mark.parametrize("provider", ["torch_cat", "foreach_copy", "zerofuse"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
def bench_flatten_into(measure, device, smoke, case, dtype, provider):
    tensors, offsets, flat, moved = _inputs(case, DTYPES[dtype], device, smoke)
    if provider == "zerofuse":
        fn = lambda: zerofuse.flatten_into(tensors, flat, offsets)  # noqa: E731
    elif provider == "torch_cat":
        fn = lambda: flat.copy_(torch.cat([t.reshape(-1) for t in tensors]))  # noqa: E731
    else:
        views = [flat[o : o + t.numel()] for t, o in zip(tensors, offsets)]
        fn = lambda: torch._foreach_copy_(views, tensors)  # noqa: E731
    measure(fn, case=f"flatten_into/{case}/{dtype}", provider=provider, bytes_moved=moved)
    expected = torch.empty_like(flat)
    reference.flatten_into(tensors, expected, offsets)
    assert torch.equal(flat, expected)


@pytest.mark.parametrize("provider", ["torch_loop", "foreach_copy", "zerofuse"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
def bench_unflatten_from(measure, device, smoke, case, dtype, provider):
    tensors, offsets, flat, moved = _inputs(case, DTYPES[dtype], device, smoke)
    flat.normal_()
    if provider == "zerofuse":
        fn = lambda: zerofuse.unflatten_from(flat, tensors, offsets)  # noqa: E731
    elif provider == "torch_loop":
        def fn():
            for t, o in zip(tensors, offsets):
                t.copy_(flat[o : o + t.numel()])
    else:
        views = [flat[o : o + t.numel()] for t, o in zip(tensors, offsets)]
        fn = lambda: torch._foreach_copy_(tensors, views)  # noqa: E731
    measure(fn, case=f"unflatten_from/{case}/{dtype}", provider=provider, bytes_moved=moved)
    expected = [torch.empty_like(t) for t in tensors]
    reference.unflatten_from(flat, expected, offsets)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
