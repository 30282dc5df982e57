"""The training job's data: what a review reproduced as silently wrong or unclear (each check
failing before its fix): a glob matching text files read as GPT-2 ids; ids past the vocabulary in
a shard's middle (never checked: they trained in the padding rows or crashed a rank); validation
shards that are also training shards; non-UTF-8 text tokenized with replacement characters; a
literal file name with brackets taken as a pattern; --tokenizer gpt2 without --data tokenizing the
shipped text into the package; --document-masking on data without documents; --resume on another
vocabulary; more shards than the open-file limit."""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerofuse import train
from zerofuse.train import data as D
from zerofuse.train import tokens as tok
from zerofuse.train.data import GPT2_DEFAULT

from train_common import _ok, run
from test_train_data import _flags


def test_a_pattern_matching_text_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("The quick brown fox jumps over the lazy dog\n" * 20)
    tok.write_shard(tmp_path / "a.bin", range(500))
    with pytest.raises(train.UsageError, match=r"^--data: expected the pattern .* to match token files \(.bin, or "
                                               r"llm.c's header\), it also matches \['.*notes.txt'\]"):
        _flags("--data", str(tmp_path / "*"), "--seq-len", "8")
    tok.write_shard(tmp_path / "headed.tok", range(500))  # an llm.c header under another suffix is a token file
    assert [p.name for p in tok.expand(str(tmp_path / "[ah]*"))] == ["a.bin", "headed.tok"]


def test_a_file_named_like_a_pattern_is_a_file(tmp_path):
    text = tmp_path / "run[1].txt"
    text.write_text("hello world, " * 200)
    assert not tok.is_shard_spec(str(text))
    assert _flags("--data", str(text), "--seq-len", "8").data == str(text)


def test_ids_past_the_vocabulary_in_a_shards_middle_are_found_when_read():
    ids = np.zeros(100_000, dtype=np.uint16)
    ids[50_000:50_100] = 50_300  # a padding row of the 50304-row embedding: trained silently before
    sampler = D.Sampler([ids], 64, 8, 1, 1, 0, seed=0, vocab=tok.GPT2_VOCAB)
    with pytest.raises(ValueError, match=r"^--data: shard 0 holds token id 50300 at or past the vocabulary \(50257\) "
                                         r"in a window read at step \d+"):
        for step in range(5000):
            sampler.get(step)


def test_validation_shards_that_are_training_shards_are_refused(tmp_path):
    for name in ("train_000.bin", "val_000.bin"):
        tok.write_shard(tmp_path / name, range(5000))
    with pytest.raises(train.UsageError, match=r"^--val-data: expected files that are not training data, got "
                                               r"\['.*val_000.bin'\] also matched by --data"):
        _flags("--data", str(tmp_path / "*.bin"), "--val-data", str(tmp_path / "val_000.bin"), "--seq-len", "8")
    assert _flags("--data", str(tmp_path / "train_*.bin"), "--val-data", str(tmp_path / "val_000.bin"),
                  "--seq-len", "8").val_data.endswith("val_000.bin")
    # without --data (the shipped shards), a --val-data given is kept: it was replaced by the shipped
    # split, unsaid (a review's reproduction, 2026-11-28)
    got = _flags("--tokenizer", "gpt2", "--val-data", str(tmp_path / "val_000.bin"), "--seq-len", "8")
    assert got.val_data == str(tmp_path / "val_000.bin") and got.data.endswith("tinyshakespeare-gpt2-train.bin")


def test_non_utf8_text_is_refused_for_the_gpt2_tokenizer(tmp_path):
    text = tmp_path / "latin1.txt"
    text.write_bytes("Café crème, ".encode("latin-1") * 100)
    with pytest.raises(ValueError, match=r"^--data: .*latin1.txt is not UTF-8 text \(byte 3: .*\); expected UTF-8 "
                                         r"for --tokenizer gpt2"):
        tok.tokenize_cached(text)
    assert not list(tmp_path.glob("*.bin"))  # (it was tokenized with replacement characters)


def test_gpt2_tokens_without_data_are_the_shipped_shards():
    a = _flags("--model", "tiny", "--tokenizer", "gpt2")
    assert (Path(a.data), Path(a.val_data)) == GPT2_DEFAULT


