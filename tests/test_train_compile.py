"""--compile: a world of one compiles the whole model (ZeRO installs no forward hook there: over one
rank every parameter gather is a no-op), a larger world each transformer block; the compiled job
trains as the eager one. torch.compile runs with the aot_eager backend here (inductor's C++
compilation of a whole GPT takes minutes on two cores); the graphs it traces are the same."""
from __future__ import annotations

import json

import pytest
import torch

from zerofuse.train.loop import Trainer

from common import tiny_job_args

# the job's plumbing on the C++ CPU kernels (the Triton interpreter made each in-process job 10-30 s)
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _args(tmp_path, *argv):
    return tiny_job_args(tmp_path, "--steps", "4", "--log-every", "1", *argv)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 2])
def test_compile_takes_the_whole_model_in_a_world_of_one(tmp_path, monkeypatch, capsys, stage):
    compiled = []
    real = torch.nn.Module.compile

    def compile_(self, *args, **kwargs):
        compiled.append(self)
        return real(self, backend="aot_eager")

    monkeypatch.setattr(torch.nn.Module, "compile", compile_)
    eager_out, comp_out = tmp_path / "eager", tmp_path / "compiled"
    assert Trainer(_args(eager_out, "--zero-stage", str(stage)), None).run() == 0
    t = Trainer(_args(comp_out, "--zero-stage", str(stage), "--compile"), None)
    assert t.run() == 0
    assert compiled == [t.model] and t.compiled == "the whole model"
    assert not any(m._forward_pre_hooks for m in t.model.modules())  # nothing for dynamo to break on
    assert "torch.compile: the whole model" in capsys.readouterr().out
    rows = [[json.loads(line)["loss"] for line in (p / "metrics.jsonl").read_text().splitlines()]
            for p in (eager_out, comp_out)]
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-6)
    assert json.loads((comp_out / "summary.json").read_text())["compiled"] == "the whole model"
