"""Dry run of pipeline schedules: a discrete-event simulation and a structural validator.

Pure Python (no torch). A SEND never blocks: its message is available ``comm`` time units
after it executes. A RECV blocks until the SEND it pairs with (same direction, stage and
micro-batch, from the named peer) has executed and its message has arrived. Compute actions
cost ``costs[kind]``; SEND/RECV/REDUCE_GRAD cost nothing by themselves.
"""
from collections import defaultdict, deque
from dataclasses import dataclass, field

from .schedules import COMM_KINDS, COMPUTE_KINDS, KINDS, Action, stage_to_rank

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
_PREFIX = "zerofuse.pipeline: "


class PipelineDeadlock(RuntimeError):
    """No rank can make progress while some still have actions left."""


@dataclass
class SimResult:
    """Outcome of :func:`simulate`.

    ``busy[r]`` is rank r's compute time and ``idle_fraction[r] = 1 - busy[r] / makespan``.
    ``peak_live[s]``: most micro-batches at once whose F on stage s ran and whose B (or I) has
    not; ``peak_live_rank[r]`` the same summed over rank r's stages; ``peak_held[s]``: the same
    up to B (or W), i.e. until the stage's saved inputs can be dropped. ``trace`` lists
    ``(rank, action, t0, t1)`` in execution order (a RECV's ``t0`` is when the rank reached it,
    ``t1`` when the message was there). ``p2p_order_mismatches``: see
    :func:`p2p_order_mismatches`.
    """

    makespan: float
    busy: list
    idle_fraction: list
    peak_live: list
    peak_live_rank: list
    peak_held: list
    trace: list = field(repr=False)
    p2p_order_mismatches: list = field(default_factory=list)


def _message_key(rank, a):
    """(direction, src rank, dst rank, sender's stage, mb): what a SEND posts / a RECV waits for."""
    if a.kind == "SEND_F":
        return ("F", rank, a.peer, a.stage, a.mb)
    if a.kind == "SEND_B":
        return ("B", rank, a.peer, a.stage, a.mb)
    if a.kind == "RECV_F":
        return ("F", a.peer, rank, a.stage - 1, a.mb)
    return ("B", a.peer, rank, a.stage + 1, a.mb)


def p2p_order_mismatches(schedule) -> list:
    """Ordered rank pairs ``(a, b)`` whose SEND order a->b differs from b's RECV order from a.

    NCCL pairs point-to-point operations between two ranks by issue order (gloo by tag), so a
    non-empty result means the schedule is only safe with tagged (or reordered) receives.
    """
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, acts in enumerate(schedule):
        for a in acts:
            if a.kind in ("SEND_F", "SEND_B"):
                sends[(r, a.peer)].append(_message_key(r, a))
            elif a.kind in ("RECV_F", "RECV_B"):
                recvs[(a.peer, r)].append(_message_key(r, a))
    return sorted(pair for pair in set(sends) | set(recvs) if sends[pair] != recvs[pair])


def _deadlock_message(schedule, pos):
    lines = []
    for r, acts in enumerate(schedule):
        if pos[r] >= len(acts):
            continue
        a = acts[pos[r]]
        q = a.peer
        if not 0 <= q < len(schedule):
            lines.append(f"rank {r} waits at {a}: peer rank {q} does not exist")
            continue
        want = _message_key(r, a)
        later = [b for b in schedule[q][pos[q]:]
                 if b.kind in ("SEND_F", "SEND_B") and _message_key(q, b) == want]
        if not later:
            lines.append(f"rank {r} waits at {a}: rank {q} never sends it")
        elif pos[q] < len(schedule[q]):
            lines.append(f"rank {r} waits at {a}: rank {q} sends it ({later[0]}) only after "
                         f"{schedule[q][pos[q]]}, where rank {q} is stuck")
    return f"{_PREFIX}pipeline deadlock: " + "; ".join(lines)


