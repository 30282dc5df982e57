"""--cuda-graphs (zerofuse/train/graphs.py): the whole step captured once and replayed.

On the CPU: the refusals (each with its one-line reason, the job training eagerly), and the
graphed step's plumbing with a stand-in graph that does what a CUDA graph does with the step's
tensors (nothing runs while capturing; a replay runs the captured step on the batch buffer and the
device lr, and overwrites the output tensors the capture returned): its losses and grad norms
equal the eager job's bit for bit under a changing lr. On a GPU: 20 graphed steps against 20 eager
ones."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

from zerofuse import train
from zerofuse.train import graphs
from zerofuse.train.loop import Trainer

from common import tiny_job_args

# the job's plumbing on the C++ CPU kernels (the Triton interpreter made each in-process job 10-30 s)
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _args(tmp_path, *argv):
    return tiny_job_args(tmp_path, "--steps", "8", "--warmup", "4", "--log-every", "4", *argv)


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


class _StandInGraph:
    """What torch.cuda.CUDAGraph does with the step, on the CPU: capture() runs the step's Python but
    leaves every tensor the step changes as it was (a capture executes nothing), replay() runs the
    step on the graph's batch buffer and writes its results into the tensors the capture returned."""

    def __init__(self, trainer):
        self.t = trainer
        self.captures = self.replays = 0

    def _state(self):
        eng, opt = self.t.model._zerofuse_zero, self.t.opt
        return [u.full for u in eng.units] + [x for st in opt.unit_states for x in st.values()] + list(opt._steps)

    @contextlib.contextmanager
    def capture(self):
        saved = [x.detach().clone() for x in self._state()]
        yield
        with torch.no_grad():
            for x, v in zip(self._state(), saved):
                x.copy_(v)
        self.captures += 1

    def replay(self):
        sg = self.t.graphs
        loss = self.t.step_body(sg.batch[0], sg.batch[1])
        with torch.no_grad():
            for mine, new in zip(sg.outputs, (loss, self.t.opt.last_grad_norm)):
                mine.copy_(new)
        self.replays += 1


def test_graphed_step_plumbing_equals_the_eager_job(tmp_path, monkeypatch):
    eager = tmp_path / "eager"
    assert Trainer(_args(eager), None).run() == 0
    made = []

    class StandInStepGraph(graphs.StepGraph):
        def __init__(self, trainer):
            super().__init__(trainer, graph_factory=lambda: made.append(_StandInGraph(trainer)) or made[-1])

    monkeypatch.setattr(graphs, "reason_not", lambda trainer: None)
    monkeypatch.setattr(graphs, "StepGraph", StandInStepGraph)
    graphed = tmp_path / "graphed"
    t = Trainer(_args(graphed), None)
    assert t.run() == 0
    assert len(made) == 1 and made[0].captures == 1 and made[0].replays == 8 - graphs.WARMUP
    assert t.graphs.captured_at == graphs.WARMUP
    # the capture's step is marked: no steady step (the summary's step time counted it, 2026-12-06)
    assert [r.get("graph_capture", False) for r in _rows(graphed)] == [i == graphs.WARMUP for i in range(8)]
    a, b = _rows(eager), _rows(graphed)
    assert [r["lr"] for r in a] == [r["lr"] for r in b] and len({r["lr"] for r in a}) > 4  # the lr changes
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (eager, graphed))
    assert sa["final_val_loss"] == sb["final_val_loss"]
    assert sb["cuda_graphs"] == f"on (captured at step {graphs.WARMUP + 1} after {graphs.WARMUP} eager steps)"


def test_a_failed_capture_is_logged_and_the_job_trains_eagerly(tmp_path, monkeypatch, capsys):
    class Refusing(_StandInGraph):
        @contextlib.contextmanager
        def capture(self):
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
            yield

    class RefusedStepGraph(graphs.StepGraph):
        def __init__(self, trainer):
            super().__init__(trainer, graph_factory=lambda: Refusing(trainer))

    eager = tmp_path / "eager"
    assert Trainer(_args(eager), None).run() == 0
    monkeypatch.setattr(graphs, "reason_not", lambda trainer: None)
    monkeypatch.setattr(graphs, "StepGraph", RefusedStepGraph)
    failed = tmp_path / "failed"
    assert Trainer(_args(failed, "--cuda-graphs"), None).run() == 0
    out = capsys.readouterr().out
    assert ("cuda graphs: capture failed at step 4 (RuntimeError: operation not permitted when stream is "
            "capturing); training eagerly") in out
    assert [r["loss"] for r in _rows(eager)] == [r["loss"] for r in _rows(failed)]
    assert json.loads((failed / "summary.json").read_text())["cuda_graphs"].startswith("off: capture failed")


