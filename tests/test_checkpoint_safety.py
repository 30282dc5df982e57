"""zerofuse.checkpoint safety: no code runs on load, no moment without a complete checkpoint (the saver
killed at every step of the commit protocol), each rank opens only the files it needs, and loading at
another TP size stays within one param of extra memory."""
from __future__ import annotations

import os
import multiprocessing as mp
import re
import shutil

import pytest
import torch
import torch.distributed as dist

import zerofuse
from zerofuse.checkpoint import files

import dist_utils
from dist_utils import run_distributed
from test_checkpoint import _steps
from zero_common import LR, batches, make_model

pytestmark = pytest.mark.usefixtures("native_kernels")


class _Payload:
    """Unpickling this runs a shell command (what a tampered checkpoint file would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _save_small(rank, ws, path, stage=2, fmt="zerofuse", bucket_mb=0.05):
    model = make_model(n_layer=2)
    zerofuse.zero.parallelize(model, stage=stage, bucket_mb=bucket_mb)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR)
    _steps(rank, ws, model, opt, batches(1))
    zerofuse.checkpoint.save(path, model, opt, extra={"n": 1}, format=fmt)


def _load_small(rank, ws, path):
    model = make_model(n_layer=2)
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.05)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR)
    try:
        zerofuse.checkpoint.load(path, model, opt)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("victim", ["rank1.pt", "common.pt", ".metadata"])
def test_a_checkpoint_crafted_to_run_code_is_refused(tmp_path, victim):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_small, 2, path, 2, "dcp" if victim == ".metadata" else "zerofuse", timeout=240)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, victim), "wb") as f:
        if victim == ".metadata":
            import pickle
            pickle.dump(_Payload(marker), f)
        else:
            torch.save({"units": _Payload(marker)}, f)
    with pytest.raises(ValueError, match=r"refused to load .*(could run code|not a DCP metadata type)"):
        zerofuse.checkpoint.consolidate(path)
    msgs = run_distributed(_load_small, 2, path, timeout=240)
    # the rank that read the bad file says why, the others that it failed (no rank goes on alone)
    assert all(m is not None and ("refused to load" in m or "rank(s) [1] of the group could not read" in m)
               for m in msgs), msgs
    assert any("refused to load" in m for m in msgs)
    assert not marker.exists()


def test_a_dcp_metadata_that_sets_attributes_of_an_admitted_class_is_refused(tmp_path):
    """BUILD aimed at an admitted class (not an instance) set its attributes for the whole process:
    a refused file still replaced PosixPath.__truediv__ (every later path join broken)."""
    import pathlib

    import torch.distributed.checkpoint as dcp

    from zerofuse.checkpoint.dcp_read import SafeReader

    path = str(tmp_path / "ck")
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=path, no_dist=True)
    good = open(os.path.join(path, ".metadata"), "rb").read()
    assert good[:2] == b"\x80\x04"
    name = b"__truediv__"
    evil = (b"\x80\x04cpathlib\nPosixPath\nN}X" + len(name).to_bytes(4, "little") + name +
            b"ctorch.serialization\n_get_layout\ns\x86b0" + good[2:])
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(evil)
    before = pathlib.PosixPath.__truediv__
    try:
        with pytest.raises(ValueError, match=r"refused to load .*a BUILD of the class PosixPath"):
            SafeReader(path).read_metadata()
        assert pathlib.PosixPath.__truediv__ is before
    finally:
        pathlib.PosixPath.__truediv__ = before


def _load_untouched(rank, ws, path):
    """_load_small, and whether the model and optimizer were left as they were by the refusal."""
    model = make_model(n_layer=2)
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.05)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR)
    _steps(rank, ws, model, opt, batches(1))
    before = [t.clone() for u, st in zip(model._zerofuse_zero.units, opt.unit_states) for t in (u.shard, *st.values())]
    try:
        zerofuse.checkpoint.load(path, model, opt)
        said = "no error"
    except ValueError as e:
        said = str(e)
    after = [t for u, st in zip(model._zerofuse_zero.units, opt.unit_states) for t in (u.shard, *st.values())]
    return said, all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_rank_file_of_another_save_or_cut_short_is_refused_before_anything_is_written(tmp_path):
    """Read at another world size, a rank's pieces come from several rank files, opened as they were
    needed: a cut rank1.pt was found after rank0.pt's pieces were written (a half-loaded model), and
    a rank file of another save failed one rank on a size error while the other waited for it (a
    review's reproduction, 2026-11-28). Now every file is checked against the tables first."""
    path, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    run_distributed(_save_small, 2, path, timeout=240)
    run_distributed(_save_small, 2, other, 2, "zerofuse", 0.02, timeout=240)  # other buckets in its rank files
    shutil.copy(os.path.join(other, "rank1.pt"), os.path.join(path, "rank1.pt"))
    # a rank that reads the file says why, the others that it failed; none is changed
    peer = "of the group could not read their part of the checkpoint"
    out = run_distributed(_load_untouched, 3, path, timeout=240)
    another = "rank1.pt is of another save than the checkpoint's"
    assert any(another in said for said, _ in out)
    assert all((another in said or peer in said) and untouched for said, untouched in out), out
    with open(os.path.join(path, "rank1.pt"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, "rank1.pt")) // 2)
    out = run_distributed(_load_untouched, 3, path, timeout=240)
    assert any("cannot read" in said and "rank1.pt" in said for said, _ in out), out
    assert all(("cannot read" in said or peer in said) and untouched for said, untouched in out), out


def test_a_file_of_another_save_with_the_same_layout_is_refused(tmp_path):
    """A rank file (or common.pt) of an earlier save of the same run has the same layout: every size
    check passed, and load and consolidate took its values silently (a review's reproduction,
    2026-12-07). Each file records its save's id, and the meta.json's is expected."""
    path, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    run_distributed(_save_small, 2, path, timeout=240)
    run_distributed(_save_small, 2, other, timeout=240)  # the same model and layout, saved again
    for victim in ("rank1.pt", "common.pt"):
        mixed = str(tmp_path / f"mixed-{victim}")
        shutil.copytree(path, mixed)
        shutil.copy(os.path.join(other, victim), os.path.join(mixed, victim))
        out = run_distributed(_load_untouched, 2, mixed, timeout=240)
        another = f"{victim} is of another save than the checkpoint's (save id "
        assert any(another in said for said, _ in out), out
        assert all((another in said or "of the group could not read" in said) and untouched
                   for said, untouched in out), out
        with pytest.raises(ValueError, match=f"{victim} is of another save than the checkpoint's"):
            zerofuse.checkpoint.consolidate(mixed)
    zerofuse.checkpoint.consolidate(path)  # (its own files: as before)


@pytest.mark.parametrize("ws", [2, 3])
def test_tables_that_miss_a_piece_are_refused_before_anything_is_written(tmp_path, ws):
    """A meta.json whose tables miss a param's piece (a row dropped) was found by the copy of that
    param, after the others were written: a half-loaded model (a review's reproduction, 2026-12-06).
    Loaded at the save's world size (each rank its own tables) and at another."""
    import json

    path = str(tmp_path / "ckpt")
    run_distributed(_save_small, 2, path, timeout=240)
    meta_path = os.path.join(path, files.META)
    with open(meta_path) as f:
        meta = json.load(f)
    name = meta["tables"][1][-1][0]
    meta["tables"][1] = meta["tables"][1][:-1]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    peer = "of the group could not read their part of the checkpoint"
    out = run_distributed(_load_untouched, ws, path, timeout=240)
    assert any("the checkpoint's shards cover" in said and f"of {name!r}" in said and "a row missing" in said
               for said, _ in out), out
    assert all(("a row missing" in said or peer in said) and untouched for said, untouched in out), out


def _edit(meta, how):
    if how == "no tables":
        del meta["tables"]
    elif how == "no optimizer":
        del meta["optimizer"]
    elif how == "steps empty":
        meta["optimizer"]["steps"] = []
    elif how == "length a string":
        meta["tables"][0][0][3] = str(meta["tables"][0][0][3])
    elif how == "a list":
        meta = [1]
    elif how == "a shape short":
        meta["shapes"] = meta["shapes"][:-1]
    elif how == "negative offset":
        meta["tables"][1][0][2] = -8
    elif how == "no precision":
        del meta["precision"]
    elif how == "aliases a list":
        meta["aliases"] = ["x"]
    elif how == "a group's stray name":
        meta["optimizer"]["param_groups"][0]["params"].append("nope")
    elif how == "pp a string":
        meta["pp"] = "2"
    return meta


@pytest.mark.parametrize("how, key", [("no tables", "'tables'"), ("no optimizer", "'optimizer'"),
                                      ("steps empty", "'optimizer'.'steps'"), ("length a string", "each row of"),
                                      ("a list", "the file"), ("a shape short", "'shapes'"),
                                      ("negative offset", "each row of 'tables'[1]"),
                                      # (a review of the check: KeyError, AttributeError, TypeError still)
                                      ("no precision", "'precision'"), ("aliases a list", "'aliases'"),
                                      ("a group's stray name", "'optimizer'.'param_groups' to hold"),
                                      ("pp a string", "'pp' a whole number >= 1")])
def test_an_edited_meta_json_is_refused_by_name(tmp_path, how, key):
    """An edited or damaged meta.json failed in Python's words (KeyError 'tables', IndexError, a str
    added to an int, a negative offset as a copy's size error; a review's reproductions,
    2026-12-07): load on every rank and consolidate name the file, the key and the value."""
    import json

    path = str(tmp_path / "ckpt")
    run_distributed(_save_small, 2, path, timeout=240)
    meta_path = os.path.join(path, files.META)
    with open(meta_path) as f:
        meta = _edit(json.load(f), how)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    want = f"meta.json: expected {key}"
    for said, untouched in run_distributed(_load_untouched, 2, path, timeout=240):
        assert want in said and "(a damaged or edited meta.json)" in said and untouched, said
    with pytest.raises(ValueError, match=re.escape(want)):
        zerofuse.checkpoint.consolidate(path)


def test_extra_that_would_need_unpickling_is_refused_at_save(tmp_path):
    with pytest.raises(TypeError, match=r"extra\['sched'\]\[0\] to hold only tensors.*got .*_Payload"):
        files.check_plain({"step": 3, "sched": [_Payload("x")]})
    files.check_plain({"step": 3, "rng": torch.zeros(3, dtype=torch.uint8), "betas": (0.9, 0.95), "x": None})

    class Tagged(torch.Tensor):  # a subclass passed as a tensor, and the weights_only load refused it
        pass

    with pytest.raises(TypeError, match=r"expected extra\['t'\] to hold plain tensors, got a Tagged"):
        files.check_plain({"t": torch.zeros(2).as_subclass(Tagged)})
    files.check_plain({"p": torch.nn.Parameter(torch.zeros(2))})


# ---------------------------------------------------------------------------------------- kill points

def _kill_child(store, point, path, state2):
    """A saver process killed (os._exit) at ``point`` of the commit protocol; forked from a server
    that imported torch and zerofuse once (tests/dist_utils.py), so each kill costs no import. It
    saves state 2 loaded from its complete checkpoint, not trained again: the test is about the
    files, and two processes' training need not agree bit for bit (CI 2026-11-27, once: the child's
    retrained wte.weight differed from the rank's; not reproduced here, where 600 retrainings in 4
    concurrent processes, and others at 1 to 8 threads, agreed bit for bit)."""
    from zerofuse import kernels
    from zerofuse.checkpoint import files

    kernels.TRITON_ON_CPU = False  # the server was started in the session's interpreter mode
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    model, opt = _trained(0)
    assert zerofuse.checkpoint.load(state2, model, opt) == {"n": 2}

    def kill(name):
        if name == point:
            os._exit(17)

    files.kill_point = kill
    zerofuse.checkpoint.save(path, model, opt, extra={"n": 2})
    os._exit(0)


def _trained(n):
    model = make_model(n_layer=2)
    zerofuse.zero.parallelize(model, stage=2, bucket_mb=0.05)
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=LR)
    for b in batches(n):
        _steps(0, 1, model, opt, [b])
    return model, opt