def simulate(schedule, p: int, *, costs: dict = None, comm: float = 0.0) -> SimResult:
    """Run the per-rank action lists ``schedule`` of ``p`` ranks; raise PipelineDeadlock if stuck."""
    if len(schedule) != p:
        raise ValueError(f"{_PREFIX}schedule has {len(schedule)} rank lists but p={p}")
    cost = dict(DEFAULT_COSTS)
    for k, c in (costs or {}).items():
        if k not in COMPUTE_KINDS or not isinstance(c, (int, float)) or c < 0:
            raise ValueError(f"{_PREFIX}costs must map kinds {COMPUTE_KINDS} to numbers >= 0, "
                             f"got {k!r}: {c!r}")
        cost[k] = float(c)
    if not isinstance(comm, (int, float)) or comm < 0:
        raise ValueError(f"{_PREFIX}comm (message latency) must be a number >= 0, got {comm!r}")
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    posted = defaultdict(deque)
    trace = []
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            acts = schedule[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                t0 = clock[r]
                if a.kind in COMPUTE_KINDS:
                    clock[r] += cost[a.kind]
                    busy[r] += cost[a.kind]
                elif a.kind in ("SEND_F", "SEND_B"):
                    posted[_message_key(r, a)].append(t0 + comm)
                elif a.kind in ("RECV_F", "RECV_B"):
                    queue = posted[_message_key(r, a)]
                    if not queue:
                        break
                    clock[r] = max(t0, queue.popleft())
                elif a.kind != "REDUCE_GRAD":
                    raise ValueError(f"{_PREFIX}rank {r}: unknown action kind in {a!r}")
                trace.append((r, a, t0, clock[r]))
                pos[r] += 1
                progressed = True
    if any(pos[r] < len(schedule[r]) for r in range(p)):
        raise PipelineDeadlock(_deadlock_message(schedule, pos))
    makespan = max(clock) if p else 0.0
    idle = [1.0 - b / makespan if makespan > 0 else 0.0 for b in busy]
    n_stages = 1 + max((a.stage for acts in schedule for a in acts), default=-1)
    peak, peak_rank, peak_held = [0] * n_stages, [0] * p, [0] * n_stages
    for r, acts in enumerate(schedule):
        live, held, total = [0] * n_stages, [0] * n_stages, 0
        for a in acts:
            if a.kind == "F":
                live[a.stage] += 1
                held[a.stage] += 1
                total += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
                peak_held[a.stage] = max(peak_held[a.stage], held[a.stage])
                peak_rank[r] = max(peak_rank[r], total)
            if a.kind in ("B", "I"):
                live[a.stage] -= 1
                total -= 1
            if a.kind in ("B", "W"):
                held[a.stage] -= 1
    return SimResult(makespan, busy, idle, peak, peak_rank, peak_held, trace,
                     p2p_order_mismatches(schedule))


def _fail(r, idx, a, why):
    raise ValueError(f"{_PREFIX}invalid schedule: rank {r} action #{idx} {a}: {why}")


def validate(schedule, p: int, m: int, v: int = 1) -> None:
    """Check ``schedule`` is a complete, well-ordered schedule; raise ValueError naming the offender.

    Every (stage, mb) gets exactly one F and either one B or one I and one W, on the stage's
    owning rank, with B/I after F and W after I; a pass whose producer lives on another rank is
    preceded by the RECV of that value from the right peer, and a pass whose consumer lives on
    another rank is followed by the SEND; every SEND has exactly one matching RECV and vice
    versa; each stage has exactly one REDUCE_GRAD, on its owner, after all of its B/W.
    """
    if len(schedule) != p:
        raise ValueError(f"{_PREFIX}invalid schedule: {len(schedule)} rank lists but p={p}")
    n_stages = p * v
    seen = {}                       # (kind, stage, mb) -> (rank, index)
    reduce_at = {}
    pending = defaultdict(int)      # message key -> sends minus recvs
    first = {}                      # message key -> (rank, idx, action) first seen
    for r, acts in enumerate(schedule):
        for idx, a in enumerate(acts):
            if not isinstance(a, Action) or a.kind not in KINDS:
                _fail(r, idx, a, f"not an Action with kind in {KINDS}")
            if not 0 <= a.stage < n_stages:
                _fail(r, idx, a, f"stage out of range 0..{n_stages - 1}")
            if stage_to_rank(a.stage, p) != r:
                _fail(r, idx, a, f"stage {a.stage} lives on rank {stage_to_rank(a.stage, p)}")
            if a.kind == "REDUCE_GRAD":
                if a.stage in reduce_at:
                    _fail(r, idx, a, "second REDUCE_GRAD for this stage")
                reduce_at[a.stage] = idx
                continue
            if not 0 <= a.mb < m:
                _fail(r, idx, a, f"micro-batch out of range 0..{m - 1}")
            if a.kind in COMM_KINDS:
                fwd = a.kind.endswith("_F")
                other = a.stage + (1 if fwd == a.kind.startswith("SEND") else -1)
                if not 0 <= other < n_stages or a.peer != stage_to_rank(other, p) or a.peer == r:
                    _fail(r, idx, a, f"no remote stage {other} to talk to, or wrong peer")
                key = _message_key(r, a)
                pending[key] += 1 if a.kind.startswith("SEND") else -1
                first.setdefault(key, (r, idx, a))
            k = (a.kind, a.stage, a.mb)
            if k in seen:
                _fail(r, idx, a, f"duplicate (also action #{seen[k][1]})")
            seen[k] = (r, idx)
    for key, n in pending.items():
        if n:
            r, idx, a = first[key]
            _fail(r, idx, a, "SEND without a matching RECV" if n > 0 else "RECV without a matching SEND")
    for s in range(n_stages):
        r = stage_to_rank(s, p)
        acts = schedule[r]
        for i in range(m):
            f = seen.get(("F", s, i))
            if f is None:
                raise ValueError(f"{_PREFIX}invalid schedule: F{i}s{s} missing on rank {r}")
            b, ii, w = (seen.get((k, s, i)) for k in ("B", "I", "W"))
            if not ((b and not ii and not w) or (ii and w and not b)):
                raise ValueError(f"{_PREFIX}invalid schedule: stage {s} mb {i} needs one B or one "
                                 f"I and one W on rank {r}")
            grad = b or ii
            if grad[1] < f[1]:
                _fail(r, grad[1], acts[grad[1]], f"backward before F{i}s{s}")
            if w and w[1] < ii[1]:
                _fail(r, w[1], acts[w[1]], f"W before I{i}s{s}")
            _check_links(schedule, seen, p, n_stages, s, i, f[1], True)
            _check_links(schedule, seen, p, n_stages, s, i, grad[1], False)
        if s not in reduce_at:
            raise ValueError(f"{_PREFIX}invalid schedule: no REDUCE_GRAD for stage {s} on rank {r}")
        last = max(seen.get((k, s, i), (r, -1))[1] for k in ("B", "W") for i in range(m))
        if reduce_at[s] < last:
            _fail(r, reduce_at[s], acts[reduce_at[s]], "REDUCE_GRAD before the stage's last B/W")


def _check_links(schedule, seen, p, n_stages, s, i, here, forward):
    """Pass at index ``here`` (F if ``forward`` else B/I) of (s, i) gets its input and ships its output."""
    r = stage_to_rank(s, p)
    acts = schedule[r]
    src, dst = (s - 1, s + 1) if forward else (s + 1, s - 1)
    d = "F" if forward else "B"
    if 0 <= src < n_stages:
        q = stage_to_rank(src, p)
        if q == r:
            prods = [seen.get((k, src, i)) for k in (("F",) if forward else ("B", "I"))]
            if not any(x and x[1] < here for x in prods):
                _fail(r, here, acts[here], f"runs before its local input from stage {src}")
        else:
            got = seen.get((f"RECV_{d}", s, i))
            if got is None or got[1] > here:
                _fail(r, here, acts[here], f"no RECV_{d} from rank {q} before it")
    if 0 <= dst < n_stages and stage_to_rank(dst, p) != r:
        put = seen.get((f"SEND_{d}", s, i))
        if put is None or put[1] < here:
            _fail(r, here, acts[here], f"no SEND_{d} to rank {stage_to_rank(dst, p)} after it")
