"""Files of a checkpoint: reading without running code, writing durably, and the commit protocol.

[Note: checkpoint commit protocol] A checkpoint at ``path`` is complete when its ``meta.json``
exists: meta.json is written last (after every rank's files, fsynced; each file is written as
``<file>.part`` and renamed, so a meta.json that exists is whole), and ``remove`` deletes it
first. A save writes into ``<path>.tmp``, then the leader
    1. removes ``<path>.old`` (only ever a copy older than ``path``, which is complete),
    2. renames ``path`` -> ``<path>.old``           (now: .old and .tmp are complete),
    3. renames ``<path>.tmp`` -> ``path``           (now: path and .old are complete),
    4. removes ``<path>.old``,
fsyncing the parent directory after each step. Before a save starts, ``recover`` repairs what a
crash between 2 and 3 left (no ``path``): the complete ``.tmp`` (the newer) or else ``.old`` is
renamed back to ``path``; so step 1 never deletes the only complete checkpoint. ``resolve`` reads
``path``, else ``.tmp`` when complete, else ``.old``. Every step is a ``kill_point``: tests kill
the saver at each one and check a complete checkpoint is always left (tests/test_checkpoint_safety.py).

Reading: tensors come from ``torch.load(weights_only=True, mmap=True, map_location="cpu")``
(plain tensors, numbers, strings, lists, tuples and dicts: no code runs, pages are read only
where a rank copies from them), everything else from JSON. What save is given to store
(``extra``) is checked to be of those types before anything is written.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil

import torch

NAME = "zerofuse.checkpoint"
META = "meta.json"
DCP_META = ".metadata"  # torch.distributed.checkpoint's metadata file: a directory in DCP's layout


def is_dcp(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, DCP_META))


def kill_point(name: str) -> None:
    """A step of the save protocol; tests replace this to stop the saver there."""


# ---------------------------------------------------------------------------------------- reading

def read_tensors(file: str):
    """A rank file's contents; refuses anything but plain data (``weights_only=True``)."""
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{NAME}: refused to load {file!r}: it holds objects other than tensors, numbers, "
                         f"strings, lists and dicts (a checkpoint zerofuse wrote never does; loading it could "
                         f"run code). Details: {str(e).splitlines()[0]}") from None
    except (RuntimeError, OSError, EOFError) as e:
        raise ValueError(f"{NAME}: cannot read {file!r} as a checkpoint shard: {e}") from None


def read_json(file: str) -> dict:
    try:
        with open(file) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{NAME}: {file!r} is not valid JSON: {e}") from None


_PLAIN = (type(None), bool, int, float, str, torch.Tensor, torch.dtype, torch.device)


def check_plain(obj, where: str = "extra") -> None:
    """Raise if ``obj`` holds anything a weights_only load would refuse (so save fails, not load)."""
    if isinstance(obj, torch.Tensor) and type(obj) not in (torch.Tensor, torch.nn.Parameter):
        # (a subclass passed as a tensor here, and the weights_only load then refused the checkpoint)
        raise TypeError(f"{NAME}.save: expected {where} to hold plain tensors, got a {type(obj).__name__} (a tensor "
                        "subclass a weights_only load refuses); pass torch.Tensor(t) or t.as_subclass(torch.Tensor)")
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"{NAME}.save: expected {where}'s keys to be strings or numbers, got "
                                f"{type(k).__name__} {k!r}")
            check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(f"{NAME}.save: expected {where} to hold only tensors, numbers, strings, None, lists, tuples and "
                    f"dicts (what loads without running code), got {type(obj).__module__}.{type(obj).__qualname__}")


# ---------------------------------------------------------------------------------------- writing

def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_file_mode() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def seal(file: str) -> None:
    """A file another library wrote (safetensors' save_file creates it 0600 and does not sync it):
    given the mode ``open`` gives a new file (0666 less the umask: an export others read), synced."""
    os.chmod(file, _new_file_mode())
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part(file: str, mode: str, dump) -> str:
    """dump(f) into ``<file>.part``, synced; returns that name (no .part left when dump fails)."""
    part = file + ".part"
    try:
        with open(part, mode) as f:
            dump(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(part):
            os.unlink(part)
        raise
    return part


def _write(file: str, mode: str, dump) -> None:
    """Written under a temporary name and renamed: a dump that fails halfway (a value JSON cannot
    hold) leaves no file, where it left a cut-off meta.json that made the directory count as complete."""
    kill_point(f"before {os.path.basename(file)}")
    os.replace(write_part(file, mode, dump), file)
    kill_point(f"after {os.path.basename(file)}")


def write_tensors(file: str, obj) -> None:
    _write(file, "wb", lambda f: torch.save(obj, f))


def write_json(file: str, obj) -> None:
    _write(file, "w", lambda f: json.dump(obj, f))


def complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, META))


def remove(directory: str) -> None:
    """Delete a checkpoint directory, marking it incomplete first (meta.json goes first). A link is
    unlinked, never followed (its target's meta.json went, and the older checkpoint with it)."""
    if not os.path.lexists(directory):
        return
    if os.path.islink(directory):
        os.unlink(directory)
        fsync_dir(os.path.dirname(directory))
        return
    meta = os.path.join(directory, META)
    if os.path.isfile(meta):
        os.unlink(meta)
        fsync_dir(directory)
    shutil.rmtree(directory)
    fsync_dir(os.path.dirname(directory))


def _role(p: str) -> str:
    return "tmp" if p.endswith(".tmp") else "old" if p.endswith(".old") else "path"


def _rename(src: str, dst: str) -> None:
    os.rename(src, dst)
    fsync_dir(os.path.dirname(dst))
    kill_point(f"renamed {_role(src)} -> {_role(dst)}")