def _model_of(path):
    full = zerofuse.checkpoint.consolidate(path)
    return full["extra"]["n"], full["model"]


def _which(path, refs) -> int:
    """Which of the reference states the checkpoint at path holds (asserts it is one of them)."""
    n, model = _model_of(path)
    assert n in refs, f"extra n={n}"
    for k, t in refs[n].items():
        assert torch.equal(model[k], t), f"{k} differs from state {n} by {(model[k] - t).abs().max()}"
    return n


class _Killed(BaseException):
    pass


def _kill_rank(rank, ws, root):
    """ws 1: record the protocol's kill points, kill a real saver process at each, check a complete
    checkpoint is left and the next save repairs and replaces it; then crash two saves in a row
    (in-process, at every pair of points)."""
    points = []
    files.kill_point = points.append
    model1, opt1 = _trained(1)
    a_dir = os.path.join(root, "A")
    zerofuse.checkpoint.save(a_dir, model1, opt1, extra={"n": 1})
    model2, opt2 = _trained(2)
    points.clear()
    over = os.path.join(root, "over")
    shutil.copytree(a_dir, over)
    zerofuse.checkpoint.save(over, model2, opt2, extra={"n": 2})
    files.kill_point = lambda name: None
    refs = {1: _model_of(a_dir)[1], 2: _model_of(over)[1]}
    assert refs[1].keys() == refs[2].keys() and any(not torch.equal(refs[1][k], refs[2][k]) for k in refs[1])
    ctx = dist_utils._context()
    # a rank is a daemonic process, which multiprocessing forbids children; these are joined below
    # (and the forkserver exits with this rank)
    mp.current_process()._config["daemon"] = False
    left = {}
    for i, point in enumerate(points):
        path = os.path.join(root, f"kill{i}")
        shutil.copytree(a_dir, path)
        child = ctx.Process(target=_kill_child, args=(os.path.join(root, f"store{i}"), point, path, over))
        child.start()
        child.join(120)
        assert child.exitcode == 17, f"the saver did not reach {point!r}: exit code {child.exitcode}"
        left[point] = _which(path, refs)  # a complete checkpoint: the old or the new one
        zerofuse.checkpoint.save(path, model2, opt2, extra={"n": 2})  # the next save repairs and replaces
        assert _which(path, refs) == 2
        assert sorted(os.listdir(root)).count(f"kill{i}.tmp") == 0 and not os.path.exists(path + ".old")
    # two crashes in a row, then a save that completes
    for p in points:
        for q in points:
            path = os.path.join(root, "twice")
            for d in (path, path + ".tmp", path + ".old"):
                shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(a_dir, path)
            for at, (m, o, n) in ((p, (model2, opt2, 2)), (q, (model1, opt1, 1))):
                def kill(name, at=at):
                    if name == at:
                        raise _Killed(name)
                files.kill_point = kill
                try:
                    zerofuse.checkpoint.save(path, m, o, extra={"n": n})
                except _Killed:
                    pass
                files.kill_point = lambda name: None
                _which(path, refs)
            zerofuse.checkpoint.save(path, model2, opt2, extra={"n": 2})
            assert _which(path, refs) == 2
    return points, left


