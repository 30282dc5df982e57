"""The training data: a text file as character (or byte) tokens, split train/val, and the sampler
that makes a step's batches a pure function of (seed, step)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

VAL_FRACTION = 0.1


def _data_path(args) -> Path:
    if args.data is not None:
        return Path(args.data)
    import zerofuse
    return Path(zerofuse.__file__).parent / "data" / "tinyshakespeare.txt"


@dataclasses.dataclass
class Corpus:
    """Character-level tokens of a UTF-8 text (vocab = its sorted characters), or bytes (vocab 256)
    for a file that is not UTF-8 or with --tokenizer byte. train/val: the first 90% and the rest."""
    kind: str
    chars: list[str] | None
    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def load(cls, path, tokenizer: str = "char") -> "Corpus":
        raw = Path(path).read_bytes()
        chars = None
        if tokenizer == "char":
            try:
                codes = np.frombuffer(raw.decode("utf-8").encode("utf-32-le"), dtype=np.uint32)
                vocab, ids = np.unique(codes, return_inverse=True)  # sorted by code point
                chars = [chr(c) for c in vocab]
            except UnicodeDecodeError:
                tokenizer = "byte"
        if tokenizer == "byte":
            ids = np.frombuffer(raw, dtype=np.uint8)
        tokens = torch.from_numpy(ids.astype(np.int32))
        split = len(tokens) - int(len(tokens) * VAL_FRACTION)
        return cls(tokenizer, chars, tokens[:split], tokens[split:])

    @property
    def vocab_size(self) -> int:
        return 256 if self.chars is None else len(self.chars)

    def encode(self, text: str) -> list[int]:
        if self.chars is None:
            return list(text.encode("utf-8"))
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text if c in index]

    def decode(self, ids) -> str:
        if self.chars is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in ids if i < len(self.chars))

    def identity(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


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
    and any layout with the same dp × batch sees the same data."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch: int, accum: int, dp: int, dp_rank: int, seed: int):
        self.tokens, self.seq_len, self.batch, self.accum = tokens, seq_len, batch, accum
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self._window = torch.arange(seq_len + 1)

    def get(self, step: int, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (accum, batch, seq_len) int64."""
        g = torch.Generator().manual_seed(_mix(self.seed, stream, step))
        high = len(self.tokens) - self.seq_len - 1
        starts = torch.randint(0, high + 1, (self.accum, self.dp, self.batch), generator=g)[:, self.dp_rank]
        chunk = self.tokens[starts[..., None] + self._window].long()
        return chunk[..., :-1], chunk[..., 1:]
