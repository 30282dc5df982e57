"""Triton helpers shared by the kernel modules."""
import functools

import torch
import triton
import triton.language as tl


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: CUDA copies it from pinned memory
    asynchronously (a pageable copy would wait for the stream); the CPU takes it as it is."""
    if device.type != "cuda":
        return host
    pinned = host.pin_memory()
    out = pinned.to(device, non_blocking=True)
    # The pinned source lives as long as the device copy: a CUDA graph that captured this copy (a
    # launch table rebuilt during the capture of a step: zerofuse.train's --cuda-graphs) repeats it
    # at every replay, from this memory, which must then still hold the same bytes.
    out._zerofuse_source = pinned
    return out


# Launch-time arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are JIT functions,
# and each call from Python goes through the JIT's dispatch (~1.5-5 us; launchers run per op call).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (launchers size their grids by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _cast(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """x (fp32) -> dtype. The interpreter truncates fp32 -> bf16 (GPUs round to nearest even);
    with EMULATE_RNE the rounding is done on the bits first, so the result is exact either way."""
    if EMULATE_RNE and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        # a NaN stays one: the rounding carried a payload of low bits only into inf (0x7F800001) or
        # through the sign into -0.0 (0x7FFFFFFF)
        u = tl.where(x != x, 0x7FC00000, u)
        return u.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _tanh_sech2(x):
    """(tanh(x), 1 - tanh(x)^2) in fp32 from a = exp(-2|x|) <= 1: tanh = sign(x) (1 - a) / (1 + a),
    sech^2 = 4a / (1 + a)^2. No overflow, and sech^2 keeps its relative accuracy where tanh is
    near +-1 (1 - t*t would cancel). The same in the interpreter as compiled (tl has no tanh
    outside libdevice)."""
    a = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - a) / (1.0 + a)
    return tl.where(x < 0, -t, t), 4.0 * a / ((1.0 + a) * (1.0 + a))


@triton.jit
def _tanh(x):
    t, _ = _tanh_sech2(x)
    return t
