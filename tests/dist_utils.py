"""Run a function on N real processes joined by a gloo process group, for distributed tests.

    results = run_distributed(fn, world_size, *args, timeout=60)

Each rank is a fresh process that joins a process group through a ``file://`` store and calls
``fn(rank, world_size, *args, **kwargs)`` (fn must be importable: a module-level function). Ranks
are forked from a ``forkserver`` that has imported torch and zerofuse once (a spawned rank spent
~4.7 s of CPU importing them, most of a small test's time on 2 cores); each rank takes the
caller's environment at the call, so variables set by a test (ZEROFUSE_TRITON_ON_CPU,
ZEROFUSE_CHECK_COLLECTIVES, ...) hold in the ranks as they would in a spawned process.
The return values come back as a list indexed by rank. If any rank raises, dies, or the whole run
exceeds ``timeout`` seconds, every rank still alive has its Python stack dumped (faulthandler on
SIGUSR1), all ranks are killed, and :class:`DistributedFailure` is raised with every rank's
traceback. Ranks are killed with their parent too (PR_SET_PDEATHSIG), so nothing is left orphaned.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# After the first rank fails, the others get this long to finish before they are stopped: they
# are usually blocked in a collective that will never complete.
FAILURE_GRACE_S = 3.0
# A rank that exited without reporting may still be flushing its result through the queue.
EXIT_GRACE_S = 1.0


class DistributedFailure(AssertionError):
    """A distributed test failed; ``.pids`` are the (now dead) rank processes."""

    def __init__(self, message: str, pids: list[int]):
        super().__init__(message)
        self.pids = pids


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def error_text(fn: Callable[[], Any]) -> str:
    """What ``fn()`` raised (ValueError or RuntimeError) as "Type: message", or "no error": a rank's
    expected error returned as a value, for the caller to match."""
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def ranks_threads(world_size: int) -> int:
    """Intra-op threads per rank when world_size ranks share the cores this test has: OMP_NUM_THREADS
    where set (conftest gives each xdist worker its share), else the machine's."""
    cores = int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 1
    return max(1, cores // world_size)


def _context():
    """The forkserver context, its server preloading torch and zerofuse (started at the first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerofuse"])
    return ctx


def _take_environment(env: dict) -> None:
    """The caller's environment, in a rank forked from a server started under another one; zerofuse's
    one import-time switch follows it (interpreter mode itself, TRITON_INTERPRET, is set by
    conftest for the whole session, so the server has it)."""
    os.environ.clear()
    os.environ.update(env)
    kernels = sys.modules.get("zerofuse.kernels")
    if kernels is not None:
        kernels.TRITON_ON_CPU = env.get("ZEROFUSE_TRITON_ON_CPU", "0") == "1"


def _rank_main(rank, world_size, init_file, tb_dir, backend, timeout, fn, args, kwargs, results, env):
    _die_with_parent()
    _take_environment(env)
    tb_file = open(os.path.join(tb_dir, f"rank{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=tb_file, all_threads=True)
    # as torchrun does for several ranks on one machine: share the cores out (OpenMP threads of
    # co-located ranks spin against each other and against gloo otherwise)
    torch.set_num_threads(ranks_threads(world_size))
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # every rank has finished connecting before any runs fn: a rank whose fn was done at once
        # exited and closed the sockets of a peer still inside gloo's connectFullMesh, failing its
        # init_process_group with "Connection closed by peer" (CI 2026-11-26, test_comm_p2p)
        dist.barrier()
        out = fn(rank, world_size, *args, **kwargs)
        # by value: a tensor sent through the queue as a shared-memory handle dies with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="zerofuse-dist-") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, init_file, tmp, backend, timeout, fn, args, kwargs, results, env),
                name=f"zerofuse-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        exited_at: dict[int, float] = {}
        timed_out = False
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            try:
                rank, ok, payload = results.get(timeout=0.1)
                (outputs if ok else errors)[rank] = payload
                if not ok:
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            except queue.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank in outputs or rank in errors or p.exitcode is None:
                    continue
                exited_at.setdefault(rank, now)
                if now - exited_at[rank] > EXIT_GRACE_S:
                    errors[rank] = f"process exited with code {p.exitcode} without reporting a result"
                    deadline = min(deadline, now + FAILURE_GRACE_S)

        hung = [r for r, p in enumerate(procs) if r not in outputs and r not in errors and p.is_alive()]
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)
        if hung:
            time.sleep(0.5)  # let faulthandler write the stacks
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        for r in hung:
            with open(os.path.join(tmp, f"rank{r}.txt")) as f:
                errors[r] = "did not finish; its stack when stopped:\n" + f.read()
        results.close()
        results.join_thread()

    if errors or timed_out:
        why = "failed" if errors.keys() - set(hung) else f"timed out after {timeout:.0f} s"
        parts = [f"distributed test {why} (world_size={world_size}):"]
        for r in range(world_size):
            state = errors.get(r, "finished")
            parts.append(f"--- rank {r} ---\n{state}")
        raise DistributedFailure("\n".join(parts), [p.pid for p in procs])
    return [pickle.loads(outputs[r]) for r in range(world_size)]
