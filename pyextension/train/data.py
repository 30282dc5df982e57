"""The training data: a text file as character (or byte) tokens, or GPT-2 tokens (token shards, or a
text tokenized with the GPT-2 BPE, zerofuse.train.tokens), split train/val, and the sampler that
makes a step's batches a pure function of (seed, step)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from . import tokens as tok

VAL_FRACTION = 0.1
_PACKAGE_DATA = Path(__file__).resolve().parent.parent / "data"
TEXT_DEFAULT = _PACKAGE_DATA / "tinyshakespeare.txt"
# the same text as GPT-2 tokens (its last 10% as the validation file): the default of the gpt2-* models
GPT2_DEFAULT = (_PACKAGE_DATA / "tinyshakespeare-gpt2-train.bin", _PACKAGE_DATA / "tinyshakespeare-gpt2-val.bin")


def _data_path(args) -> Path:
    return Path(args.data) if args.data is not None else TEXT_DEFAULT


def _split(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    split = len(arr) - int(len(arr) * VAL_FRACTION)
    return arr[:split], arr[split:]


def char_ids(text: str) -> tuple[list[str], np.ndarray]:
    """The character vocabulary of ``text`` (its distinct characters sorted by code point) and the
    text as int32 ids into it: a table from code point to id, no sort of the text (np.unique's
    sort and int64 inverse took ~38 bytes per character at the peak, 0.76 GB for a 20 MB text, and
    9x the time; this takes ~8: the UTF-32 codes and the ids)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    if not len(codes):
        return [], np.zeros(0, dtype=np.int32)
    present = np.zeros(int(codes.max()) + 1, dtype=bool)  # at most 0x110000 code points
    present[codes] = True
    vocab = np.flatnonzero(present)
    table = np.zeros(len(present), dtype=np.int32)
    table[vocab] = np.arange(len(vocab), dtype=np.int32)
    return [chr(c) for c in vocab], table[codes]


