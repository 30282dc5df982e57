"""zerofuse.parallel.init_mesh's groups as the rest of the library sees them, on real gloo ranks: the
collective checker names ranks globally on a mesh's subgroups, and a backend torch does not know is
refused by name on every rank (a review's reproductions, 2026-12-07)."""
from __future__ import annotations

import os

import torch

from dist_utils import error_text, run_distributed


def _tp_mismatch_rank(rank, ws):
    import zerofuse
    from zerofuse.comm import CollectiveMismatch, Communicator

    os.environ["ZEROFUSE_CHECK_COLLECTIVES"] = "1"
    mesh = zerofuse.parallel.init_mesh(dp=2, tp=2)
    comm = Communicator(mesh.tp_group, timeout=20)
    n = 5 if rank == 3 else 4  # global rank 3 (rank 1 of the TP group [2, 3]) differs
    try:
        comm.all_reduce_coalesced([torch.ones(n)], op="sum").wait()
    except CollectiveMismatch as e:
        return str(e)
    return "no error"


def test_checker_names_global_ranks_on_a_subgroup():
    """A mismatch on the TP group [2, 3] was reported as between "rank(s) [0]" and "rank(s) [1]":
    the group's own numbers, which are other ranks of the world (busy elsewhere)."""
    out = run_distributed(_tp_mismatch_rank, 4, timeout=90)
    assert out[:2] == ["no error", "no error"], out
    for msg in out[2:]:
        assert ("collective #0 differs across ranks (a group of ranks [2, 3]): rank(s) [2]: "
                "all_reduce_coalesced(tensors=[(4,):float32]" in msg), msg
        assert "rank(s) [3]: all_reduce_coalesced(tensors=[(5,):float32]" in msg, msg


def _backend_rank(rank, ws, backend):
    import zerofuse

    return error_text(lambda: zerofuse.parallel.init_mesh(dp=ws, backend=backend))


def test_an_unknown_backend_is_refused_by_name():
    """backend='ncc1' reached new_group: torch's bare "AssertionError: Unknown backend type ncc1"."""
    for backend in ("ncc1", 3):
        out = run_distributed(_backend_rank, 2, backend, timeout=60)
        for msg in out:
            assert msg.startswith("ValueError: zerofuse.parallel.init_mesh: expected backend None (the default "
                                  "group's) or one of ['gloo', 'nccl'"), msg
            assert msg.endswith(f"(or 'device:backend,...'), got {backend!r}"), msg
    assert run_distributed(_backend_rank, 2, "cpu:gloo", timeout=60) == ["no error"] * 2
