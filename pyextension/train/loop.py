"""One rank of the training job: (build.py builds it,) train, evaluate, checkpoint, sample."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import resource
import signal
import time
from pathlib import Path

import torch

from zerofuse.models.gpt import Block

from . import build
from .build import lr_lambda  # noqa: F401  (zerofuse.train.lr_lambda)
from .data import shards_digest, validation_key
from .metrics import check_not_stuck


class Trainer:
    """One rank of the job: build, (resume,) train, evaluate, checkpoint, report."""

    def __init__(self, args, env: dict | None):
        self.args, self.env = args, env

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        build.setup(self)

    # ------------------------------------------------------------------ steps

    def _documents(self, x):
        """--document-masking: x's documents, each starting at <|endoftext|> (a device op: no sync,
        graphable); else None."""
        return (x == self.corpus.document_start).cumsum(-1) if self.args.document_masking else None

    def _forward(self, x, y):
        docs = self._documents(x)
        if self.pp is not None:
            return self.pp.eval_loss(x, y, docs)
        return self.model(x, y)[1] if docs is None else self.model(x, y, document_ids=docs)[1]

    def _batch(self, step: int):
        """This step's (inputs, targets) stacked, (2, grad_accum, batch, seq): on the CPU as they
        are; for CUDA in pinned memory, for one host-to-device copy that does not wait."""
        xs, ys = self.train_data.get(step)
        both = torch.stack([xs, ys])
        return both if self.device.type != "cuda" else both.pin_memory()

    def step_body(self, xs, ys, on_stepped=None):
        """The device work of one optimizer step: forwards and backwards, the optimizer step,
        zero_grad; returns the mean loss (a device scalar). Captured whole by --cuda-graphs
        (train/graphs.py), so it reads nothing from the host but its arguments and the
        optimizer's lr (Optimizer.sync_lr). on_stepped() runs between the step and zero_grad."""
        args, opt = self.args, self.opt
        if self.pp is not None:  # the schedule runs the micro-batches' forwards and backwards
            mean_loss = self.pp.step(xs, ys, self._documents(xs))
        else:
            total = None
            for i in range(args.grad_accum):
                sync = i == args.grad_accum - 1
                with contextlib.nullcontext() if sync else self.model.no_sync():
                    loss = self._forward(xs[i], ys[i])
                    scaled = opt.scale_loss(loss if args.grad_accum == 1 else loss / args.grad_accum)
                    scaled.backward(self._unit_grad(scaled))
                ce = loss.detach()
                if self.moe is not None:  # the routers' aux and z losses: reported apart
                    self.moe.record(self.model.router_losses)
                    ce = ce - self.model.router_losses.sum()
                total = ce if total is None else total + ce
            mean_loss = total if args.grad_accum == 1 else total / args.grad_accum  # (no launch for a / 1)
        if self.moe is not None:
            self.moe.end_step()
            for router in self.moe_routers:  # aux-loss-free balancing: before the step (collective over DP)
                router.update_bias()
        opt.step()
        if on_stepped is not None:
            on_stepped()
        opt.zero_grad()
        return mean_loss

    def _unit_grad(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a backward starts from (1), one persistent device tensor per dtype rather
        than the ones_like (a launch) of loss.backward()."""
        units = self.__dict__.setdefault("_units", {})
        if loss.dtype not in units:
            units[loss.dtype] = torch.ones((), dtype=loss.dtype, device=loss.device)
        return units[loss.dtype]

    def _measure_memory(self) -> None:
        if self.memory is None:  # sizes and allocator counters only: no sync
            self.memory = self._memory()

    def train_step(self) -> None:
        """One optimizer step, queued on the device without waiting for it: the loss, grad norm
        and skipped flag stay device tensors until the next log point (StepMetrics), the stop
        signal is agreed on a CPU group (StopVote). With --cuda-graphs a replay of the captured
        step (train/graphs.py)."""
        from zerofuse import comm
        args, opt = self.args, self.opt
        cpu = self.device.type == "cpu"
        t0, w0 = time.perf_counter(), comm.wait_seconds()
        both = self._batch(self.step)
        lr = opt.param_groups[0]["lr"]
        capture = self.graphs is not None and self.graphs.graph is None
        if self.graphs is not None:
            mean_loss, norm, skipped = self.graphs.step(both)
            capture = capture and self.graphs.graph is not None  # captured in this step: no steady one
        else:
            if not cpu:
                both = both.to(self.device, non_blocking=True)
            mean_loss = self.step_body(both[0], both[1], self._measure_memory)
            norm, skipped = opt.last_grad_norm, opt.last_step_skipped  # (skipped: fp16 overflow or a non-finite norm)
        self.sched.step()
        self.step += 1
        host = {"step": self.step, "lr": lr, "comm_time": comm.wait_seconds() - w0 if cpu else None,
                "step_time": time.perf_counter() - t0 if cpu else None}  # CUDA: timed between log points
        if capture:
            host["graph_capture"] = True
        self.metrics.record(host, mean_loss, norm, skipped, copy=self.graphs is not None)
        stop_after = args.stop_after is not None and self.step >= args.stop_after  # the same on every rank
        self.stopped = self.vote.vote(self.stop.signum) or (signal.SIGTERM if stop_after else 0)

    def moe_figures(self) -> dict:
        """The routers' figures since the last log point (zerofuse.models.moe.Stats) and the host
        time spent waiting for the all-to-alls (CPU: exposed; on CUDA a wait orders streams only)."""
        from zerofuse.moe.dispatch import exposed_seconds, sent_bytes
        steps = self.moe.steps
        sent = sent_bytes()
        # (over every rank under pipeline parallelism, each stage recording its own layers, and under
        # tensor parallelism, each TP rank its own tokens or (Stats.replicas) the same ones)
        every = self.pp is not None or self.mesh.tp > 1
        out = self.moe.read(None if every else self.mesh.dp_group, sent - self._a2a_bytes_last)
        self._a2a_bytes_last = sent
        a2a = exposed_seconds()
        out["a2a_exposed_s_per_step"] = ((a2a - self._a2a_last) / max(steps, 1)
                                         if self.device.type == "cpu" and self.args.ep > 1 else None)
        self._a2a_last = a2a
        return out

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the validation set: --eval-batches batches of dp × --batch windows, the same
        for every layout of the same dp × --batch (data.Validation), each rank evaluating its part."""
        import torch.distributed as dist
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, batches)
        for k in range(len(self.val_data)):
            x, y = self.val_data.get(k)
            loss = self._forward(x.to(self.device), y.to(self.device)).double()
            acc += torch.stack([loss, torch.ones_like(loss)])
        dist.all_reduce(acc, group=self.mesh.dp_group)
        if self.moe is not None:  # evaluation's all-to-alls are not the steps'
            from zerofuse.moe.dispatch import exposed_seconds, sent_bytes
            self._a2a_last, self._a2a_bytes_last = exposed_seconds(), sent_bytes()
        return float(acc[0] / acc[1])

    def _memory(self) -> dict:
        from zerofuse.zero import memory_report
        rep = memory_report(self.model, self.opt)
        mem = {k: rep[k] for k in ("params", "grads", "optimizer", "total", "optimizer_host", "params_host") if k in rep}
        return mem | self._peaks()

    def _peaks(self) -> dict:
        """The process's peaks so far (read again at the end of the job: read at the first step
        only, they left out the later steps, evaluation, checkpoints, a CUDA graph's capture)."""
        peaks = {"max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device.type == "cuda":
            peaks["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return peaks

    def save(self) -> None:
        from zerofuse import checkpoint
        extra = {"step": self.step, "scheduler": self.sched.state_dict(), "tokenizer": self.corpus.identity(),
                 "config": dataclasses.asdict(self.cfg), "seed": self.args.seed,
                 "initial_val_loss": self.initial_val_loss, "precision": self.args.precision,
                 "batch": [self.args.grad_accum, self.args.dp, self.args.batch],
                 "validation": validation_key(self.args, self.val_data), "train_data": shards_digest(self.train_data)}
        checkpoint.save(str(self.ckpt), self.model, self.opt, extra=extra)

    def sample(self) -> str:
        """Every rank generates with the same generator (TP ranks and ZeRO-3 forward together)."""
        args = self.args
        prompt = self.corpus.prompt()
        idx = torch.tensor([prompt], dtype=torch.long, device=self.device)
        g = torch.Generator().manual_seed(args.seed)
        out = self.model.generate(idx, args.sample_tokens, temperature=0.8, top_k=40, generator=g,
                                  vocab_size=self.corpus.vocab_size)  # (not GPT-2's padding ids)
        return self.corpus.decode(out[0, len(prompt):].tolist())

    # ------------------------------------------------------------------ the job

    def run(self) -> int:
        import torch.distributed as dist
        try:
            self._setup()
        except BaseException:  # (a refusal after the process group began: it and the signal handlers
            # outlived the failed run, and the caller's next Trainer failed to initialize it again)
            if getattr(self, "stop", None) is not None:
                self.stop.restore()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        args = self.args
        try:
            self.stop.arm()  # signals stop the loop at a step boundary (before it: at once)
            val, val_step = self.evaluate(), self.step
            if self.start_step == 0:
                self.initial_val_loss = val
            if self.log:
                self.log.start(val)
            t_train, skip_run = time.perf_counter(), 0  # (skip_run: steps skipped in a row, check_not_stuck)
            self.metrics.restart_clock()
            while self.step < args.steps and not self.stopped:
                if self.launches is None and self.step == self.start_step + 1:  # (the first builds the plans)
                    from .launches import count_step
                    # (per layer of this rank's blocks: a pipeline stage's count over the whole model's
                    # layers was 1/pp of the truth; a review, 2026-12-06)
                    here = sum(isinstance(m, Block) for m in self.model.modules())  # (0: an embedding-only stage)
                    self.launches = count_step(self.train_step, self.model, here, self.step + 1)
                    if self.metrics.pending:  # its time is the counters' too: not a steady step's
                        self.metrics.pending[-1]["instrumented"] = True
                    if self.pp is not None and self.pp.idle:  # nor its pipeline bubble
                        self.pp.idle[-1] = None
                else:
                    self.train_step()
                end = self.step == args.steps or self.stopped
                evaluate = self.step == args.steps or (args.eval_every and self.step % args.eval_every == 0)
                save = (args.ckpt_every and self.step % args.ckpt_every == 0) or end
                if not (end or evaluate or save or self.step % self.log_every == 0):
                    continue
                # a delayed host step (--offload-delayed-update) reaches the params at the end only: a
                # mid-run evaluation scores them one update behind (applied there, the next step's grad
                # was taken undelayed: the evaluation cadence changed the losses; a review, 2026-12-06)
                if end:
                    self.opt.apply_pending()
                records = self.metrics.flush()  # the log point: the device is read here only
                if self.moe is not None:  # collective over the DP group (every rank under --pp or --tp), like the flush
                    records[-1]["moe"] = self.moe_figures()
                if evaluate:
                    records[-1]["val_loss"] = val = self.evaluate()
                    val_step = self.step
                if self.log:
                    for m in records:
                        self.log.step(m)
                skip_run = check_not_stuck(self.opt, records, skip_run)  # (after the window's records are written)
                if save:
                    self.save()
                self.metrics.restart_clock()
            train_s = time.perf_counter() - t_train
            if not self.stopped:  # a signal during the last log point: the job stops as told
                self.stopped = self.vote.final(self.stop.signum)
            if not self.stopped:  # (a stopped job skips what follows; it finishes as it was told)
                self.stop.default()  # sampling, export: a signal ends the rank at once
            if args.export and not self.stopped and dist.get_rank() == 0:  # the final checkpoint is saved
                from zerofuse.checkpoint import export_hf
                from zerofuse.models import hf_names
                if hf_names.representable(self.cfg) is None:  # transformers' GPT-2 or Llama (the CLI noted if not)
                    config = hf_names.hf_config(self.cfg, self.corpus.document_start)  # (its tokenizer's eos)
                    export_hf(str(self.ckpt), str(Path(args.out) / "hf"), config=config,
                              rename=functools.partial(hf_names.to_hf, self.cfg))
                else:
                    export_hf(str(self.ckpt), str(Path(args.out) / "hf"),
                              config={"model_type": "zerofuse-gpt", **dataclasses.asdict(self.cfg)})
            if self.memory is None:  # resumed at the end: nothing trained
                self.memory = self._memory()
            # sampling runs the whole model on every rank: not with the model split into stages
            text = self.sample() if args.sample_tokens and not self.stopped and self.pp is None else None
            memory = [None] * self.world
            dist.all_gather_object(memory, self.memory | self._peaks())
            self.pipeline_report = self.pp.report(self.world) if self.pp is not None else None
            if self.log:
                self.log.finish(memory, text, train_s, (val, val_step), self.stopped)
        finally:
            self.stop.restore()
            self.vote.close()
            if self.log:
                self.log.close()
            dist.destroy_process_group()
        return 128 + self.stopped if self.stopped else 0
