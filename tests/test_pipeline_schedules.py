"""zerofuse.pipeline schedules and their dry-run simulator (pure Python, no GPU, no collectives)."""
import pytest

from zerofuse.pipeline import (Action, PipelineDeadlock, bubble_fraction, build_schedule,
                               simulate, validate)
from zerofuse.pipeline.schedules import interleaved_warmup

UNIT_SPLIT = {"F": 1, "I": 1, "W": 1}   # zb: same total work per micro-batch as F=1, B=2
P_VALUES = (1, 2, 3, 4)
M_VALUES = range(1, 9)


def _grid():
    for p in P_VALUES:
        for m in M_VALUES:
            for name in ("gpipe", "1f1b", "zb"):
                yield name, p, m, 1
            if m % p == 0:
                for v in (1, 2, 3):
                    yield "interleaved", p, m, v


GRID = list(_grid())


def _costs(name):
    return UNIT_SPLIT if name == "zb" else None


@pytest.mark.parametrize("name,p,m,v", GRID, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in GRID])
def test_valid_and_deadlock_free(name, p, m, v):
    sched = build_schedule(name, p, m, v)
    assert len(sched) == p
    validate(sched, p, m, v)
    for comm in (0.0, 0.5):
        res = simulate(sched, p, costs=_costs(name), comm=comm)
        assert len(res.trace) == sum(len(acts) for acts in sched)
    if p == 1:
        assert not any(a.kind.startswith(("SEND", "RECV")) for a in sched[0])
    reduces = [a for acts in sched for a in acts if a.kind == "REDUCE_GRAD"]
    assert sorted(a.stage for a in reduces) == list(range(p * v))


@pytest.mark.parametrize("name,p,m,v", [g for g in GRID if g[0] != "zb"])
def test_idle_fraction_matches_bubble_formula(name, p, m, v):
    res = simulate(build_schedule(name, p, m, v), p, costs={"F": 1, "B": 2})
    expected = bubble_fraction(name, p, m, v)
    assert expected == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    for frac in res.idle_fraction:
        assert frac == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("m", M_VALUES)
def test_zero_bubble_beats_1f1b(p, m):
    one = simulate(build_schedule("1f1b", p, m), p, costs={"F": 1, "B": 2})
    zb = simulate(build_schedule("zb", p, m), p, costs=UNIT_SPLIT)
    assert sum(zb.busy) == pytest.approx(sum(one.busy))
    assert max(zb.idle_fraction) < max(one.idle_fraction)
    if m == 2 * p:
        assert max(zb.idle_fraction) < 0.5 * max(one.idle_fraction)
    if m >= p:
        # ZB-H1's bubble: (p - 1) * (F + I - W) = p - 1 time units on every rank.
        for frac in zb.idle_fraction:
            assert frac == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9)


@pytest.mark.parametrize("p,m,zb_idle,one_idle", [(2, 4, 1 / 13, 1 / 5), (4, 8, 3 / 27, 3 / 11)])
def test_zero_bubble_figures(p, m, zb_idle, one_idle):
    one = simulate(build_schedule("1f1b", p, m), p)
    zb = simulate(build_schedule("zb", p, m), p, costs=UNIT_SPLIT)
    assert max(one.idle_fraction) == pytest.approx(one_idle, abs=1e-9)
    assert max(zb.idle_fraction) == pytest.approx(zb_idle, abs=1e-9)


def test_zero_bubble_shape():
    sched = build_schedule("zb", 3, 6)
    for r, acts in enumerate(sched):
        kinds = [a.kind for a in acts if a.kind in ("F", "B", "I", "W")]
        assert "B" not in kinds and kinds.count("I") == kinds.count("W") == kinds.count("F") == 6
        assert acts[-1] == Action("REDUCE_GRAD", r, -1)
        # W of micro-batch k - r runs right after I of micro-batch k; r W passes fill the tail.
        compute = [a for a in acts if a.kind in ("F", "I", "W")]
        for k in range(r, 6):
            i = compute.index(Action("I", r, k))
            assert compute[i + 1] == Action("W", r, k - r)
        assert [a.kind for a in compute[len(compute) - r:]] == ["W"] * r


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
def test_peak_live(p, m):
    gpipe = simulate(build_schedule("gpipe", p, m), p)
    one = simulate(build_schedule("1f1b", p, m), p)
    zb = simulate(build_schedule("zb", p, m), p, costs=UNIT_SPLIT)
    assert gpipe.peak_live == [m] * p
    assert one.peak_live == [min(p - s, m) for s in range(p)]
    assert zb.peak_live == one.peak_live
    assert one.peak_held == one.peak_live and gpipe.peak_held == gpipe.peak_live
    # ZB-H1 keeps min(p, m) micro-batches between F and W on every stage (1F1B's first stage).
    assert zb.peak_held == [min(p, m)] * p


@pytest.mark.parametrize("p,m,v", [g[1:] for g in GRID if g[0] == "interleaved"])
def test_interleaved_peak_live_megatron_bound(p, m, v):
    res = simulate(build_schedule("interleaved", p, m, v), p)
    for r in range(p):
        # Megatron keeps warm-up + 1 chunk forwards in flight per rank (all m*v when capped).
        assert res.peak_live_rank[r] == min(interleaved_warmup(p, m, v, r) + 1, m * v)
    assert all(1 <= x <= m for x in res.peak_live)
    assert res.peak_live[p * v - 1] == 1


@pytest.mark.parametrize("p", P_VALUES)
def test_interleaved_v1_is_1f1b(p):
    for m in range(p, 9, p):
        assert build_schedule("interleaved", p, m, 1) == build_schedule("1f1b", p, m)


