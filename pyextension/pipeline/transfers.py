"""The transfers between pipeline stages: the send/receive half of zerofuse.pipeline.Pipeline.

[Note: pipeline transfers] The shapes, dtypes and requires_grad flags of what crosses a stage
boundary are agreed once per micro-batch shape and mode (grad mode, autocast on and its dtype: an
output is bf16 under autocast and fp32 without, the receiver allocated the old dtype and read
uninitialised memory before): the first forward of a boundary also sends a small int64 header
(count, dtypes, flags, shapes); later transfers are the tensors alone, checked on the sending side
against what was agreed. Grads go back for the outputs that require grad only, on both sides (a
frozen first stage, or a float mask passed along, hung the step before). Consecutive SEND/RECV actions are posted
as one ``batch_p2p`` of sends and one of receives; only receives are waited for before the compute
that needs them, sends are waited for at the end of the step (gloo matches them by tag, the
schedule's per-pair order serves NCCL). On CPU (gloo: a transfer moves once its receive is posted,
and transfers pair by tag, not by order) the receives due after a compute action are posted before
it runs, so their data arrives during that compute (measured at pp 2 on 2 cores: posted only when
due, a receive of data sent long before still waited 1.5-3 ms); the posts themselves run on the
transport's poster thread ([Note: gloo p2p poster], process_group_transport.cpp). A stage's output
is sent as a detached alias and then deallocated at once (Megatron's deallocate_output_tensor): its
autograd graph is kept and its backward runs through the engine directly (no shape check against
the freed tensor). Outputs that autograd saved for backward are kept whole (seen through
saved_tensors_hooks in a stage's first forward of a micro-batch shape), and so is what the stage
did not make (an input passed on, a param or buffer returned).

[Note: tied embeddings across stages] When the first stage (the token embedding) and the last (the
output layer tied to it) are on different ranks, the last holds a mirror of the weight
(zerofuse.pipeline.stage). Each step the first stage sends its weight with its first forward's
activations (SEND_F of micro-batch 0: after that forward, so a ZeRO-1/2 all-gather of the updated
weight has been waited for; where that rank also sends the last stage its input - pp 2,
interleaved - with that SEND_F of micro-batch 0 instead, the order its receiver takes them in),
received into the mirror with RECV_F of micro-batch 0 of the last stage, before the mirror is read. At the end of its step the last stage's rank sends the mirror's
grad (summed over its micro-batches, before any data-parallel reduction); the first stage adds it
into its weight's .grad just before its last backward of the step, so ZeRO (which reduces during
that backward) and the grad norm see the weight's whole grad once. Both transfers come after every
other transfer of their pair on the sending side and are received after every other one on the
receiving side, so NCCL's per-pair order agrees too. Cost: the weight's bytes twice per step
between the two ranks, as Megatron's embedding all-reduce.
"""
from __future__ import annotations

import torch

from zerofuse.comm import P2POp
from zerofuse.pipeline.header import HEADER_SLOTS, header, parse_header, spec_of
from zerofuse.pipeline.schedules import stage_to_rank


