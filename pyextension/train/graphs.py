"""--cuda-graphs: the whole training step (forwards, backwards, clipping, the optimizer step and
zero_grad: Trainer.step_body) captured once in a CUDA graph and replayed at every step after, so the
host launches one graph where the eager step launches ~300 kernels (bench/profile_step.py counts
them: gpt2-124m's structure, 2026-11-26; ~700 and ~200 Python hooks when this was written) and the
GPU no longer waits for the host between kernels.

[Note: graphed step] What the capture relies on, and who provides it:
- Static shapes: every batch has the Sampler's shape. A replay reads its batch from one device
  buffer into which the host copies the next batch (pinned memory, no wait) before the replay.
- No host read inside the step (tests/test_train_sync.py) and no host decision on a device value.
- Everything the step reads that existed before the capture stays at its address: params (ZeRO's
  flat buffers), optimizer states and step counters, the optimizer's launch tables and constants
  (kept between steps: StepPlans / Prepared), the batch buffer.
- What the host changes per step reaches the step through device tensors written before each
  replay: the batch, and the lr (Optimizer.sync_lr: the kernels copy it into their constants on
  the device at each step). The LR schedule itself runs on the host as before.
- What the step makes (activations, grads, the loss, the grad norm, the skipped flag) lives in the
  graph's private memory pool at fixed addresses; each replay overwrites the loss / norm / flag
  tensors the capture returned, and StepMetrics copies them (torch.stack) right after the replay.
- The Python state a step changes (ZeRO's bucket flags, the optimizer's) is the same after a step
  as before it (the step ends with zero_grad), so the state the capture leaves is the one every
  replay assumes; nothing in Python runs during a replay.
- A world of one: its collectives run in place on the current stream (zerofuse/comm/local.py), so
  no NCCL call, communication stream or event is captured.
Before the capture, WARMUP eager steps run on a side stream (torch's advice for whole-network
capture): Triton compiles and autotunes, the optimizer builds its states and tables, ZeRO its
buffers. Nothing executes while capturing, so the captured step is replayed at once as that step.
A capture that fails is logged in one line and the job goes on eagerly, the caching allocator's
capture into the graph's pool ended first (end_allocating_to_pool: torch 2.11 leaves it open).
"""
from __future__ import annotations

import contextlib

import torch

WARMUP = 3


def reason_not(trainer) -> str | None:
    """Why this job's step cannot be captured (None: it can)."""
    a = trainer.args
    for cond, why in (
        (trainer.device.type != "cuda", f"the device is {trainer.device.type}, not CUDA"),
        (trainer.world > 1, f"{trainer.world} ranks: only a world of one is captured (its collectives run in "
                            "place; NCCL's are not captured)"),
        (a.zero_stage == 3, "ZeRO-3 frees and regathers its parameter buffers around each unit"),
        (a.offload != "none", "offload steps the optimizer on the host"),
        (bool(trainer.cfg.moe_experts), "MoE layers read their per-expert token counts on the host"),
        (a.activation_checkpointing != "none" or a.activation_offload,
         "activation checkpointing and offload are not captured (they stash RNG states and host copies)"),
        (a.precision == "fp16", "fp16 loss scaling is not captured"),
    ):
        if cond:
            return why
    return None


