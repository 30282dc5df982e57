"""Counting host reads of tensors (each a device sync on CUDA) made from Python: used by
tests/test_train_sync.py and bench/profile_step.py."""
import os
import sys

from torch.overrides import TorchFunctionMode

# reading a device tensor on the host: each is a device sync on CUDA
SYNCS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__array__"}
# host-side by design (CPU tensors on every device): the sampler, the batch's copy in, the stop vote
HOST_SIDE = {("data.py", "get"), ("loop.py", "_batch"), ("metrics.py", "vote")}


def _host_side() -> bool:
    f = sys._getframe(2)
    while f is not None:
        if (os.path.basename(f.f_code.co_filename), f.f_code.co_name) in HOST_SIDE:
            return True
        f = f.f_back
    return False


class CountSyncs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        if (name in SYNCS or to_cpu) and not _host_side():
            f = sys._getframe(1)
            self.calls.append(f"{name} at {os.path.basename(f.f_code.co_filename)}:{f.f_lineno}")
        return func(*args, **kwargs)
