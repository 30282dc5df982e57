"""Pipeline-parallel schedules as per-rank action lists (pure Python, no torch).

``build_schedule(name, p, m, v)`` returns one list of :class:`Action` per pipeline rank: the
compute passes in the order the rank runs them, with the point-to-point actions placed around
them (a RECV right before the pass that consumes it, a SEND right after the pass that produces
it) and one ``REDUCE_GRAD`` marker per stage after that stage's last backward work.

Stages are virtual: there are ``S = p * v`` of them and stage ``s`` lives on rank ``s % p``
(Megatron's looped placement), so rank ``r`` holds stages ``r, r + p, ..., r + (v - 1) * p``.
"""
from typing import NamedTuple

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS + ("REDUCE_GRAD",)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")

_PREFIX = "zerofuse.pipeline: "


class Action(NamedTuple):
    """One step of a rank's schedule.

    ``kind`` is one of :data:`KINDS`; ``stage`` the virtual stage (0..S-1); ``mb`` the
    micro-batch (-1 for ``REDUCE_GRAD``); ``peer`` the other rank of a SEND/RECV (-1 otherwise).
    ``SEND_F(s)`` pairs with ``RECV_F(s + 1)``; ``SEND_B(s)`` pairs with ``RECV_B(s - 1)``.
    """

    kind: str
    stage: int
    mb: int
    peer: int = -1

    def __str__(self):
        if self.kind in COMPUTE_KINDS:
            return f"{self.kind}{self.mb}s{self.stage}"
        if self.kind == "REDUCE_GRAD":
            return f"REDUCE_GRAD(s{self.stage})"
        arrow = "->" if self.kind.startswith("SEND") else "<-"
        return f"{self.kind}(s{self.stage},mb{self.mb}){arrow}r{self.peer}"


def stage_to_rank(stage: int, p: int) -> int:
    """Rank owning virtual stage ``stage`` under the looped placement."""
    return stage % p


def _check_int(name, value, what, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_PREFIX}{name} ({what}) must be an int >= {minimum}, got {value!r}")


def _check_args(name, p, m, v):
    if name not in SCHEDULES:
        raise ValueError(f"{_PREFIX}unknown schedule name {name!r}; known: {', '.join(SCHEDULES)}")
    _check_int("p", p, "number of pipeline ranks")
    _check_int("m", m, "number of micro-batches")
    _check_int("v", v, "virtual stages per rank")
    if name != "interleaved" and v != 1:
        raise ValueError(f"{_PREFIX}schedule {name!r} needs v == 1 (one stage per rank), got v={v}; "
                         f"use 'interleaved' for v > 1")
    if name == "interleaved" and (m < p or m % p):
        raise ValueError(f"{_PREFIX}interleaved 1F1B needs the number of micro-batches m to be a "
                         f"multiple of p (and m >= p), got m={m}, p={p}")


def _gpipe(p, m):
    return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)]


def _one_f_one_b(p, m):
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops = [("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", r, warm + i), ("B", r, i)]
        ops += [("B", r, i) for i in range(m - warm, m)]
        out.append(ops)
    return out


def interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    """Warm-up chunk-forward count of ``rank`` in interleaved 1F1B.

    For ``v > 1`` this is current Megatron-core's ``(p - rank - 1) * 2 + (v - 1) * p`` capped at
    ``m * v`` (older Megatron ran all ``m * v`` forwards first whenever ``m == p``; both give the
    same bubble, the cap keeps fewer activations on the later ranks). For ``v == 1`` it is
    1F1B's ``p - rank - 1`` (capped at ``m``), so the schedule is exactly "1f1b".
    """
    if v == 1:
        return min(p - rank - 1, m)
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def _interleaved(p, m, v):
    total = m * v

    def item(k, forward):
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    out = []
    for r in range(p):
        warm = interleaved_warmup(p, m, v, r)
        ops = []
        for k in range(warm):
            c, i = item(k, True)
            ops.append(("F", c * p + r, i))
        for k in range(total - warm):
            c, i = item(warm + k, True)
            ops.append(("F", c * p + r, i))
            c, i = item(k, False)
            ops.append(("B", c * p + r, i))
        for k in range(total - warm, total):
            c, i = item(k, False)
            ops.append(("B", c * p + r, i))
        out.append(ops)
    return out