def test_document_masking_on_data_without_documents_says_so(capsys):
    _flags("--data", str(GPT2_DEFAULT[0]), "--val-data", str(GPT2_DEFAULT[1]), "--document-masking")
    assert "note: --document-masking: no <|endoftext|> (50256)" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_resume_on_another_vocabulary_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    """A checkpoint of one text's characters resumed on another text: one line (each rank raised a
    shape mismatch of its own)."""
    text = tmp_path / "small.txt"
    text.write_text("abcdefghij klmnopqrst\n" * 400)
    out = tmp_path / "out"
    _ok(run("--nproc", 1, "--model", "tiny", "--steps", 1, "--eval-every", 0, "--sample-tokens", 0, "--out", out))
    assert train.main(["--device", "cpu", "--nproc", "1", "--model", "tiny", "--steps", "2", "--out", str(out),
                       "--resume", "--data", str(text)]) == 2
    err = capsys.readouterr().err
    assert (f"--resume: the checkpoint at {out / 'ckpt'} was trained on another vocabulary (char tokens, 65 symbols) "
            f"than --data {text} (char tokens, 22 symbols)") in err and "Traceback" not in err
    # a text too large to read in the checks (64 MiB): another tokenizer's kind is still refused there (each
    # rank failed in its load on the embedding's shape, with a traceback, exit code 1; 2026-12-06)
    from zerofuse.train import checks
    monkeypatch.setattr(checks, "READ_HERE_BYTES", 0)
    assert train.main(["--device", "cpu", "--nproc", "1", "--model", "tiny", "--steps", "2", "--out", str(out),
                       "--resume", "--tokenizer", "byte"]) == 2
    err = capsys.readouterr().err
    assert "was trained on another vocabulary (char tokens, 65 symbols) than --data" in err and "(byte tokens)" in err


