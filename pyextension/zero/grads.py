"""``zerofuse.zero.full_grads``: a ZeRO model's gradients the torch way, inside a block. Outside it the
grads live in the buckets' shards and ``.grad`` is None by design."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def gathered_grads(eng):
    """Every param's full, reduced gradient as its ``.grad`` inside the block (gathered from the
    ranks' shards on entry, dropped on exit); in-place changes to a ``.grad`` (a user's own
    clipping) are written back into this rank's shard. Collective: every rank enters."""
    eng.buckets.finish_grad_sync()
    held = []  # (bucket, full grad buffer, grads handed out with their versions)
    for u in eng.units:
        if not u.has_grad():
            continue
        g = u.grad_shard()
        if eng.stage == 0:
            buf = g
        else:
            buf = torch.empty(u.padded, dtype=u.reduce_dtype, device=u.device)
            eng.comm.all_gather_coalesced(g, [buf]).wait()
        given = []
        for p, o in zip(u.params, u.offsets):
            view = buf[o:o + p.numel()].view(p.shape)
            p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
            given.append((p.grad, p.grad._version))
        held.append((u, buf, given))
    try:
        yield
    finally:
        for u, buf, given in held:
            changed = False
            for p, o, (grad, version) in zip(u.params, u.offsets, given):
                now = p.grad
                if now is not grad or now._version != version:
                    changed = True
                    if now is None:
                        buf[o:o + p.numel()].zero_()
                    elif now.data_ptr() != buf[o:].data_ptr():
                        buf[o:o + p.numel()].copy_(now.reshape(-1))
            if changed and eng.stage != 0:
                u.gshard.copy_(buf[u.lo:u.hi])
        for p in eng.params:
            p.grad = None