def test_no_moment_without_a_complete_checkpoint(tmp_path):
    points, left = run_distributed(_kill_rank, 1, str(tmp_path), timeout=600)[0]
    # before/after each file, each rename, the cleanup: the protocol's every step was a kill point
    assert {"made tmp", "before rank0.pt", "after rank0.pt", "before common.pt", "after common.pt",
            "before meta.json", "after meta.json", "removed old", "renamed path -> old",
            "renamed tmp -> path", "removed old after commit"} <= set(points), points
    print(f"\nkill points ({len(points)}): " + ", ".join(f"{p} -> state {left[p]}" for p in points))
    # the old checkpoint is what loads until the new one has replaced it
    assert left["after meta.json"] == 1 and left["renamed path -> old"] == 2 and left["removed old"] == 1


@pytest.mark.parametrize("where", ["parent", "absolute", "posixpath_shown_otherwise"])
def test_a_dcp_metadata_naming_files_outside_its_directory_is_refused(tmp_path, where):
    """DCP joins the directory and each storage file's relative_path: '../x' or an absolute path read
    another checkpoint's tensors (any torch-saved file on the machine) into the model."""
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.full((3,), 42.0)}, checkpoint_id=str(tmp_path / "outside"), no_dist=True)
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=str(ckpt), no_dist=True)
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    class Shown:  # a PosixPath of the outside file whose BUILD sets its cached string to the innocent name
        def __init__(self, target, shown):  # (a review's reproduction, 2026-12-07: checked by the
            self.target, self.shown = target, shown  # string, opened by the parts)

        def __reduce__(self):
            import pathlib
            return pathlib.PosixPath, (self.target,), (None, {"_str": self.shown})

    for info in md.storage_data.values():
        info.relative_path = ("../outside/" + info.relative_path if where == "parent"
                              else str(tmp_path / "outside" / info.relative_path) if where == "absolute"
                              else Shown(str(tmp_path / "outside" / info.relative_path), info.relative_path))
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    message = (r"a BUILD of a PosixPath \(setting its state\) is not DCP metadata" if where.startswith("posix")
               else r"names the storage file .*expected a file of the checkpoint's directory")
    with pytest.raises(ValueError, match=r"refused to load .*\.metadata.*" + message):
        zerofuse.checkpoint.consolidate(str(ckpt))