def test_many_shards_raise_the_open_file_limit(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda what: (64, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda what, lim: calls.append(lim))
    monkeypatch.setattr(D.os, "listdir", lambda path: ["0"] * 10 if path == "/proc/self/fd" else pytest.fail(path))
    D._open_files(1100, "--data")
    assert calls == [(1366, 4096)]
    monkeypatch.setattr(resource, "getrlimit", lambda what: (64, 512))
    with pytest.raises(ValueError, match=r"^--data: 1100 token files need about 1366 open files \(10 open already\), "
                                         r"the limit is 512 \(ulimit -n\)"):
        D._open_files(1100, "--data")


def test_train_and_val_shards_count_together_toward_the_open_file_limit(tmp_path):
    """The limit was raised for each set alone: the --val-data shards were opened while the --data
    ones were mapped, and ended in a bare "[Errno 24] Too many open files"."""
    for i in range(300):
        for kind in ("train", "val"):
            tok.write_shard(tmp_path / f"{kind}_{i:03d}.bin", np.arange(40, dtype=np.uint16))
    script = (f"import resource, os; resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + "
              f"200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
              f"from zerofuse.train.data import Corpus\n"
              f"c = Corpus.load('{tmp_path}/train_*.bin', 'gpt2', '{tmp_path}/val_*.bin')\n"
              f"print(len(c.train), len(c.val))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["300", "300"], out.stderr[-2000:]


def test_char_tokens_take_a_few_bytes_per_character(tmp_path):
    """--tokenizer char (the default): the vocabulary is the text's distinct characters by code
    point, the ids index it (checked against Python's own sorted(set(text))); loading a text took
    ~38 bytes per character at the peak (np.unique's sort and int64 inverse), now the file's bytes,
    the text, its UTF-32 codes and the int32 ids (~10)."""
    import tracemalloc

    text = "ab\u00e9\n\u20ac\x00\U0001f600z" * 3
    chars, ids = D.char_ids(text)
    assert chars == sorted(set(text)) and ids.dtype == np.int32
    assert "".join(chars[i] for i in ids) == text
    assert D.char_ids("")[0] == [] and len(D.char_ids("")[1]) == 0
    path = tmp_path / "big.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.\n" * 70_000 + "\u20ac")  # ~3.2 MB
    n = len(path.read_bytes())
    tracemalloc.start()
    try:
        c = train.Corpus.load(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.vocab_size == len(set(path.read_text()))
    assert peak / n < 14, f"{peak / n:.1f} bytes per character at the peak"


def test_a_cached_text_is_not_read_into_memory(tmp_path, monkeypatch):
    """--tokenizer gpt2 on a text: the cache is found by the text's hash, now computed as the file is
    read; the whole text was read into memory at every start, cache hit or not (a 10 GB corpus:
    10 GB of RSS to find its cached shard)."""
    import tracemalloc

    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be: that is the question.\n" * 100_000)  # 4.3 MB
    monkeypatch.setattr(tok, "gpt2_encode", lambda s: np.arange(len(s) // 4, dtype=np.uint16))  # (no BPE needed)
    cache = tok.tokenize_cached(text)
    tracemalloc.start()
    try:
        assert tok.tokenize_cached(text) == cache
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # (hashlib reads 256 KiB at a time)


def test_a_note_is_printed_once_a_job(capsys, monkeypatch):
    """By the --nproc launcher (or a process alone, or a torchrun job's rank 0), not again by each
    rank, which checks the same flags (a note came out three times with --nproc 2)."""
    from zerofuse.train.checks import note

    for env, printed in (({}, True), ({"ZEROFUSE_TRAIN_LAUNCHED": "1"}, False), ({"RANK": "1"}, False),
                         ({"RANK": "0"}, True)):
        with monkeypatch.context() as m:
            for k in ("ZEROFUSE_TRAIN_LAUNCHED", "RANK"):
                m.delenv(k, raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            note("something")
        assert (capsys.readouterr().err == "zerofuse-train: note: something\n") == printed, env


def _read_only(monkeypatch, folder: Path) -> None:
    """folder as a read-only one for tokenize_cached (the tests run as root, which writes anywhere)."""
    access = tok.os.access
    monkeypatch.setattr(tok.os, "access", lambda p, mode: access(p, mode) and not (
        mode == tok.os.W_OK and Path(p).resolve() == folder.resolve()))


@pytest.mark.skipif(not tok.gpt2_available(), reason=f"GPT-2 BPE not installed: {tok.GPT2_INSTALL}")
def test_a_validation_text_is_cached_as_the_training_text(tmp_path, monkeypatch):
    """--val-data's text was tokenized by the ranks with no fallback folder: from a read-only folder
    its cache went to the working directory, so a text given as both --data and --val-data trained
    and validated on the same tokens unrefused (two caches, two files); and a cache next to shards
    was matched by the folder's --data glob (taken as training data, or refused at the next run)."""
    ro, out = tmp_path / "ro", tmp_path / "out"
    ro.mkdir()
    (ro / "train.txt").write_text("To be, or not to be, that is the question. " * 300)
    (ro / "val.txt").write_text("Whether 'tis nobler in the mind to suffer. " * 300)
    _read_only(monkeypatch, ro)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(train.UsageError, match=r"^--val-data: expected a text that is not --data's"):
        _flags("--data", str(ro / "train.txt"), "--val-data", str(ro / "train.txt"), "--tokenizer", "gpt2",
               "--seq-len", "8", "--out", str(out))
    got = _flags("--data", str(ro / "train.txt"), "--val-data", str(ro / "val.txt"), "--tokenizer", "gpt2",
                 "--seq-len", "8", "--out", str(out))
    assert Path(got.val_data).parent == out and Path(got.data).parent == out
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob(".*.bin"))  # nothing in the working dir
    monkeypatch.undo()
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("s_000.bin", "s_001.bin"):
        tok.write_shard(shards / name, range(3000))
    (shards / "val.txt").write_text("Whether 'tis nobler in the mind to suffer. " * 300)
    for _ in range(2):  # (the second run found the first one's cache in the glob)
        got = _flags("--data", str(shards / "*.bin"), "--val-data", str(shards / "val.txt"), "--seq-len", "8")
        assert Path(got.val_data).parent == shards
    assert [p.name for p in tok.expand(str(shards / "*.bin"))] == ["s_000.bin", "s_001.bin"]


def test_shard_faults_name_the_file_and_the_flag(tmp_path):
    """An unreadable shard printed "[Errno 13] Permission denied" with no flag; an id past the
    vocabulary found mid-run named "shard 1", a place in the sorted glob; a glob of texts with
    --tokenizer char said the texts held GPT-2 token ids."""
    (tmp_path / "adir.bin").mkdir()
    with pytest.raises(ValueError, match=r"^--val-data: .*adir.bin: expected a readable token file"):
        tok.read_shard(tmp_path / "adir.bin", "--val-data")
    ids = np.zeros(100_000, dtype=np.uint16)
    ids[50_000:50_100] = 50_300
    tok.write_shard(tmp_path / "a.bin", range(3000))
    tok.write_shard(tmp_path / "b.bin", ids)
    sampler = D.Sampler([tok.read_shard(tmp_path / n) for n in ("a.bin", "b.bin")], 64, 8, 1, 1, 0, seed=0,
                        vocab=tok.GPT2_VOCAB)
    with pytest.raises(ValueError, match=r"^--data: .*b.bin holds token id 50300 at or past the vocabulary"):
        for step in range(5000):
            sampler.get(step)
    (tmp_path / "t.txt").write_text("hello " * 100)
    with pytest.raises(train.UsageError, match=r"is a glob pattern: it names GPT-2 token shards .* got char"):
        _flags("--data", str(tmp_path / "*.txt"), "--tokenizer", "char", "--seq-len", "8")


def test_files_that_hold_no_uint16_tokens_are_refused_by_what_they_are(tmp_path):
    """An llm.c Llama-3 shard (uint32) was read as raw uint16, header included, and refused only by a
    header value past GPT-2's vocabulary; UTF-8 text or a .npy file named .bin trained as uint16
    pairs of its bytes, silently (a review's reproductions, 2026-12-07)."""
    llama = tmp_path / "llama3_train.bin"
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240801, 7, 100)
    llama.write_bytes(header.tobytes() + np.arange(100, dtype=np.uint32).tobytes())
    text = tmp_path / "text.bin"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak. Ça va?\n" * 4)
    npy = tmp_path / "ids.bin"
    with open(npy, "wb") as f:
        np.save(f, np.arange(300, dtype=np.uint16))
    odd = tmp_path / "odd.bin"  # (a BOM, a form feed, a no-break space: text all the same)
    odd.write_text("\ufeffFirst Citizen:\fBefore we proceed\u00a0any further, hear me speak.\n" * 4, encoding="utf-8")
    for path, what in ((llama, r"an llm.c Llama-3 token file \(magic 20240801, version 7, uint32 tokens\)"),
                       (text, r"got text \(tokenize it"), (odd, r"got text \(tokenize it"),
                       (npy, r"got a NumPy .npy file")):
        with pytest.raises(ValueError, match=f"^--data: {path}: .*{what}"):
            tok.read_shard(path)
    ids = np.random.default_rng(1).integers(0, tok.GPT2_VOCAB, 4000).astype(np.uint16)
    ids.tofile(tmp_path / "raw.bin")  # (raw GPT-2 ids read as before)
    assert np.array_equal(tok.read_shard(tmp_path / "raw.bin"), ids)


@pytest.mark.skipif(not tok.gpt2_available(), reason=f"GPT-2 BPE not installed: {tok.GPT2_INSTALL}")
def test_a_cut_tokenizer_cache_is_made_again(tmp_path):
    """A tokenizer cache cut short (a full disk, a copy) was used as it was: every later run failed on
    its header, naming the cache, not the text (a review's reproduction, 2026-12-07)."""
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be: that is the question.\n" * 20)
    cache = tok.tokenize_cached(text)
    want = tok.read_shard(cache).tolist()
    cache.write_bytes(cache.read_bytes()[:-6])
    assert tok.tokenize_cached(text) == cache and tok.read_shard(cache).tolist() == want


def test_the_validation_key_names_the_validation_data():
    """A resume on another --val-data of the same length was not noted: the first run's initial val
    loss was reported beside this run's on other data (a review's reproduction, 2026-12-07)."""
    import argparse

    args = argparse.Namespace(eval_batches=2, dp=1, batch=2, seed=0)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 1000, 5000).astype(np.uint16) for _ in range(2))

    def key(tokens):
        return D.validation_key(args, D.Validation(D.Sampler(tokens, 16, 2, 1, 1, 0, 0), 2, 2, 1, 0, 0))

    assert key(a) == key(a.copy()) and key(a) != key(b)


def test_write_shard_refuses_what_its_header_cannot_count(tmp_path):
    """llm.c's header counts tokens in an int32: 2**31 tokens (4 GiB) raised numpy's bare "Python
    integer 2147483648 out of bounds for int32" (a review, 2026-12-07). Bad ids are named too."""
    many = np.broadcast_to(np.uint16(7), (2 ** 31,))  # (no memory: one element, stride 0)
    with pytest.raises(ValueError, match=r"write_shard: expected fewer than 2\*\*31 tokens in one shard .* got "
                                         r"2147483648: split them"):
        tok.write_shard(tmp_path / "big.bin", many)
    with pytest.raises(ValueError, match=r"write_shard: expected token ids in \[0, 65535\], got \[-1, 3\]"):
        tok.write_shard(tmp_path / "neg.bin", [3, -1])
    assert not list(tmp_path.iterdir())  # nothing written
