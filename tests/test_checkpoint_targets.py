"""Where zerofuse.checkpoint.save writes (a review's reproductions, 2026-12-07; each test failed
before its fix): a directory of other files was deleted whole, a link's target lost its meta.json
(the older checkpoint with it), a file was renamed aside; two saves to one path at once committed a
checkpoint mixing their files. Refused on every rank before the first collective; a second save
waits for the first."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

import zerofuse
from zerofuse.checkpoint import files
from zerofuse.models import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("native_kernels")
FORMATS = ["zerofuse", "dcp"]


def _zmodel():
    model = GPT(GPTConfig(vocab_size=65, seq_len=16, n_layer=1, n_head=2, dim=16), seed=0)
    return zerofuse.zero.parallelize(model, stage=2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_path_that_is_no_checkpoint_is_refused_and_left_alone(fmt, tmp_path, world_of_one):
    model = _zmodel()
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)
    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "train.log").write_text("keep me")
    with pytest.raises(ValueError, match=r"expected path to be a new or empty directory or a checkpoint .* a "
                                         r"directory of other files \(\['data', 'train.log'\]\)"):
        zerofuse.checkpoint.save(str(mine), model, opt, format=fmt)
    assert (mine / "train.log").read_text() == "keep me" and (mine / "data").is_dir()
    step1 = tmp_path / "step_1"
    zerofuse.checkpoint.save(str(step1), model, opt, extra={"step": 1}, format=fmt)
    (tmp_path / "latest").symlink_to("step_1")
    with pytest.raises(ValueError, match=r"expected path to be a directory, not a symbolic link"):
        zerofuse.checkpoint.save(str(tmp_path / "latest"), model, opt, format=fmt)
    assert zerofuse.checkpoint.load(str(step1), model, opt) == {"step": 1}
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"got '.*afile', a file"):
        zerofuse.checkpoint.save(str(tmp_path / "afile"), model, opt, format=fmt)
    empty = tmp_path / "empty"
    empty.mkdir()
    zerofuse.checkpoint.save(str(empty), model, opt, extra={"step": 2}, format=fmt)  # new or empty: saved
    zerofuse.checkpoint.save(str(empty), model, opt, extra={"step": 3}, format=fmt)  # a checkpoint: replaced
    assert zerofuse.checkpoint.load(str(empty), model, opt) == {"step": 3}


def test_saves_to_one_path_take_turns(tmp_path, monkeypatch, world_of_one):
    """Another process's save waits for this one's commit; a second save in this process is refused
    (it took the first one's lock and deleted its files); a save that failed lets the lock go (it
    held it for the process's life: every other save of the path waited forever)."""
    path = str(tmp_path / "ckpt")
    files.begin(path)
    with pytest.raises(RuntimeError, match=r"another save to .* is in progress in this process"):
        files.begin(path)
    ready, began = tmp_path / "ready", tmp_path / "began"
    code = (f"import pathlib; from zerofuse.checkpoint import files; pathlib.Path({str(ready)!r}).touch(); "
            f"files.begin({path!r}); pathlib.Path({str(began)!r}).touch()")
    other = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        assert ready.exists() and not began.exists()  # waits on this save's lock
        files.release(path)  # (what commit does)
        assert other.wait(60) == 0 and began.exists()
    finally:
        other.kill()
    model = _zmodel()
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)

    def fail(point):
        if point == "made tmp":
            raise OSError("disk full")

    monkeypatch.setattr(files, "kill_point", fail)
    with pytest.raises(OSError, match="disk full"):
        zerofuse.checkpoint.save(path, model, opt)
    monkeypatch.undo()
    assert path not in files._locks
    zerofuse.checkpoint.save(path, model, opt, extra={"step": 1})
    assert zerofuse.checkpoint.load(path, model, opt) == {"step": 1}


def _leader_fails_rank(rank, ws, path, fmt, where):
    import time as _time

    model = _zmodel()
    opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3)
    if rank == 0 and where == "begin":  # (a lock or .tmp that cannot be made: past check_target)
        files.begin = lambda p: (_ for _ in ()).throw(PermissionError(f"cannot write {p}"))
    if rank == 1 and where == "shards":
        from zerofuse.checkpoint import native
        native._write_shards = lambda *a: (_ for _ in ()).throw(OSError("disk full"))
    if rank == 0 and where == "meta":  # the leader's last writes, after every rank's shards
        write_json = files.write_json
        files.write_json = lambda f, o: (_ for _ in ()).throw(OSError("disk full")) if f.endswith("meta.json") \
            else write_json(f, o)
    t0 = _time.monotonic()
    try:
        zerofuse.checkpoint.save(path, model, opt, format=fmt,
                                 extra={"sampler": object()} if rank == 0 and where == "extra" else None)
    except Exception as e:
        seconds = _time.monotonic() - t0
        _time.sleep(FAILED_RANK_LIVES_S)  # (a caller that caught the error and went on: its peers must not wait)
        return f"{type(e).__name__}: {e}", seconds
    return None, _time.monotonic() - t0


FAILED_RANK_LIVES_S = 8.0


@pytest.mark.parametrize("fmt,where", [("zerofuse", "begin"), ("dcp", "begin"), ("zerofuse", "shards"),
                                       ("zerofuse", "meta"), ("dcp", "meta"), ("zerofuse", "extra")])
def test_a_save_failing_on_one_rank_fails_on_every_rank_at_once(fmt, where, tmp_path):
    """The leader's begin failing (or one rank's shard writes, the leader's meta.json, an extra only
    rank 0 refused) left the other ranks waiting in a barrier for the process group's timeout, or
    for as long as the failed rank lived on (a review's reproduction, 2026-12-07)."""
    from dist_utils import run_distributed

    out = run_distributed(_leader_fails_rank, 2, str(tmp_path / "ck"), fmt, where, timeout=120)
    failed, other = (1, 0) if where == "shards" else (0, 1)
    assert out[failed][0] in ("PermissionError: cannot write " + str(tmp_path / "ck"), "OSError: disk full") or \
        out[failed][0].startswith("TypeError: zerofuse.checkpoint.save: expected extra['sampler'] to hold only"), out
    what = {"begin": "could not begin the save", "shards": "could not write their part of the checkpoint",
            "meta": "could not write the meta.json" if fmt == "zerofuse" else "could not commit the checkpoint",
            "extra": "could not begin the save"}[where]
    assert out[other][0] == f"ValueError: zerofuse.checkpoint.save: rank(s) [{failed}] of the group {what} (their " \
                            "errors say why)", out
    assert out[other][1] < FAILED_RANK_LIVES_S / 2, out
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_path_under_a_file_is_refused_by_name(fmt, tmp_path, world_of_one):
    model = _zmodel()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"save: expected path's parent to be a directory \(or new\), got "
                                         r"'.*afile/sub/ck', under '.*afile', a file"):
        zerofuse.checkpoint.save(str(tmp_path / "afile" / "sub" / "ck"), model, format=fmt)
    zerofuse.checkpoint.save(str(tmp_path / "ck"), model, format=fmt)
    for out in (tmp_path / "afile", tmp_path / "afile" / "hf"):
        with pytest.raises(ValueError, match=r"export_hf: expected out_dir to be a directory \(or new\), got "
                                             r"'.*afile(/hf)?', (under '.*afile', )?a file"):
            zerofuse.checkpoint.export_hf(str(tmp_path / "ck"), str(out), config={"model_type": "gpt2"})