def recover(path: str) -> None:
    """Leader, before a save: put back the checkpoint a crash mid-commit left beside ``path``."""
    if complete(path):
        return
    for side in (path + ".tmp", path + ".old"):
        if complete(side):
            if os.path.lexists(path):  # an incomplete leftover (nothing of ours renames one there)
                remove(path)
            _rename(side, path)
            return


def check_directory_path(directory: str, who: str, arg: str, given: str) -> None:
    """``directory`` is a directory, or new under one (os.makedirs raised a bare FileExistsError
    naming neither the argument nor the expectation: a review's reproduction, 2026-12-07)."""
    above = os.path.abspath(directory)
    while not os.path.lexists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"{who}: expected {arg} to be a directory (or new), got {given!r}, "
                         + ("" if above == os.path.abspath(directory) else f"under {above!r}, ") + "a file")


def check_target(path: str, who: str) -> None:
    """Every rank, before a save's first collective (a leader's refusal left the others waiting in
    its barrier): ``path`` is new, an empty directory or a checkpoint (ours, or one a crash
    mid-commit left beside it), which the save replaces. A directory of other files was deleted
    whole, a link's target lost its meta.json, a file was renamed aside (a review's reproductions,
    2026-12-07)."""
    check_directory_path(os.path.dirname(path), who, "path's parent", path)
    if os.path.islink(path):
        raise ValueError(f"{who}: expected path to be a directory, not a symbolic link, got {path!r} -> "
                         f"{os.readlink(path)!r} (a save replaces the directory at path: pass the link's target, "
                         "or a new path, and point the link there after)")
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise ValueError(f"{who}: expected path to be a new or checkpoint directory, got {path!r}, a file")
    held = os.listdir(path)
    if complete(path) or not held or any(complete(side) for side in (path + ".tmp", path + ".old")):
        return
    raise ValueError(f"{who}: expected path to be a new or empty directory or a checkpoint (a save replaces it "
                     f"whole), got {path!r}, a directory of other files ({sorted(held)[:5]}); pass "
                     "a directory of its own")


_locks: dict[str, int] = {}  # path -> the fd of its save lock, held from begin to commit by the leader


def flock(path: str, *, wait: bool = True, shared: bool = False) -> tuple[int, bool]:
    """An exclusive flock on the file ``path`` (created): ``(fd, locked)``, held until ``fd`` is closed
    (the kernel drops it when the process ends, however it ends). ``locked`` is False on a filesystem
    without locks (the caller runs unguarded). ``wait=False``: BlockingIOError (``fd`` closed) while
    another process holds it; ``shared``: a shared lock (many holders, no exclusive one). The one lock
    of the package: checkpoint saves, zerofuse-train's --out (and its ranks'), the GPT-2 token cache."""
    import fcntl  # noqa: PLC0415 - POSIX only

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except OSError as e:
        if isinstance(e, BlockingIOError) or e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise
        return fd, False
    return fd, True


def _lock_file(path: str) -> str:
    """The save lock's file of the checkpoint ``path`` (absolute): ``.<name>.lock`` beside it."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")


def _lock(path: str) -> None:
    """An exclusive lock on ``.<name>.lock`` beside ``path`` until commit (or the next save of it in
    this process): two saves to one path at once each used ``<path>.tmp``, and the committed
    checkpoint mixed the two saves' files, loading as if whole (a review's reproduction,
    2026-12-07). A second save waits for the first."""
    if path in _locks:  # (closing it let a second save in this process delete the first one's files)
        raise RuntimeError(f"{NAME}.save: another save to {path!r} is in progress in this process; expected one "
                           "save of a path at a time")
    _locks[path], _ = flock(_lock_file(path))


@contextlib.contextmanager
def reading(path: str):
    """A shared lock on ``path``'s save lock while a reader reads its files (opened one by one,
    lazily): a save committed meanwhile renamed a new checkpoint into the name, and the reader took
    the old meta.json's tables with the new save's tensors, silently (a review's reproduction,
    2026-12-07). A save waits for the readers, a reader for a save in progress. Unguarded where no
    lock file can be made (a read-only directory)."""
    path = os.path.abspath(path)
    try:
        fd, _ = flock(_lock_file(path), shared=True)
    except OSError:  # (no write access to the directory, or it does not exist: the read says so)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def release(path: str) -> None:
    """The path's save lock let go (commit does; a save that failed before it, in its finally)."""
    fd = _locks.pop(path, None)
    if fd is not None:
        os.close(fd)


def begin(path: str) -> str:
    """Leader: a fresh, empty ``<path>.tmp`` (after recovering a crashed commit), under the path's
    save lock."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _lock(path)
    try:
        recover(path)
        tmp = path + ".tmp"
        remove(tmp)
        os.makedirs(tmp)
        fsync_dir(parent)
        kill_point("made tmp")
    except BaseException:
        release(path)
        raise
    return tmp


def commit(path: str) -> None:
    """Leader, once ``<path>.tmp`` is complete (its meta.json written): swap it into place."""
    tmp, old = path + ".tmp", path + ".old"
    fsync_dir(tmp)
    remove(old)
    kill_point("removed old")
    if os.path.lexists(path):
        _rename(path, old)
    _rename(tmp, path)
    remove(old)
    kill_point("removed old after commit")
    release(path)


def resolve(path: str) -> str:
    """The complete checkpoint at ``path``, or the one a crash mid-commit left beside it."""
    for p in (path, path + ".tmp", path + ".old"):
        if complete(p):
            return p
    raise FileNotFoundError(f"{NAME}: no complete checkpoint at {path!r} (no {META})")