@pytest.mark.parametrize("flag, reason", [("--cuda-graphs", "the device is cpu, not CUDA"),
                                          ("--no-cuda-graphs", "--no-cuda-graphs")])
def test_refusals_are_logged_in_one_line(tmp_path, capsys, flag, reason):
    """Asked for on the CPU: one line saying why not (on CUDA the line is always there)."""
    assert Trainer(_args(tmp_path, "--steps", "2", flag), None).run() == 0
    logged = f"cuda graphs: off: {reason}\n" in capsys.readouterr().out
    assert logged == (flag == "--cuda-graphs")
    assert json.loads((tmp_path / "summary.json").read_text())["cuda_graphs"] == f"off: {reason}"


@pytest.mark.parametrize("argv, reason", [
    (("--zero-stage", "3"), "ZeRO-3 frees"),
    (("--offload", "optimizer"), "offload steps the optimizer on the host"),
    (("--model", "moe-tiny"), "MoE layers read"),
    (("--activation-checkpointing", "full"), "activation checkpointing"),
    ((), "fp16 loss scaling"),  # (fp16 is refused on the CPU by the flags' checks: set below)
])
def test_what_cannot_be_captured_says_why(tmp_path, argv, reason):
    class Fake:
        device, world = torch.device("cuda"), 1

    args = _args(tmp_path, *argv)
    if not argv:
        args.precision = "fp16"
    fake = Fake()
    fake.args = args
    fake.cfg = type("C", (), {"moe_experts": 8 if args.model_name == "moe-tiny" else 0})()
    assert reason in graphs.reason_not(fake)
    fake.world = 2
    assert graphs.reason_not(fake).startswith("2 ranks: only a world of one is captured")


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_graphed_steps_equal_eager_steps(tmp_path):
    """20 steps of a GPT-2-shaped model, bf16, ZeRO-2: captured after the warm-up and replayed, against
    the same job eager. The same kernels run in the same order on the same inputs: bit for bit."""
    argv = ["--model", "gpt2-124m", "--layers", "2", "--seq-len", "256", "--batch", "4", "--steps", "20",
            "--warmup", "10", "--log-every", "5"]
    runs = {}
    for flag in ("--no-cuda-graphs", "--cuda-graphs"):
        out = tmp_path / flag.strip("-")
        args = train._parser().parse_args(
            ["--device", "cuda", "--nproc", "1", *argv, "--eval-every", "0", "--eval-batches", "2",
             "--sample-tokens", "0", "--ckpt-every", "0", "--out", str(out), flag])
        train.validate(args)
        t = Trainer(args, None)
        assert t.run() == 0
        runs[flag] = (_rows(out), json.loads((out / "summary.json").read_text()))
    (ea, es), (ga, gs) = runs["--no-cuda-graphs"], runs["--cuda-graphs"]
    assert gs["cuda_graphs"].startswith("on (captured"), gs["cuda_graphs"]
    assert [(r["loss"], r["grad_norm"]) for r in ea] == [(r["loss"], r["grad_norm"]) for r in ga]
    assert es["final_val_loss"] == gs["final_val_loss"]