class Transfers:
    """Pipeline's SEND/RECV actions. Uses the Pipeline's comm, p, m, _specs, _mb_shape, _device and
    the step's _outputs, _grads_in, _recv (what arrived, by key), _sends (Works waited at the step's
    end) and _posted (receives posted ahead, by key)."""

    def _tag(self, kind: str, stage: int, mb: int, is_header: bool = False) -> int:
        """gloo's tag of a transfer: unique per (direction, stage, micro-batch, header or data) in a step;
        forward_only's after step's and the tied embedding's (_tag_base: a rank evaluating while its
        peer stepped matched a step's tag of another size, and gloo aborted the process)."""
        return ((stage * 2 + (kind == "B")) * 2 + is_header) * self.m + mb + self._tag_base

    def _spec(self, stage: int):
        return self._specs.get((stage, self._mb_shape, self._mode))

    def _recv_ops(self, a, peer: int):
        """(key of what arrives, its buffers, their receive ops) for a RECV action, or None while the
        boundary's shapes are not agreed yet (its header comes first)."""
        if a.kind == "RECV_F":
            spec = self._spec(a.stage - 1)
            if spec is None:
                return None
            bufs = tuple(torch.empty(s, dtype=d, device=self._device) for s, d, _ in spec)
            tag = self._tag("F", a.stage - 1, a.mb)
        else:
            spec, entry = self._spec(a.stage), self._outputs.get((a.stage, a.mb))
            if spec is None or entry is None:
                return None
            bufs = tuple(torch.empty(s, dtype=d, device=self._device) for s, d, grad in spec if grad)
            tag = self._tag("B", a.stage + 1, a.mb)
        ops = [P2POp("recv", b, peer, tag) for b in bufs]
        if a.kind == "RECV_F" and self._tied_mirror is not None and a.stage == self.num_stages - 1 and a.mb == 0:
            ops.append(self._tied_weight_op())  # [Note: tied embeddings across stages]
        return (a.kind[-1], a.stage, a.mb), bufs, ops

    def _tied_tag(self, what: str) -> int:
        """Tags after every schedule transfer's ([Note: tied embeddings across stages])."""
        return 4 * self.num_stages * self.m + ("weight", "grad", "spec").index(what)

    def _tied_sent_with(self) -> int:
        """The stage whose first SEND_F carries the tied weight: the first stage's, unless this
        rank also sends the last stage its input (pp 2, interleaved: stage S-2 is on the first
        stage's rank), whose receive takes the weight right after that input."""
        S = self.num_stages
        return S - 2 if S >= 2 and stage_to_rank(S - 2, self.p) == stage_to_rank(0, self.p) else 0

    def _tied_weight_op(self) -> P2POp:
        """The mirror's receive of the first stage's weight (last stage's rank)."""
        return P2POp("recv", self._tied_mirror.detach(), stage_to_rank(0, self.p), self._tied_tag("weight"))

    def _agree_tied(self) -> None:
        """At construction, the first and last stages' ranks swap their halves' (dtype, shape,
        requires_grad): a dtype or shape apart is refused on both ranks (gloo aborted the process on
        the grad's byte count, after a weight received short had been used), and the mirror takes
        the weight's requires_grad (a frozen embedding got the mirror's grad and trained; a review's
        reproduction, 2026-12-07). Freezing or casting either afterwards: build the Pipeline again."""
        mine = self._tied_source if self._tied_source is not None else self._tied_mirror
        source = self._tied_source is not None
        peer = stage_to_rank(self.num_stages - 1 if source else 0, self.p)
        theirs = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=mine.device)
        self.comm.batch_p2p([P2POp("send", header([mine], 0).to(mine.device), peer, self._tied_tag("spec")),
                             P2POp("recv", theirs, peer, self._tied_tag("spec"))]).wait()
        (other,) = parse_header(theirs)
        weight, mirror = (spec_of([mine])[0], other) if source else (other, spec_of([mine])[0])
        if weight[:2] != mirror[:2]:
            raise ValueError(f"zerofuse.pipeline.Pipeline: the tied embedding's weight on the first stage is {weight[1]} of shape "
                             f"{list(weight[0])}, its mirror on the last stage {mirror[1]} of shape {list(mirror[0])}; "
                             "expected the same dtype and shape (cast or move both stages alike, e.g. by "
                             "zerofuse.zero.parallelize's precision on every rank, before building the Pipeline)")
        if not source:
            self._tied_mirror.requires_grad_(weight[2])

    def _send_tied_grad(self) -> None:
        g = self._tied_mirror.grad
        g = torch.zeros_like(self._tied_mirror) if g is None else g.contiguous()
        self._sends.append(self.comm.batch_p2p([P2POp("send", g, stage_to_rank(0, self.p), self._tied_tag("grad"))]))

    def _add_tied_grad(self) -> None:
        """The mirror's grad into the first stage's weight, before its last backward of the step."""
        w = self._tied_source
        g = torch.empty_like(w, memory_format=torch.contiguous_format)
        last = stage_to_rank(self.num_stages - 1, self.p)
        self.comm.batch_p2p([P2POp("recv", g, last, self._tied_tag("grad"))]).wait()
        if w.requires_grad:  # (frozen since the Pipeline was built: received to keep the pair's order, dropped)
            w.grad = g if w.grad is None else w.grad.add_(g)

    def _held(self, stage: int, mb: int, t: torch.Tensor) -> bool:
        """An output the stage did not make: an input passed on (a skip connection; an empty middle
        stage of split_gpt), or a param or buffer of the stage. Freeing it broke the stage's
        backward, or emptied the param."""
        if t.grad_fn is not None:  # made by the stage's forward
            return False
        mod = self.stages[stage]
        return any(t is x for x in (*self._inputs.get((stage, mb), ()), *mod.parameters(), *mod.buffers()))

    def _peer(self, a) -> int:
        return a.peer if a.peer >= 0 else stage_to_rank(a.stage + (1 if a.kind.endswith("F") else -1), self.p)

    def _post_early(self, actions) -> None:
        ops, got = [], []
        for a in actions:
            r = self._recv_ops(a, self._peer(a))
            if r is not None:
                ops += r[2]
                got.append(r)
        if ops:
            work = self.comm.batch_p2p(ops)
            for key, bufs, _ in got:
                self._posted[key] = (work, bufs)

    def _communicate(self, actions) -> None:
        sends, recvs, after, posted = [], [], [], []
        for a in actions:
            peer = self._peer(a)
            if a.kind == "SEND_F":
                outs, saved = self._outputs[(a.stage, a.mb)]
                agreed = self._spec(a.stage)
                if agreed is None:
                    head = header(outs, a.stage).to(self._device)
                    self._specs[(a.stage, self._mb_shape, self._mode)] = spec_of(outs)
                    sends.append(P2POp("send", head, peer, self._tag("F", a.stage, a.mb, True)))
                elif agreed != spec_of(outs):
                    raise ValueError(f"zerofuse.pipeline: stage {a.stage}'s outputs (shape, dtype, requires_grad) "
                                     f"{spec_of(outs)} differ from {agreed}, agreed with the next stage at the first "
                                     "micro-batch of this shape and mode; expected the same outputs at every "
                                     "micro-batch and step (a param frozen or unfrozen since changes which outputs "
                                     "require grad: build the Pipeline again on every rank after such a change)")
                for t in outs:
                    sends.append(P2POp("send", t.detach().contiguous(), peer, self._tag("F", a.stage, a.mb)))
                if self._tied_source is not None and a.stage == self._tied_sent_with() and a.mb == 0:
                    last = stage_to_rank(self.num_stages - 1, self.p)
                    sends.append(P2POp("send", self._tied_source.detach(), last, self._tied_tag("weight")))
                for t, keep in zip(outs, saved):  # [Note: pipeline transfers] free what autograd does not need
                    if keep or self._held(a.stage, a.mb, t):
                        continue
                    # a view spanning the whole of a tensor the forward made (an MoE layer's
                    # reshaped output: kept whole on every MoE stage before 2026-12-07) frees its base
                    base = t._base  # (made by the forward under autograd; a leaf requiring grad is a param or
                    if base is not None and (t.grad_fn is None or base.numel() != t.numel()  # an input: kept)
                                             or (base.grad_fn is None and base.requires_grad)
                                             or self._held(a.stage, a.mb, base)):
                        continue
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                    if base is not None:
                        base.data = torch.empty(0, dtype=base.dtype, device=base.device)
            elif a.kind == "SEND_B":
                for g in self._grads_in.pop((a.stage, a.mb)):
                    sends.append(P2POp("send", g.contiguous(), peer, self._tag("B", a.stage, a.mb)))
            elif (a.kind[-1], a.stage, a.mb) in self._posted:
                work, bufs = self._posted.pop((a.kind[-1], a.stage, a.mb))
                posted.append(work)
                after.append(((a.kind[-1], a.stage, a.mb), bufs))
            else:
                r = self._recv_ops(a, peer)
                if r is None:  # the first transfer of this boundary: its header first
                    head = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self._device)
                    self.comm.batch_p2p([P2POp("recv", head, peer, self._tag("F", a.stage - 1, a.mb, True))]).wait()
                    self._specs[(a.stage - 1, self._mb_shape, self._mode)] = parse_header(head)
                    r = self._recv_ops(a, peer)
                key, bufs, ops = r
                recvs += ops
                after.append((key, bufs))
        if sends:
            self._sends.append(self.comm.batch_p2p(sends))
        if recvs:
            self.comm.batch_p2p(recvs).wait()
        for work in posted:
            work.wait()
        for key, bufs in after:
            self._recv[key] = bufs
