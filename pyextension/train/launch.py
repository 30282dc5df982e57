"""Starting the ranks: the elastic launcher for --nproc N, the process group of a rank, and the
signals that stop the job cleanly (torchrun's or SLURM's variables when a launcher started us:
launch_env.py)."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid

import torch

from ..checkpoint import files
from .cli import EXIT_USAGE, PROG, UsageError
from .launch_env import _slurm_endpoint

# the elastic agent's, and SLURM's --signal=USR1@<s> / B:USR2 (a rank's default action ended it with no
# checkpoint; the launcher's, before its ranks: a review's reproduction, 2026-12-07)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # the agent handles these itself


LOCK = ".zerofuse-train.lock"


def takes_out_lock(env: dict | None) -> bool:
    """Whether this process holds --out for the job: the process a user started (it launches the
    ranks, or is the world of one), or rank 0 under torchrun / SLURM; not a rank our launcher started."""
    return env is None or (env["RANK"] == "0" and os.environ.get("ZEROFUSE_TRAIN_LAUNCHED") != "1")


RANKS_LOCK = ".zerofuse-train.ranks.lock"  # shared by the ranks our launcher starts, for their lives


def _check_no_ranks_left(out: str) -> None:
    """No rank of an earlier job still writes into ``out``: the ranks our launcher started hold
    RANKS_LOCK shared (rank_lock), so it outlives a launcher that exited first (a third Ctrl-C,
    SIGUSR1, kill -9: its ranks got SIGTERM and were still saving their checkpoint when a second
    job took --out and replaced it; a review's reproduction, 2026-12-07)."""
    path = os.path.join(out, RANKS_LOCK)
    try:
        fd, _ = files.flock(path, wait=False)
    except BlockingIOError:
        raise UsageError(f"--out: ranks of an earlier {PROG} job are still running in {out} (they hold {path}; "
                         "stopped, they finish a checkpoint first); expected an --out no running job uses") from None
    os.close(fd)


@contextlib.contextmanager
def rank_lock(out: str):
    """A rank our launcher started: RANKS_LOCK held shared for the rank's life (_check_no_ranks_left)."""
    if os.environ.get("ZEROFUSE_TRAIN_LAUNCHED") != "1":
        yield
        return
    os.makedirs(out, exist_ok=True)
    fd, _ = files.flock(os.path.join(out, RANKS_LOCK), shared=True)  # (an instant's wait: another job's check)
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def out_lock(out: str):
    """--out for one job at a time: an exclusive flock on <out>/.zerofuse-train.lock for the job's
    life (the kernel drops it when the process ends, however it ends). Two jobs on one --out deleted
    each other's checkpoint in the making (a traceback mid-run) and mixed their metrics.jsonl
    lines (a review's reproduction, 2026-12-06); the second is now refused before it writes anything."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, LOCK)
    try:
        fd, locked = files.flock(path, wait=False)
    except BlockingIOError:
        with open(path, errors="replace") as f:
            holder = f.read(32).strip() or "unknown"
        raise UsageError(f"--out: another {PROG} job (pid {holder}) is writing into {out} (it holds {path}); "
                         "expected an --out no running job uses") from None
    if not locked:  # a filesystem without locks: the job runs unguarded, as before
        print(f"{PROG}: note: --out {out} does not support file locks: nothing stops a second "
              "job from writing there", file=sys.stderr, flush=True)
    else:
        try:
            _check_no_ranks_left(out)
        except UsageError:
            os.close(fd)
            raise
    try:
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], nproc: int, timeout: float = 600.0, out: str | None = None) -> int:
    """Start nproc local ranks with torch's elastic launcher, each running ``-m zerofuse.train`` with argv;
    return the exit code of the job (``out``: the job's --out, where a clean stop writes summary.json)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from . import T0  # measured when the package was imported

    # for the ranks only (they inherit our environment; a later in-process main() must not see them)
    ours = {"ZEROFUSE_TRAIN_LAUNCHED": "1",  # the ranks die with us (PR_SET_PDEATHSIG)
            "ZEROFUSE_TRAIN_LAUNCHER": str(os.getpid()),  # (and check we are alive: die_with_parent)
            "ZEROFUSE_TRAIN_T0": str(T0)}  # the summary's wall time counts the launch
    t_launch = time.time()  # (summary.json written since: a clean stop; T0 is the package's import in-process)
    before = {k: os.environ.get(k) for k in ours}
    os.environ.update(ours)
    # a stopped rank finishes its step, agrees on stopping at the next one and saves a checkpoint:
    # the agent waits that long (--timeout, the bound of a collective) before it kills the ranks it
    # signalled (torch's default, 30 s, killed them mid-checkpoint)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{_free_port()}", run_id=f"zerofuse-{uuid.uuid4().hex[:8]}",
                          max_restarts=0, monitor_interval=0.1, local_addr="127.0.0.1",
                          shutdown_timeout=max(30, int(timeout)))
    def as_agent_signal(signum, _frame):  # the others: the agent stops the ranks with them as with its own
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    before_handlers = {}
    try:
        if threading.current_thread() is threading.main_thread():  # (signal handlers: the main thread's only)
            before_handlers = {s: signal.signal(s, as_agent_signal) for s in STOP_SIGNALS if s not in _AGENT_SIGNALS}
        elastic_launch(config, sys.executable)("-m", "zerofuse.train", *argv)
    except SignalException as e:  # the launcher got the signal and stopped the ranks with it
        # (the agent has waited for them: a clean stop saved and wrote the summary; ranks that failed
        # meanwhile, a full disk at the stop's save, returned 143 as a clean stop before: a requeue
        # took it for one; a review's reproduction, 2026-12-07)
        if out is not None and _since(os.path.join(out, "metrics.jsonl"), t_launch) \
                and not _since(os.path.join(out, "summary.json"), t_launch):  # (stopped in its start: no step, no summary)
            print(f"{PROG}: stopped by {e.sigval.name}, but the ranks did not finish cleanly (no summary.json "
                  "written: their errors above say why; --resume takes the last complete checkpoint)",
                  file=sys.stderr, flush=True)
            return 1
        sig = _stopped_by(out, t_launch) or e.sigval
        print(f"{PROG}: stopped by {sig.name}", file=sys.stderr, flush=True)
        return 128 + int(sig)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        # a rank stopped cleanly (128 + signal), or by the signal's default action outside the
        # training loop (-signal: waiting for its peers, building the model; _StopFlag)
        stopped = {128 + int(s) for s in STOP_SIGNALS} | {-int(s) for s in STOP_SIGNALS}
        if codes <= stopped:
            return max(128 + abs(c) if c < 0 else c for c in codes)
        for rank, f in sorted(e.failures.items()):
            print(f"{PROG}: rank {rank} failed with exit code {f.exitcode}", file=sys.stderr, flush=True)
        return EXIT_USAGE if codes == {EXIT_USAGE} else 1
    finally:
        for s, h in before_handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0


def _stopped_by(out: str | None, t0: float):
    """The signal the ranks stopped on, as the summary.json they wrote since ``t0`` says: the agent
    raises the last signal the launcher got (SIGTERM then SIGUSR1 during the stop's save: the ranks
    stopped on SIGTERM, the launcher said SIGUSR1 and exited 138; a review's reproduction, 2026-12-07)."""
    path = os.path.join(out, "summary.json") if out is not None else None
    if path is None or not _since(path, t0):
        return None
    try:
        with open(path) as f:
            name = json.load(f).get("stopped_by")
        return signal.Signals[name] if name in signal.Signals.__members__ else None
    except (OSError, ValueError, AttributeError):
        return None


def _since(path: str, t0: float) -> bool:
    """Whether ``path`` was written since ``t0`` (time.time())."""
    try:
        return os.path.getmtime(path) >= t0
    except OSError:
        return False


def die_with_parent() -> None:
    """Ranks started by launch(): SIGTERM (a clean stop) when the launcher dies, however it died;
    armed first thing in main(), and a rank whose launcher died before that (during the imports)
    ends at once (it waited STARTUP_S in the rendezvous, orphaned; a review's reproduction)."""
    if os.environ.get("ZEROFUSE_TRAIN_LAUNCHED") != "1" or not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except OSError:
        pass
    launcher = os.environ.get("ZEROFUSE_TRAIN_LAUNCHER", "")
    if launcher.isdigit() and os.getppid() != int(launcher):
        os._exit(128 + int(signal.SIGTERM))


# ---------------------------------------------------------------------------------------------- ranks

class _StopFlag:
    """The signal a rank got (0: none). While the training loop runs (arm() to restore()), signals
    only set it: the loop agrees on stopping at the next step boundary, so a checkpoint is always
    saved by every rank together. Outside it (waiting for the peers, building the model and data;
    sampling and export after a loop that ended unstopped) they take their default action and end
    the rank at once: a handler that only set the flag left a rank waiting in the rendezvous or
    sampling for minutes, until the agent killed it or forever (a blocking wait in C never runs a
    Python handler, nor raises KeyboardInterrupt, until it returns)."""

    def __init__(self):
        self.signum = 0
        self._before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self.default()

    def arm(self) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, self._handler)

    def default(self) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)

    def restore(self) -> None:
        """The handlers the process had before (an in-process caller's Ctrl-C)."""
        for s, h in self._before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)

    def _handler(self, signum, _frame):
        self.signum = self.signum or signum