@dataclasses.dataclass
class Corpus:
    """Tokens for training and validation, each a list of 1-D arrays (one per shard).
    kind "char": the sorted characters of a UTF-8 text are the vocabulary; "byte": its bytes (a
    file that is not UTF-8 falls back to it); "gpt2": GPT-2 token ids (shards, or a text tokenized
    into a cached shard). Without a separate validation set, validation is the last 10% of the
    (last) training file."""
    kind: str
    chars: list[str] | None
    train: list[np.ndarray]
    val: list[np.ndarray]

    @classmethod
    def load(cls, path, tokenizer: str = "char", val_path=None) -> "Corpus":
        path = str(path)
        if tokenizer == "gpt2" or tok.is_shard_spec(path):
            return cls._load_tokens(path, val_path)
        raw = Path(path).read_bytes()
        chars = None
        if tokenizer == "char":
            try:
                chars, ids = char_ids(raw.decode("utf-8"))
            except UnicodeDecodeError:
                tokenizer = "byte"
        if tokenizer == "byte":
            ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
        train, val = _split(ids)
        return cls(tokenizer, chars, [train], [val])

    @classmethod
    def _load_tokens(cls, spec: str, val_spec) -> "Corpus":
        """GPT-2 tokens; a text file (not .bin) is tokenized into its cache first."""
        def files(s, flag):
            if not tok.is_shard_spec(str(s)):
                s = tok.tokenize_cached(s, flag=flag)
            return tok.expand(str(s), flag)

        def shards(paths, flag):
            _open_files(len(paths), flag)
            return [tok.read_shard(p, flag) for p in paths]
        train_files = files(spec, "--data")
        train = shards(train_files, "--data")
        if val_spec is None:
            last, val = _split(train[-1])
            train, val = train[:-1] + [last], [val]
        else:
            val_files = files(val_spec, "--val-data")
            both = sorted({p.resolve() for p in train_files} & {p.resolve() for p in val_files})
            if both:  # (the validation loss was measured on training data without a word)
                raise ValueError(f"--val-data: expected files that are not training data, got {[str(p) for p in both]} "
                                 f"also matched by --data {spec!r}")
            val = shards(val_files, "--val-data")
        return cls("gpt2", None, train, val)

    @property
    def vocab_size(self) -> int:
        if self.kind == "gpt2":
            return tok.GPT2_VOCAB
        return 256 if self.chars is None else len(self.chars)

    @property
    def model_vocab(self) -> int:
        """The model's vocabulary: GPT-2's padded to a multiple of 64 (50304); a character or byte
        vocabulary as it is (the vocab-parallel layers split an uneven vocabulary)."""
        return tok.padded_vocab(self.vocab_size) if self.kind == "gpt2" else self.vocab_size

    def encode(self, text: str) -> list[int]:
        if self.kind == "gpt2":
            return tok.gpt2_tokenizer().encode(text).ids
        if self.chars is None:
            return list(text.encode("utf-8"))
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text if c in index]

    @property
    def document_start(self) -> int | None:
        """The token that starts a document (GPT-2's <|endoftext|>, as llm.c's shards put it before
        each one); None for char/byte text."""
        return tok.GPT2_EOT if self.kind == "gpt2" else None

    def prompt(self) -> list[int]:
        """What generation starts from: a newline (GPT-2: <|endoftext|>, the start of a document)."""
        return [tok.GPT2_EOT] if self.kind == "gpt2" else (self.encode("\n") or [0])

    def decode(self, ids) -> str:
        if self.kind == "gpt2":
            if not tok.gpt2_available():
                return f"(GPT-2 token ids; {tok.GPT2_INSTALL} to see text) {list(ids)}"
            return tok.gpt2_decode(ids)
        if self.chars is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in ids if i < len(self.chars))

    def identity(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


def _open_files(n: int, flag: str) -> None:
    """Each memory-mapped shard holds a file descriptor: the soft limit is raised toward the hard one
    for n shards (llm.c's FineWeb-100B has ~1000; the default soft limit is often 1024, which ended
    in a bare "[Errno 24] Too many open files"); ValueError naming the flag when even that is short."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # those open now count: the --val-data shards come while the --data ones are mapped
        held = len(os.listdir("/proc/self/fd"))
    except OSError:
        held = 0
    need = n + held + 256  # (files opened later, sockets of the process group)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(f"{flag}: {n} token files need about {need} open files ({held} open already), the "
                             f"limit is {hard} (ulimit -n): raise it, or merge the shards")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _mix(*parts: int) -> int:
    """A fixed 63-bit seed from integers (Python's hash() is salted per process)."""
    h = 1469598103934665603
    for x in parts:
        h = ((h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


class Sampler:
    """Batches as a pure function of (seed, step): one generator seeded by (seed, step) draws the
    start offsets of the whole global batch (accum × dp × batch) and DP rank r takes slice r. So
    ranks get distinct data, --resume at step s continues exactly (the sampler state is the step),
    and any layout with the same accum × dp × batch sees the same windows at each step (the
    same global batch, its windows dealt to other ranks and micro-batches). Over several shards a start is drawn
    over all windows of all shards (a window never spans two shards)."""

    def __init__(self, tokens, seq_len: int, batch: int, accum: int, dp: int, dp_rank: int, seed: int,
                 vocab: int | None = None, flag: str = "--data"):
        # ids must be below vocab: checked per batch (a shard's middle is not read at the start)
        self.vocab, self.flag = vocab, flag
        shards = [tokens] if not isinstance(tokens, (list, tuple)) else list(tokens)
        self.shards = [s.numpy() if isinstance(s, torch.Tensor) else s for s in shards]
        self.seq_len, self.batch, self.accum = seq_len, batch, accum
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        # windows of seq_len + 1 tokens per shard (a too-short shard has none)
        self.ends = np.cumsum([max(0, len(s) - seq_len) for s in self.shards])
        self.firsts = np.concatenate([[0], self.ends[:-1]])  # each shard's first window index
        if not len(self.ends) or self.ends[-1] == 0:
            raise ValueError(f"Sampler: expected a shard of more than seq_len ({seq_len}) tokens, "
                             f"got shards of {[len(s) for s in self.shards]}")
        self._window = np.arange(seq_len + 1)

    def get(self, step: int, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (accum, batch, seq_len) int64."""
        g = torch.Generator().manual_seed(_mix(self.seed, stream, step))
        starts = torch.randint(0, int(self.ends[-1]), (self.accum, self.dp, self.batch), generator=g)[:, self.dp_rank]
        return self.read(starts.numpy(), f"step {step}")

    def read(self, starts: np.ndarray, where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows starting at ``starts`` (window indices over all shards),
        each starts.shape + (seq_len,) int64."""
        shard = np.searchsorted(self.ends, starts, side="right")
        local = starts - self.firsts[shard]
        chunk = np.empty(starts.shape + (self.seq_len + 1,), dtype=np.int64)
        for s in np.unique(shard):
            at = shard == s
            chunk[at] = self.shards[s][local[at][:, None] + self._window]
        if self.vocab is not None and chunk.max() >= self.vocab:  # one max over the batch
            row = np.unravel_index(int(chunk.argmax()), chunk.shape)[:-1]
            k = int(shard[row])  # (by file: "shard 1" was a place in the sorted glob, a val split's "shard 0")
            name = getattr(self.shards[k], "filename", None) or f"shard {k}"
            raise ValueError(f"{self.flag}: {name} holds token id {int(chunk.max())} at or past the "
                             f"vocabulary ({self.vocab}) in a window read at {where}; expected GPT-2 token ids "
                             f"(the start checks read the first and last 2^20 tokens of each shard)")
        chunk = torch.from_numpy(chunk)
        return chunk[..., :-1], chunk[..., 1:]


class Validation:
    """The validation set: ``batches`` × ``dp`` × ``batch`` windows drawn once from (seed), the same
    set for every layout of the same dp × batch (as training's data), dealt to the DP ranks: rank r
    evaluates its ``batch`` windows of each of the ``batches`` batches (every rank runs as many
    forwards: ZeRO-3's are collective). Another dp × batch: another set. (It was --eval-batches
    batches of the per-rank --batch: spreading one global batch over more ranks validated on fewer,
    other windows, silently; a review's reproduction, 2026-12-06.)"""

    def __init__(self, sampler: Sampler, batches: int, batch: int, dp: int, dp_rank: int, seed: int):
        self.sampler = sampler
        g = torch.Generator().manual_seed(_mix(seed, 1, 0))
        self.starts = torch.randint(0, int(sampler.ends[-1]), (batches, dp, batch), generator=g)[:, dp_rank].numpy()

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of validation batch k, each (batch, seq_len)."""
        return self.sampler.read(self.starts[k], f"validation batch {k}")


def shards_digest(sampler: Sampler) -> str:
    """The data a sampler draws from, told apart cheaply: its shards' lengths and first and last
    1024 tokens (another file, a glob that grew)."""
    h = hashlib.sha256()
    for s in sampler.shards:
        h.update(np.int64(len(s)).tobytes())
        h.update(np.ascontiguousarray(s[:1024]).tobytes())
        h.update(np.ascontiguousarray(s[-1024:]).tobytes())
    return h.hexdigest()[:16]


def validation_key(args, val: Validation) -> list:
    """What the validation set is drawn from: --eval-batches, dp x --batch, --seed and the data
    (shards_digest: another --val-data). A checkpoint records it; a resume that changes it says so
    and reports no initial val loss (the first run's, on another set, was compared with this run's,
    silently: a review's reproduction, 2026-12-07)."""
    return [args.eval_batches, args.dp * args.batch, args.seed, shards_digest(val.sampler)]
