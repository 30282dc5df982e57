"""``zerofuse.zero.full_grads``: a ZeRO model's gradients the torch way, inside a block. Outside it the
grads live in the buckets' shards and ``.grad`` is None by design."""
from __future__ import annotations

import contextlib
import dataclasses

import torch


@contextlib.contextmanager
def gathered_grads(eng):
    """Every param's full, reduced gradient as its ``.grad`` inside the block (gathered from the
    ranks' shards on entry, dropped on exit); in-place changes to a ``.grad`` (a user's own
    clipping) are written back into this rank's shard. Collective: every rank enters. Nested: the
    inner block is the outer one's (its exit released the grads the outer one handed out, whose exit
    then took the Nones for cleared grads and zeroed every one: a review's reproduction, 2026-12-07)."""
    if eng.grads_out:
        yield
        return
    eng.finish_grad_sync()
    held = []  # (bucket, full grad buffer, grads handed out with their versions)
    for u in eng.units:
        if not u.has_grad():
            continue
        g = u.grad_shard()
        if eng.stage == 0:
            buf = g
        else:
            buf = torch.empty(u.padded, dtype=u.reduce_dtype, device=u.device)
            (u.comm or eng.comm).all_gather_coalesced(g, [buf]).wait()
        given = []
        for p, o in zip(u.params, u.offsets):
            view = buf[o:o + p.numel()].view(p.shape)
            p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
            given.append((p.grad, p.grad._version))
        held.append((u, buf, given))
    eng.grads_out = True  # [Note: a world of one]: not taken back as new grads meanwhile
    running = eng.host_steps_started()
    opt = eng.live_optimizer()
    host = opt.host if opt is not None else None
    refused = False
    try:
        yield
    finally:
        eng.grads_out = False
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
            if changed and running:  # the host steps read this shard already: refused, not raced
                refused = True
            elif changed and eng.stage != 0:
                u.gshard.copy_(buf[u.lo:u.hi])
                if host is not None:  # its host copy, taken at the reduction, is taken again
                    host.grads_changed(u)
        eng.release_grads()
    if refused:
        raise RuntimeError("zerofuse.zero.full_grads: the grads were changed while the offloaded optimizer steps "
                           "of this backward were running (offload_overlap: they start as the grads arrive) and "
                           "read them; clip with the Optimizer's max_grad_norm, or build it with "
                           "offload_overlap=False to change grads after backward")


def close_dead_backward(eng, _module=None, _args=None) -> None:
    """A forward pre-hook of the model: a backward that raised before its end (an OOM, a check the
    caller caught and went on from) never ran its end-of-backward callback, so it stayed queued and
    no later backward queued one again (each later step reduced nothing: partial or zero grads,
    silently). Found at the next forward outside any backward: its grads are kept (as torch keeps a
    failed backward's in .grad; zero_grad drops them), the reductions it launched waited, the
    counters restarted."""
    if not eng._final_queued or torch._C._current_graph_task_id() != -1:
        return
    for u in eng.units:
        u.add_deferred()
    eng.buckets.finish_grad_sync()
    reset_backward(eng)


def check_step_grads(eng, who: str) -> None:
    """Before a step of a hooked engine (world size > 1): grads it would silently not use are refused.
    A .grad set by the caller (torch.autograd.grad's results assigned) no hook took: the step moved
    nothing; grads of backwards run only inside no_sync(), never reduced: it stepped on zeros."""
    if eng.hookless:
        return
    if any(u.dirty for u in eng.units):
        raise RuntimeError(f"{who}: the grads of the last backward passes were never reduced (each ran inside "
                           "no_sync()): run the last micro-batch's backward outside no_sync(), then step()")
    own = [n for n, p in zip(eng.names, eng.params) if p.grad is not None]
    if own:
        raise RuntimeError(f"{who}: .grad was set outside autograd's backward on {own[:3]}{' ...' if len(own) > 3 else ''}"
                           f" (zerofuse's grads live in its shards, filled by the backward's hooks): compute them "
                           "with loss.backward(), or set them inside zerofuse.zero.full_grads(model)")


def reset_backward(eng) -> None:
    """The per-backward bookkeeping as before a backward."""
    eng._final_queued = eng._in_backward = False
    if eng.find_unused:
        eng._marked, eng._marked_done = set(), False  # (what the forwards reached stays: [Note: unused params])
    eng.buckets.restart()
    for u in eng.units:
        u.ready = 0


def abandon_backward(eng) -> None:
    """Forget a backward that began but did not finish (a failed CUDA graph capture runs none of its
    kernels, and autograd drops the end-of-backward callback it queued): the units' counters, the
    reductions in flight (over one rank they completed when launched) and every grad, so that the
    next backward starts as after zero_grad."""
    reset_backward(eng)
    eng.stepped = eng.stale_added = False
    eng.buckets.clear_inflight()
    for u in eng.units:
        u.rs_work, u.rs_out = None, None
        u.zero_grad(True)
    eng.release_grads()


def output_tensors(out, objects: bool = False, _seen=None):
    """The tensors in a module's output: inside tuples, lists, dicts (a Hugging Face ModelOutput)
    and dataclasses; objects=True: also inside other objects' attributes (a model's own result
    class, a cache), each object once."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (str, bytes, int, float, complex, bool, type(None), type)):
        return
    else:
        if objects:
            _seen = set() if _seen is None else _seen
            if id(out) in _seen:
                return
            _seen.add(id(out))
        if isinstance(out, (list, tuple)):
            items = out
        elif isinstance(out, dict):
            items = out.values()
        elif dataclasses.is_dataclass(out):
            items = [getattr(out, f.name) for f in dataclasses.fields(out)]
        elif objects and hasattr(out, "__dict__") and not isinstance(out, torch.nn.Module):
            items = vars(out).values()
        else:
            return
        for o in items:
            yield from output_tensors(o, objects, _seen)