def _init_distributed(args, env: dict | None):
    import torch.distributed as dist
    local_rank = int(env["LOCAL_RANK"] or 0) if env else 0
    local_world = int(env["LOCAL_WORLD_SIZE"] or args.world) if env else 1
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # the cores shared among the ranks on this host, unless OMP_NUM_THREADS says otherwise
        # (torch has read it already; torchrun sets it to 1 for several local ranks)
        if not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    backend = "nccl" if args.device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=args.timeout)  # init_mesh's groups and their Communicators inherit it
    if env is None:  # a world of one in this process: ZeRO still goes through a process group
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        _slurm_endpoint()
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        dist.init_process_group(backend, store=_rendezvous(rank, world, timeout), rank=rank, world_size=world,
                                timeout=timeout)
    return device


STARTUP_S = 300.0  # how far apart the ranks may start, whatever --timeout


def _rendezvous(rank: int, world: int, timeout: datetime.timedelta):
    """The job's store (env://, torchrun's agent store where it hosts one), once every rank has
    reached it. --timeout bounds the collectives, but a group's connection also waits for its
    peers within it, and ranks start seconds apart (the interpreter and imports on a loaded
    machine: a 3 s --timeout failed in connectFullMesh in CI, 2026-11-27). So the ranks first meet
    on the store, allowing STARTUP_S; then the store and the group take --timeout. A rank refused
    at its start (abort_rendezvous) has left word there: the others exit 2 at once."""
    import torch.distributed as dist

    start = datetime.timedelta(seconds=max(timeout.total_seconds(), STARTUP_S))
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=start))
    key = _arrival_key()
    if store.add(key, 1) == world:
        store.set(key + "/all", "1")
    store.wait([key + "/all"])
    if store.check([key + "/abort"]):  # (the refused rank printed why)
        if rank == 0:
            who = store.get(key + "/abort").decode()
            print(f"{PROG}: error: rank {who} was refused at its start (its error says why); every rank stops",
                  file=sys.stderr, flush=True)
            _wait_abort_seen(store, key, world)  # (the store lives in this process: a third rank's read of the
        else:  # flag failed with a closed connection when rank 0 left at once: a review's reproduction)
            store.add(key + "/abort_seen", 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_USAGE)
    store.set_timeout(timeout)
    return store