_SAVER = """
import sys, torch, torch.distributed as dist, zerofuse
from zerofuse.models import GPT, GPTConfig
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
model = zerofuse.zero.parallelize(GPT(GPTConfig(vocab_size=65, seq_len=16, n_layer=1, n_head=2, dim=16), seed=5), stage=2)
print("saving", flush=True)
zerofuse.checkpoint.save(sys.argv[1], model, extra={"step": 5})
print("saved", flush=True)
"""


def test_a_save_waits_for_a_reader_of_the_same_path(tmp_path, world_of_one, monkeypatch):
    """A reader opens the rank files one by one after meta.json: a save committed to the same path
    meanwhile (a training job saving while an evaluation loads --out/ckpt) gave it the old tables
    with the new tensors, silently (a review's reproduction, 2026-12-07). The reader holds the
    path's lock shared; the save waits for it, then replaces the checkpoint."""
    import subprocess
    import sys
    import time

    from zerofuse.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=65, seq_len=16, n_layer=1, n_head=2, dim=16)
    path = str(tmp_path / "ck")
    zerofuse.checkpoint.save(path, zerofuse.zero.parallelize(GPT(cfg, seed=0), stage=2), extra={"step": 1})
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    real, saver = files.read_tensors, []

    def read_tensors(file):
        if not saver:  # meta.json read, no rank file yet: another process saves now
            saver.append(subprocess.Popen([sys.executable, str(script), path, str(tmp_path / "init2")],
                                          stdout=subprocess.PIPE, text=True))
            assert saver[0].stdout.readline().strip() == "saving"
            time.sleep(2.0)
            assert saver[0].poll() is None, "the save did not wait for the reader"
        return real(file)

    monkeypatch.setattr(files, "read_tensors", read_tensors)
    model = zerofuse.zero.parallelize(GPT(cfg, seed=9), stage=2)
    assert zerofuse.checkpoint.load(path, model) == {"step": 1}
    monkeypatch.setattr(files, "read_tensors", real)
    out, _ = saver[0].communicate(timeout=120)
    assert saver[0].returncode == 0 and out.strip() == "saved"
    mine, first = dict(model.named_parameters()), GPT(cfg, seed=0)
    for name, p in first.named_parameters():
        assert torch.equal(mine[name].detach(), p.detach()), name
    assert zerofuse.checkpoint.consolidate(path)["extra"] == {"step": 5}
