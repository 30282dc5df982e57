"""GPT-2 data of the training job: token shards (llm.c header or raw uint16), the GPT-2 BPE and its
cache, the shipped GPT-2-tokenized sample, the sampler over shards, the gpt2-* presets, and a short
end-to-end run on the sample."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zerofuse import train
from zerofuse.models import GPT, config
from zerofuse.train import tokens as tok
from zerofuse.train.data import GPT2_DEFAULT, TEXT_DEFAULT

from train_common import _env

needs_bpe = pytest.mark.skipif(not tok.gpt2_available(), reason=f"GPT-2 BPE not installed: {tok.GPT2_INSTALL}")


def _raw(path, ids):
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return path


def test_llmc_and_raw_shards_read_the_same_tokens(tmp_path):
    ids = np.random.default_rng(0).integers(0, tok.GPT2_VOCAB, 5000)
    tok.write_shard(tmp_path / "a.bin", ids)
    raw = _raw(tmp_path / "b.bin", ids)
    head = np.fromfile(tmp_path / "a.bin", dtype=np.int32, count=3)
    assert head.tolist() == [20240520, 1, 5000] and (tmp_path / "a.bin").stat().st_size == 1024 + 2 * 5000
    for path in (tmp_path / "a.bin", raw):
        got = tok.read_shard(path)
        assert got.dtype == np.uint16 and np.array_equal(got, ids)


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"header says 5000 tokens \(11024 bytes with the header\), the file has 11000 bytes"),
    ("version", r"llm.c token file version 7; expected 1"),
    ("odd", r"expected an llm.c token file \(magic 20240520\) or a raw uint16 array .* got 9 bytes"),
    # the magic's low half 1000 (a review's reproduction, 2026-12-07: the header trained on as 512 tokens)
    ("magic", r"its header reads as llm.c's \(version 1, 5000 tokens, the file's size\) but its magic is "
              r"20186088; expected 20240520 \(a damaged file\)"),
])
def test_bad_shards_name_the_file_and_the_fault(tmp_path, damage, message):
    path = tmp_path / "x.bin"
    tok.write_shard(path, np.arange(5000))
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:11000])
    elif damage == "version":
        b = bytearray(path.read_bytes())
        b[4:8] = np.int32(7).tobytes()
        path.write_bytes(bytes(b))
    elif damage == "magic":
        b = bytearray(path.read_bytes())
        b[0:2] = np.uint16(1000).tobytes()
        path.write_bytes(bytes(b))
    else:
        path.write_bytes(b"123456789")
    with pytest.raises(ValueError, match=message):
        tok.read_shard(path)


def test_raw_uint32_tokens_are_refused(tmp_path):
    """GPT-2 ids written as a raw uint32 array read as uint16 (id, 0) pairs, every id below the
    vocabulary: the job trained on them silently (a review's reproduction, 2026-12-06)."""
    ids = np.random.default_rng(0).integers(1, tok.GPT2_VOCAB, 5000)
    path = tmp_path / "u32.bin"
    ids.astype(np.uint32).tofile(path)
    with pytest.raises(ValueError, match=r"u32.bin: every second uint16 of this raw token file is 0: it looks like "
                                         r"uint32 tokens"):
        tok.read_shard(path)
    assert np.array_equal(tok.read_shard(_raw(tmp_path / "u16.bin", ids)), ids)  # (its uint16 form reads)
    assert tok.read_shard(_raw(tmp_path / "zeros.bin", np.zeros(100))).tolist() == [0] * 100


def test_glob_expands_sorted_and_missing_pattern_fails(tmp_path):
    for name in ("s_02.bin", "s_00.bin", "s_01.bin"):
        _raw(tmp_path / name, [1, 2, 3])
    assert [p.name for p in tok.expand(str(tmp_path / "s_*.bin"))] == ["s_00.bin", "s_01.bin", "s_02.bin"]
    with pytest.raises(ValueError, match=r"--val-data: expected the pattern .* to match token files, matched none"):
        tok.expand(str(tmp_path / "v_*.bin"), "--val-data")


def test_corpus_of_shards_splits_the_last_or_takes_val_data(tmp_path):
    _raw(tmp_path / "t0.bin", np.arange(1000))
    _raw(tmp_path / "t1.bin", np.arange(1000, 1500))
    c = train.Corpus.load(str(tmp_path / "t*.bin"))
    assert c.kind == "gpt2" and c.vocab_size == 50257 and c.model_vocab == 50304
    assert [len(a) for a in c.train] == [1000, 450] and c.val[0].tolist() == list(range(1450, 1500))
    _raw(tmp_path / "v.bin", np.arange(7, 107))
    c = train.Corpus.load(str(tmp_path / "t*.bin"), val_path=str(tmp_path / "v.bin"))
    assert [len(a) for a in c.train] == [1000, 500] and c.val[0].tolist() == list(range(7, 107))


def test_sampler_windows_stay_inside_a_shard():
    shards = [np.arange(0, 40), np.arange(1000, 1013), np.arange(5000, 5100)]
    s = train.Sampler(shards, 8, 16, 4, 2, 1, seed=3)
    for step in range(20):
        x, y = s.get(step)
        for row in torch.cat([x, y[..., -1:]], dim=-1).reshape(-1, 9):
            assert torch.equal(row - row[0], torch.arange(9)), row  # consecutive: one shard
    # a too-short shard has no windows; no windows at all is an error
    with pytest.raises(ValueError, match=r"Sampler: expected a shard of more than seq_len \(64\) tokens"):
        train.Sampler([np.arange(10)], 64, 1, 1, 1, 0, seed=0)


def test_one_shard_sampler_draws_what_the_tensor_sampler_drew():
    """The batches of a character corpus are unchanged (checkpoints resume with the same data)."""
    tokens = torch.arange(10_000, dtype=torch.int32)
    x, y = train.Sampler(tokens, 8, 3, 2, 2, 1, seed=1).get(5)
    g = torch.Generator().manual_seed(train.data._mix(1, 0, 5))  # the former implementation
    starts = torch.randint(0, 10_000 - 8, (2, 2, 3), generator=g)[:, 1]
    chunk = tokens[starts[..., None] + torch.arange(9)].long()
    assert torch.equal(x, chunk[..., :-1]) and torch.equal(y, chunk[..., 1:])


def test_shipped_sample_is_the_shipped_text_in_gpt2_tokens():
    train_ids, val_ids = (tok.read_shard(p) for p in GPT2_DEFAULT)
    assert len(train_ids) + len(val_ids) == 338025 and len(val_ids) == int(338025 * 0.1)
    if tok.gpt2_available():
        ids = tok.gpt2_encode(TEXT_DEFAULT.read_text(encoding="utf-8"))
        assert np.array_equal(ids, np.concatenate([train_ids, val_ids]))


@needs_bpe
def test_gpt2_encode_holds_a_group_of_chunks_encodings_at_a_time(monkeypatch):
    """The tokenizer's Encodings take ~190 bytes per token: the whole text's at once (one
    encode_batch of every chunk) needed ~50 GB of memory for a 1 GB text."""
    real, batches = tok.gpt2_tokenizer(), []

    class Recording:
        def encode_batch(self, chunks):
            batches.append(len(chunks))
            return real.encode_batch(chunks)

    monkeypatch.setattr(tok, "gpt2_tokenizer", Recording)
    monkeypatch.setattr(tok, "_GROUP", 2)
    ids = tok.gpt2_encode(TEXT_DEFAULT.read_text(encoding="utf-8"))
    assert batches == [2, 2, 1], batches
    assert np.array_equal(ids, np.concatenate([tok.read_shard(p) for p in GPT2_DEFAULT]))


@needs_bpe
def test_gpt2_bpe_is_gpt2s():
    assert tok.gpt2_encode("Hello world").tolist() == [15496, 995]  # GPT-2's ids
    text = TEXT_DEFAULT.read_text(encoding="utf-8")[:200_000]
    whole = tok.gpt2_tokenizer().encode(text).ids
    pieces = tok._chunks(text, 997)  # cut only where the pre-tokenizer cuts: the same tokens
    assert len(pieces) > 100 and "".join(pieces) == text
    assert np.concatenate([tok.gpt2_encode(p) for p in pieces]).tolist() == whole
    assert tok.gpt2_decode(whole) == text


@needs_bpe
def test_tokenize_cached_once_next_to_the_text(tmp_path, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be: that is the question.\n" * 20)
    cache = tok.tokenize_cached(text)
    assert cache.parent == tmp_path and cache.name.startswith(".t.txt.gpt2-") and cache.suffix == ".bin"
    assert tok.read_shard(cache).tolist() == tok.gpt2_encode(text.read_text()).tolist()
    monkeypatch.setattr(tok, "gpt2_encode", lambda s: pytest.fail("tokenized twice"))
    assert tok.tokenize_cached(text) == cache
    text.write_text("changed\n" * 50)  # another text: another cache
    monkeypatch.undo()
    assert tok.tokenize_cached(text) != cache


@needs_bpe
def test_tokenize_cached_on_a_filesystem_without_locks(tmp_path, monkeypatch):
    """The token cache's lock is the package's one flock helper: on a filesystem without flock
    (ENOLCK, some NFS mounts) the text is tokenized unguarded, not refused with an OSError."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    text = tmp_path / "t.txt"
    text.write_text("All the world's a stage.\n" * 10)
    assert tok.read_shard(tok.tokenize_cached(text)).tolist() == tok.gpt2_encode(text.read_text()).tolist()


def test_gpt2_presets_are_gpt2():
    for name, layers, heads, dim, params in (("gpt2-124m", 12, 12, 768, 124_475_904),
                                              ("gpt2-350m", 24, 16, 1024, 354_871_296),
                                              ("gpt2-774m", 36, 20, 1280, 774_090_240)):
        cfg = config(name)
        assert (cfg.n_layer, cfg.n_head, cfg.dim, cfg.seq_len, cfg.vocab_size) == (layers, heads, dim, 1024, 50304)
        assert cfg.bias and cfg.tie_embeddings and cfg.norm == "layernorm"
        with torch.device("meta"):
            model = GPT(cfg)
        assert model.num_params() == params  # llm.c's counts (vocab 50304)
        assert model.head.weight is model.wte.weight


def _flags(*argv):
    args = train._parser().parse_args(["--device", "cpu", "--nproc", "1", *argv])
    train.validate(args)
    return args


def test_flags_gpt2_defaults_and_errors(tmp_path):
    a = _flags("--model", "gpt2-124m")
    assert (a.tokenizer, Path(a.data), Path(a.val_data)) == ("gpt2", *GPT2_DEFAULT)
    assert _flags("--data", str(GPT2_DEFAULT[1]), "--seq-len", "64").tokenizer == "gpt2"
    assert _flags("--model", "gpt2-124m", "--tokenizer", "char").data.endswith("tinyshakespeare.txt")
    bad = _raw(tmp_path / "bad.bin", [1, 2, 50_400, 3] * 100)
    short = _raw(tmp_path / "short.bin", range(50))
    _raw(tmp_path / "part_0.bin", range(5000))
    _raw(tmp_path / "part_1.bin", range(50))
    for argv, message in (
        (("--data", str(bad), "--seq-len", "8"), r"^--data: .*bad.bin: expected GPT-2 token ids below 50257, found 50400"),
        (("--data", str(GPT2_DEFAULT[1]), "--tokenizer", "char"),
         r"^--tokenizer: --data '.*' holds GPT-2 token ids, expected --tokenizer gpt2 \(or none\), got char"),
        (("--val-data", str(GPT2_DEFAULT[1])), r"^--val-data: expected GPT-2 tokens .*got --tokenizer char"),
        (("--data", str(tmp_path / "none_*.bin")), r"^--data: expected the pattern .* to match token files"),
        (("--data", str(GPT2_DEFAULT[0]), "--val-data", str(short)),
         r"^--val-data: expected a val shard of at least 65 tokens for --seq-len 64, got at most 50$"),
        # a short last shard of a glob: where validation comes from, and the way out
        (("--data", str(tmp_path / "part_*.bin"), "--seq-len", "32"),
         r"^--data: expected a val shard of at least 33 tokens for --seq-len 32, got at most 5 \(without --val-data, "
         r"validation is the last 10% of the last --data file in sorted order: name a validation file with --val-data\)"),
    ):
        with pytest.raises(train.UsageError, match=message):
            _flags(*argv)
    # a shard of exactly --seq-len + 1 tokens holds one window (refused before: "at least 66")
    exact = _raw(tmp_path / "exact.bin", range(65))
    assert _flags("--data", str(GPT2_DEFAULT[0]), "--val-data", str(exact), "--seq-len", "64").val_data == str(exact)


@pytest.mark.timeout(300)
def test_end_to_end_on_the_gpt2_sample(tmp_path):
    """Two ranks, ZeRO-2, a small model on GPT-2 tokens: the vocabulary is GPT-2's padded, the first
    loss is about ln(50304) and training lowers it."""
    cmd = [sys.executable, "-m", "zerofuse.train", "--nproc", "2", "--model", "tiny", "--data", str(GPT2_DEFAULT[0]),
           "--val-data", str(GPT2_DEFAULT[1]), "--layers", "2", "--dim", "64", "--heads", "2", "--seq-len", "32",
           "--batch", "4", "--steps", "8", "--warmup", "2", "--lr", "3e-3", "--eval-every", "0",
           "--eval-batches", "2", "--sample-tokens", "8", "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout + p.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"]["vocab_size"] == 50304 and summary["model"]["tie_embeddings"] is False
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert abs(losses[0] - math.log(50304)) < 0.3 and losses[-1] < losses[0] - 0.3, losses
    assert "gpt2 tokens" in p.stdout


def test_an_llmc_file_without_the_bin_suffix_is_read_as_tokens(tmp_path):
    """--data naming one llm.c token file not ending in .bin was read as text: its bytes trained on
    (vocabulary 256), silently; through a glob it was read as tokens (a review, 2026-12-06)."""
    shard = tmp_path / "train_shard"
    shard.write_bytes(GPT2_DEFAULT[0].read_bytes())
    assert tok.is_shard_spec(str(shard))
    text = tmp_path / "notes.txt"
    text.write_text("plain text, not tokens\n")
    assert not tok.is_shard_spec(str(text))
    args = _flags("--data", str(shard))
    assert args.tokenizer == "gpt2"


@needs_bpe
def test_crlf_text_is_cut_into_pieces_with_the_whole_texts_tokens():
    """Windows line ends were never cut (the piece rule wanted a non-space before the newline: \r is
    one), so a large CRLF text was pre-tokenized whole at once (~1.1 GiB more for 6.7 MB, growing with
    the text). Cut between \r and \n now, where GPT-2's pre-tokenizer cuts too."""
    text = TEXT_DEFAULT.read_text(encoding="utf-8")[:100_000].replace("\n", "\r\n")
    pieces = tok._chunks(text, 997)
    assert len(pieces) > 80 and "".join(pieces) == text
    assert np.concatenate([tok.gpt2_encode(p) for p in pieces]).tolist() == tok.gpt2_tokenizer().encode(text).ids


@needs_bpe
def test_a_bad_validation_text_is_named_by_its_flag(tmp_path):
    bad = tmp_path / "val.txt"
    bad.write_bytes(b"ok \xff\xfe no")
    from zerofuse.train.data import Corpus
    with pytest.raises(ValueError, match=r"^--val-data: .*val.txt is not UTF-8 text"):
        Corpus.load(str(GPT2_DEFAULT[0]), "gpt2", str(bad))


def test_notes_print_once_under_slurm(monkeypatch, capsys):
    """srun sets SLURM_PROCID, not RANK: every task printed each note."""
    from zerofuse.train import checks
    for k in ("RANK", "WORLD_SIZE", "ZEROFUSE_TRAIN_LAUNCHED"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    printed = []
    for rank in ("0", "1"):
        monkeypatch.setenv("SLURM_PROCID", rank)
        checks.note("hello")
        printed.append(capsys.readouterr().err)
    assert printed == ["zerofuse-train: note: hello\n", ""]


def test_the_validation_set_is_the_same_for_the_same_dp_times_batch():
    """The validation windows over every DP rank: one set for dp 1 x batch 8, 2 x 4 and 4 x 2 (it was
    --eval-batches batches of the per-rank batch: spreading one global batch over more ranks
    validated on fewer, other windows; a review's reproduction, 2026-12-06); each rank's batches
    are its own (no window twice unless drawn twice)."""
    from zerofuse.train.data import Sampler, Validation

    tokens = np.arange(5000) % 50000
    sampler = Sampler([tokens], 16, 1, 1, 1, 0, seed=3)

    def windows(dp, batch):
        sets = [Validation(sampler, 3, batch, dp, r, seed=3) for r in range(dp)]
        assert all(len(v) == 3 for v in sets)
        rows = [v.get(k)[0] for v in sets for k in range(3)]
        assert all(r.shape == (batch, 16) for r in rows)
        return sorted(tuple(row.tolist()) for r in rows for row in r)

    want = windows(1, 8)
    assert windows(2, 4) == want and windows(4, 2) == want and len(want) == 24
    assert windows(1, 4) != want[:12]  # (another dp x batch: another set)