def _arrival_key() -> str:
    # (a restart meets anew; under SLURM the job and step are in the key: a rank of another job
    # that reached this store on a shared port waits for its own peers and fails at STARTUP_S
    # instead of joining this job's group)
    job = f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}"
    return f"zerofuse/arrived/{job}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


ABORT_WAIT_S = 60.0  # how long rank 0 (the store's host) waits for its peers to hear of a refused rank


def _wait_abort_seen(store, key: str, world: int) -> None:
    """Rank 0, the store's host: until every other rank has read the abort (or ABORT_WAIT_S)."""
    deadline = time.monotonic() + ABORT_WAIT_S
    while store.add(key + "/abort_seen", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def abort_rendezvous(env: dict) -> None:
    """A rank of a torchrun/SLURM job refused at its start (--out held by another job; a --data
    missing on its node): meet the others at the rendezvous and tell them to exit too (under srun
    without --kill-on-bad-exit they waited STARTUP_S for a rank 0 that had gone; a rank other than 0
    left silently and rank 0 waited 600 s: reviews' reproductions, 2026-12-07). Best effort: peers
    that do not come within ABORT_WAIT_S are left to their own rendezvous timeout."""
    import torch.distributed as dist

    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    if world < 2:
        return
    _slurm_endpoint()
    try:
        wait = datetime.timedelta(seconds=ABORT_WAIT_S)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=wait))
        key = _arrival_key()
        store.set(key + "/abort", str(rank))
        if rank != 0:  # (rank 0 hosts the store: it waits for every other rank to have read it)
            store.add(key + "/abort_seen", 1)
        if store.add(key, 1) == world:
            store.set(key + "/all", "1")
        if rank == 0:  # (the store lives in this process: it stays until they have read it)
            _wait_abort_seen(store, key, world)
    except Exception:  # noqa: BLE001 - (the refusal was printed; nothing more to tell)
        pass