def _zero_bubble_h1(p, m):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with B split into I and W.

    Rank ``r`` runs 1F1B's order with each B replaced by I (so at most ``min(p - r, m)``
    micro-batches sit between F and I, as in 1F1B) and runs W of micro-batch ``k - r`` right
    after I of micro-batch ``k``: the last ranks, whose I passes come first, hold their W
    passes back, and the ``r`` W passes still pending after the last I fill the tail bubble.
    Every rank then holds at most ``min(p, m)`` micro-batches between F and W. With unit costs
    F = I = W = 1 and ``m >= p`` each rank idles ``p - 1`` units, a third of 1F1B's
    ``3 * (p - 1)`` with F = 1, B = 2 (the same work); a greedy list scheduler that fills
    bubbles with W passes reaches the same figure but lets pending W passes (whose saved inputs
    stay alive) pile up to ``m`` on the last rank.
    """
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops = [("F", r, i) for i in range(warm)]
        for k in range(m):
            if k + warm < m:
                ops.append(("F", r, k + warm))
            ops.append(("I", r, k))
            if k >= r:
                ops.append(("W", r, k - r))
        ops += [("W", r, i) for i in range(max(m - r, 0), m)]
        out.append(ops)
    return out


def _with_comm(compute, p, v):
    """Place SEND/RECV around the compute passes and REDUCE_GRAD after each stage's last grad work."""
    last_stage = p * v - 1
    out = []
    for r, ops in enumerate(compute):
        last_grad = {}
        for idx, (kind, s, _) in enumerate(ops):
            if kind in ("B", "W"):
                last_grad[s] = idx
        acts = []
        for idx, (kind, s, i) in enumerate(ops):
            if kind == "F":
                src, dst = s - 1, s + 1
                recv, send = "RECV_F", "SEND_F"
            elif kind in ("B", "I"):
                src, dst = s + 1, s - 1
                recv, send = "RECV_B", "SEND_B"
            else:
                src = dst = None
            if src is not None and 0 <= src <= last_stage and stage_to_rank(src, p) != r:
                acts.append(Action(recv, s, i, stage_to_rank(src, p)))
            acts.append(Action(kind, s, i))
            if dst is not None and 0 <= dst <= last_stage and stage_to_rank(dst, p) != r:
                acts.append(Action(send, s, i, stage_to_rank(dst, p)))
            if last_grad.get(s) == idx:
                acts.append(Action("REDUCE_GRAD", s, -1))
        out.append(acts)
    return out


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list:
    """Per-rank action lists of schedule ``name`` for ``p`` ranks, ``m`` micro-batches, ``v`` chunks.

    ``name`` is one of ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (needs m a multiple of p)
    or ``"zb"`` (ZB-H1); all but ``"interleaved"`` need ``v == 1``.
    """
    _check_args(name, p, m, v)
    if name == "gpipe":
        compute = _gpipe(p, m)
    elif name == "1f1b":
        compute = _one_f_one_b(p, m)
    elif name == "interleaved":
        compute = _interleaved(p, m, v)
    else:
        compute = _zero_bubble_h1(p, m)
    return _with_comm(compute, p, v)


def bubble_fraction(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of the step, ``(p - 1) / (v * m + p - 1)``, for gpipe, 1f1b and interleaved.

    With unit costs F = 1, B = 2 (per chunk for interleaved) every rank is idle for exactly
    this fraction of the makespan. ``"zb"`` has no closed form here: it raises ValueError; use
    ``simulate(build_schedule("zb", p, m), p, costs={"F": 1, "I": 1, "W": 1})`` instead.
    """
    _check_args(name, p, m, v)
    if name == "zb":
        raise ValueError(f"{_PREFIX}bubble_fraction has no closed form for name='zb'; simulate "
                         f"build_schedule('zb', p, m) with zerofuse.pipeline.simulate instead")
    return (p - 1) / (v * m + p - 1)