class StepGraph:
    """Runs Trainer.step_body: eagerly on a side stream for the first WARMUP steps, then as one
    captured graph. ``step(batch)`` returns the (mean loss, grad norm, skipped flag) tensors."""

    def __init__(self, trainer, graph_factory=None):
        self.t = trainer
        self.side = torch.cuda.Stream(trainer.device) if trainer.device.type == "cuda" else None
        self.new_graph = graph_factory or torch.cuda.CUDAGraph
        self.graph = None
        self.batch: torch.Tensor | None = None  # the device buffer the replays read
        self.outputs = None
        self.warm = 0
        self.captured_at: int | None = None  # the step (0-based) captured
        self.failed: str | None = None
        self.capture_stream = self.before = None  # the capture's stream; the current one before it
        self.pool = None  # the capture's memory pool (CUDA)
        self.abandoned = None  # a graph whose capture failed (_give_up)

    def _outputs(self, loss):
        opt = self.t.opt
        return loss, opt.last_grad_norm, opt.last_step_skipped

    def step(self, batch: torch.Tensor):
        t = self.t
        if self.graph is None and (self.warm < WARMUP or self.failed):
            self.warm += 1
            with self._on_side():
                both = batch.to(t.device, non_blocking=True) if t.device.type == "cuda" else batch
                return self._outputs(t.step_body(both[0], both[1], t._measure_memory))
        if self.graph is None:
            self._capture(batch)
            if self.graph is None:  # failed: this step eagerly
                return self.step(batch)
        self.batch.copy_(batch, non_blocking=True)
        t.opt.sync_lr()
        self.graph.replay()
        return self.outputs

    def _on_side(self):
        """A context running its block on the side stream, ordered after and before the current."""
        return _SideStream(self.side) if self.side is not None else contextlib.nullcontext()

    def _capture(self, batch: torch.Tensor) -> None:
        t = self.t
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        self.batch = batch.to(t.device, copy=True)
        t.opt.sync_lr()
        graph = self.new_graph()
        stream = self.before = None
        if t.device.type == "cuda":  # the capture's stream, with its arrival counter made (zeroed) now:
            from zerofuse.kernels import colsum  # made while capturing, it would be zeroed only by a replay

            # (torch hands its pooled stream handles out round-robin: a Stream made 32 streams later
            # shares this one's handle, and so its counter; harmless unless its eager kernels run
            # while the graph replays on another stream. Nothing here makes streams after this.)
            stream = self.capture_stream = torch.cuda.Stream(t.device)
            colsum.arrival_counter(t.device, stream)
            self.before = torch.cuda.current_stream(t.device)
            self.pool = torch.cuda.graph_pool_handle()  # named: a failed capture's is ended by _give_up
            torch.cuda.synchronize(t.device)
        body_error = None
        try:
            with _capturing(graph, stream, self.pool):
                try:
                    self.outputs = self._outputs(t.step_body(self.batch[0], self.batch[1]))
                except Exception as e:  # noqa: BLE001
                    body_error = e
                    raise
        except Exception as e:  # noqa: BLE001 - whatever the capture refused, the job goes on eagerly
            self._give_up(e, graph, first=body_error)
            return
        self.graph, self.captured_at = graph, t.step

    def _give_up(self, e: Exception, graph=None, first: Exception | None = None) -> None:
        t = self.t
        # Kept, never destroyed: its pool's memory is then never handed out again. Tables the
        # capture left behind (csrc/cuda/flatten.cu: device tables keyed by the grads' addresses,
        # written by kernels the capture recorded but never ran) name addresses in that pool; a
        # torch that releases a failed capture's pool (pytorch#190348) could give them to eager
        # grads of the same sizes, which would then find the unwritten table.
        self.abandoned = graph
        if self.before is not None:  # torch.cuda.graph's exit raised before restoring the stream
            torch.cuda.set_stream(self.before)
        if self.pool is not None:
            end_allocating_to_pool(t.device, self.pool)
        # an error inside the capture (first), then the capture's end failing over it: both, the
        # first first (not e.__context__: any error handled inside the body is one)
        errors = [first, e] if first is not None and first is not e else [e]
        said = "; then ".join(f"{type(x).__name__}: {_first_line(x)}" for x in errors)
        self.failed = f"capture failed at step {t.step + 1} ({said})"
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        t.opt.abandon_step()  # nothing ran while capturing: forget the half-built step's Python state
        t.opt.sync_lr(False)  # eager steps take the lr from the param groups again
        self.batch = self.outputs = None
        if t.log:
            t.log.write(f"cuda graphs: {self.failed}; training eagerly")

    def describe(self) -> str:
        if self.failed:
            return f"off: {self.failed}"
        if self.captured_at is None:
            return f"on (not captured yet: {WARMUP} eager warm-up steps first)"
        return f"on (captured at step {self.captured_at + 1} after {WARMUP} eager steps)"


class _SideStream:
    def __init__(self, side):
        self.side = side

    def __enter__(self):
        self.cur = torch.cuda.current_stream(self.side.device)
        self.side.wait_stream(self.cur)
        self.ctx = torch.cuda.stream(self.side)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        self.cur.wait_stream(self.side)
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _capturing(graph, stream=None, pool=None):
    """torch.cuda.graph(graph, pool=pool, stream=stream) for a CUDA graph; a stand-in graph (tests
    on CPU) brings its own."""
    if isinstance(graph, torch.cuda.CUDAGraph):
        return torch.cuda.graph(graph, pool=pool, stream=stream)
    return graph.capture()


def end_allocating_to_pool(device: torch.device, pool) -> bool:
    """After a failed capture: tell the caching allocator the capture into ``pool`` is over, where
    torch did not. torch 2.11's CUDAGraph.capture_end raises, over a capture an error invalidated,
    before it does so (fixed upstream later: pytorch#180395): left so, the allocator keeps serving
    this thread's allocations from the dead capture's pool, stops recycling blocks freed across
    streams and asserts in empty_cache (``captures_underway.empty()``) for the rest of the job.
    Where torch did end it, the allocator refuses ('not currently recording to mempool_id'):
    nothing to do. Returns whether it was ended here. (The pool's memory stays reserved until the
    process ends: StepGraph keeps the failed graph, see _give_up.)"""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except (RuntimeError, AttributeError):
        return False
    return True