@pytest.mark.parametrize("end_fails", [False, True], ids=["body_raises", "then_the_end_raises"])
def test_a_capture_failing_mid_backward_leaves_no_half_step(tmp_path, monkeypatch, end_fails):
    """The capture raises from inside backward (after ZeRO counted some grads and queued its end of
    backward): abandon_step resets that (and drops what the capture built), and the job goes on
    eagerly with the eager job's losses. When the capture's end then fails too (as torch's does
    over an invalidated capture), the log names the first error, then the end's (and not an error
    the body had handled before: it named one as the first, as "then" the body's)."""
    state = {"capturing": False}

    class MidBackward(_StandInGraph):
        @contextlib.contextmanager
        def capture(self):
            state["capturing"] = True
            try:
                with super().capture():
                    yield
            finally:
                state["capturing"] = False
                if end_fails:
                    raise RuntimeError("operation failed due to a previous error during capture")

    class Failing(graphs.StepGraph):
        def __init__(self, trainer):
            super().__init__(trainer, graph_factory=lambda: MidBackward(trainer))
            params = list(trainer.model.parameters())

            def hook(p):
                if state["capturing"]:
                    try:  # an error handled inside the body is no part of the report
                        {}["missing"]
                    except KeyError:
                        raise RuntimeError("operation not permitted when stream is capturing") from None
            params[len(params) // 2].register_post_accumulate_grad_hook(hook)

    eager = tmp_path / "eager"
    assert Trainer(_args(eager), None).run() == 0
    monkeypatch.setattr(graphs, "reason_not", lambda trainer: None)
    monkeypatch.setattr(graphs, "StepGraph", Failing)
    failed = tmp_path / "failed"
    t = Trainer(_args(failed), None)
    assert t.run() == 0
    assert t.graphs.failed.startswith("capture failed at step 4 (RuntimeError: operation not permitted")
    assert t.graphs.failed.endswith("; then RuntimeError: operation failed due to a previous error during capture)"
                                    if end_fails else "capturing)"), t.graphs.failed
    assert [(r["loss"], r["grad_norm"]) for r in _rows(eager)] == [(r["loss"], r["grad_norm"]) for r in _rows(failed)]


def test_a_failed_capture_ends_the_allocators_capture(monkeypatch):
    """torch 2.11's capture_end raises over an invalidated capture before ending the allocator's
    capture into the graph's pool (the allocator then serves every later allocation of the thread
    from the dead pool and asserts in empty_cache): _give_up ends it, and takes the allocator's
    refusal, where torch already ended it, as done."""
    ended = []

    def end(index, pool):
        if ended:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        ended.append((index, pool))

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    class Opt:
        def abandon_step(self):
            pass

        def sync_lr(self, on=True):
            pass

    sg = graphs.StepGraph.__new__(graphs.StepGraph)
    sg.t = type("T", (), {"device": torch.device("cuda", 1), "opt": Opt(), "log": None, "step": 3})()
    sg.before, sg.pool = None, (0, 7)
    dead = object()
    sg._give_up(RuntimeError("operation not permitted when stream is capturing"), dead)
    assert ended == [(1, (0, 7))]
    assert sg.abandoned is dead  # kept: its pool's addresses are never handed to eager tensors
    assert sg.failed == "capture failed at step 4 (RuntimeError: operation not permitted when stream is capturing)"
    assert graphs.end_allocating_to_pool(torch.device("cuda", 1), (0, 7)) is False  # already ended: refused


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_a_failed_capture_leaves_the_allocator_usable(tmp_path, monkeypatch):
    """A real capture that fails (a host read inside the captured step): the job trains eagerly,
    and the caching allocator is out of capture mode after it (empty_cache asserted before)."""
    real = Trainer.step_body

    def syncing(self, *a, **k):
        loss = real(self, *a, **k)
        if torch.cuda.is_current_stream_capturing():
            loss.item()  # not permitted while capturing
        return loss

    monkeypatch.setattr(Trainer, "step_body", syncing)
    out = tmp_path / "job"
    args = train._parser().parse_args(
        ["--device", "cuda", "--nproc", "1", "--model", "gpt2-124m", "--layers", "2", "--seq-len", "128",
         "--batch", "2", "--steps", "8", "--warmup", "2", "--log-every", "4", "--eval-every", "0",
         "--sample-tokens", "0", "--ckpt-every", "0", "--out", str(out), "--cuda-graphs"])
    train.validate(args)
    t = Trainer(args, None)
    assert t.run() == 0
    assert t.graphs.failed and t.graphs.failed.startswith("capture failed"), t.graphs.failed
    torch.cuda.empty_cache()  # asserted (captures_underway.empty()) while the dead capture was open
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # an allocation after it works
    assert x.numel() == 256 << 20