def test_interleaved_figures():
    res = simulate(build_schedule("interleaved", 4, 8, 2), 4)
    assert res.peak_live == [8, 8, 7, 5, 4, 4, 3, 1]
    assert res.peak_live_rank == [11, 9, 7, 5]


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_p2p_order(name, p, m, v):
    # With the looped placement and RECV right before its consumer, every schedule here posts
    # and receives each rank pair's messages in the same order (NCCL-safe, not only gloo-safe).
    assert simulate(build_schedule(name, p, m, v), p, costs=_costs(name)).p2p_order_mismatches == []


def test_action_str():
    assert str(Action("F", 1, 3)) == "F3s1"
    assert str(Action("SEND_F", 1, 3, 2)) == "SEND_F(s1,mb3)->r2"
    assert str(Action("RECV_B", 0, 2, 1)) == "RECV_B(s0,mb2)<-r1"
    assert str(Action("REDUCE_GRAD", 4, -1)) == "REDUCE_GRAD(s4)"


def test_1f1b_p2_m1_actions():
    assert build_schedule("1f1b", 2, 1) == [
        [Action("F", 0, 0), Action("SEND_F", 0, 0, 1), Action("RECV_B", 0, 0, 1),
         Action("B", 0, 0), Action("REDUCE_GRAD", 0, -1)],
        [Action("RECV_F", 1, 0, 0), Action("F", 1, 0), Action("B", 1, 0),
         Action("SEND_B", 1, 0, 0), Action("REDUCE_GRAD", 1, -1)],
    ]


def test_deadlock_both_ranks_receive_first():
    sched = build_schedule("1f1b", 2, 1)
    recv = sched[0].pop(2)
    sched[0].insert(0, recv)            # rank 0 now waits for a grad before running its forward
    validate(sched, 2, 1)               # structurally fine, only the order deadlocks
    with pytest.raises(PipelineDeadlock) as err:
        simulate(sched, 2)
    msg = str(err.value)
    assert "rank 0 waits at RECV_B(s0,mb0)<-r1" in msg
    assert "rank 1 waits at RECV_F(s1,mb0)<-r0" in msg
    assert isinstance(err.value, RuntimeError)


def test_deadlock_sender_never_sends():
    sched = build_schedule("gpipe", 2, 2)
    sched[0] = [a for a in sched[0] if a != Action("SEND_F", 0, 1, 1)]
    with pytest.raises(PipelineDeadlock, match=r"rank 1 waits at RECV_F\(s1,mb1\)<-r0: rank 0 never sends it"):
        simulate(sched, 2)
    with pytest.raises(ValueError, match=r"RECV_F\(s1,mb1\)<-r0: RECV without a matching SEND"):
        validate(sched, 2, 2)


def test_validate_send_without_recv():
    sched = build_schedule("1f1b", 3, 4)
    sched[1] = [a for a in sched[1] if a != Action("RECV_F", 1, 2, 0)]
    with pytest.raises(ValueError, match=r"SEND_F\(s0,mb2\)->r1: SEND without a matching RECV"):
        validate(sched, 3, 4)


def test_validate_order_errors():
    sched = build_schedule("zb", 2, 2)
    acts = sched[1]
    i, w = acts.index(Action("I", 1, 0)), acts.index(Action("W", 1, 0))
    acts[i], acts[w] = acts[w], acts[i]
    with pytest.raises(ValueError, match=r"W0s1: W before I0s1"):
        validate(sched, 2, 2)
    sched = build_schedule("1f1b", 2, 2)
    sched[0].remove(Action("B", 0, 1))
    with pytest.raises(ValueError, match="stage 0 mb 1 needs one B"):
        validate(sched, 2, 2)
    sched = build_schedule("1f1b", 2, 2)
    sched[1].insert(0, Action("F", 0, 0))
    with pytest.raises(ValueError, match="stage 0 lives on rank 0"):
        validate(sched, 2, 2)


@pytest.mark.parametrize("args,pattern", [
    (("interleaved", 4, 2, 2), r"micro-batches m .* multiple of p.*m=2, p=4"),
    (("interleaved", 4, 6, 2), r"micro-batches m .* multiple of p.*m=6, p=4"),
    (("1f1b", 2, 4, 2), r"'1f1b' needs v == 1.*got v=2"),
    (("gpipe", 2, 4, 3), r"'gpipe' needs v == 1.*got v=3"),
    (("zb", 2, 4, 2), r"'zb' needs v == 1.*got v=2"),
    (("nope", 2, 4), r"unknown schedule name 'nope'; known: gpipe, 1f1b, interleaved, zb"),
    (("1f1b", 0, 4), r"\bp \(number of pipeline ranks\) must be an int >= 1, got 0"),
    (("1f1b", 2, 0), r"\bm \(number of micro-batches\) must be an int >= 1, got 0"),
    (("interleaved", 2, 4, 0), r"\bv \(virtual stages per rank\) must be an int >= 1, got 0"),
])
def test_bad_input(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_schedule(*args)
    with pytest.raises(ValueError, match=pattern):
        bubble_fraction(*args)


def test_bubble_fraction_zb_has_no_formula():
    with pytest.raises(ValueError, match="no closed form for name='zb'"):
        bubble_fraction("zb", 2, 4)


def test_simulate_bad_costs():
    sched = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="costs"):
        simulate(sched, 2, costs={"X": 1})
    with pytest.raises(ValueError, match="comm"):
        simulate(sched, 2, comm=-1)
