"""zerofuse-train's optimizer flags reach the optimizer as documented (in process, one rank)."""
from __future__ import annotations

import json

import pytest
import torch

from common import tiny_job_args

pytestmark = pytest.mark.usefixtures("native_kernels")


def _losses(tmp_path, *flags):
    from zerofuse.train.loop import Trainer

    t = Trainer(tiny_job_args(tmp_path, "--steps", "4", "--log-every", "1", "--lr", "1e-2", *flags), None)
    assert t.run() == 0
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return t, torch.tensor([r["loss"] for r in recs]), [r["grad_norm"] for r in recs]


def test_lamb_with_clip_0_does_not_clip(tmp_path):
    """--clip 0 ("no clipping") with LAMB clipped at LAMB's default 1.0 (0 was passed on as "not
    given"; a review's reproduction, 2026-12-06): the run must be that of a threshold never reached."""
    t, off, norms = _losses(tmp_path / "off", "--optimizer", "lamb", "--clip", "0")
    assert t.opt.max_grad_norm is None and norms == [None] * 4
    _, high, high_norms = _losses(tmp_path / "high", "--optimizer", "lamb", "--clip", "1e9")
    assert min(high_norms) > 1  # clipping at 1.0 would scale every step's grads
    torch.testing.assert_close(off, high, rtol=1e-6, atol=0)
