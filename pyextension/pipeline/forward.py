"""The pipeline runtime's forward actions: F (a stage's forward of one micro-batch, recording what
the zero-bubble split and the deallocation of sent outputs need), the batch's document ids, and
the step's mean loss (zerofuse/pipeline/runtime.py runs them)."""
from __future__ import annotations

import contextlib

import torch

NAME = "zerofuse.pipeline.Pipeline"


class Forwards:
    """Pipeline's forward actions (state: the Pipeline's stages, _inputs, _outputs, _recv, _losses,
    _ys, _zb, _saved_outputs, m, p)."""

    def _documents(self, idx, document_ids, m):
        """document_ids (the batch's shape) checked and chunked into m micro-batches, or None."""
        if document_ids is None:
            return None
        if (not isinstance(document_ids, torch.Tensor) or document_ids.shape != idx.shape
                or document_ids.is_floating_point() or document_ids.device != idx.device):
            got = (f"{document_ids.dtype} {list(document_ids.shape)} on {document_ids.device}"
                   if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__)
            raise ValueError(f"{NAME}: expected document_ids as an integer tensor of the batch's shape "
                             f"{list(idx.shape)} on {idx.device}, got {got}")
        refusing = sorted(s for s, stage in self.stages.items() if not stage.takes_documents)
        if refusing:
            raise ValueError(f"{NAME}: document_ids given, but stages {refusing} take none (split_gpt's stages do)")
        return document_ids.chunk(m)

    def _forward(self, a, mbs, tgts, docs=None):
        stage = self.stages[a.stage]
        if stage.is_first:
            inputs = (mbs[a.mb],)
        else:
            inputs = self._recv.pop(("F", a.stage, a.mb))
            if a.stage - 1 not in self.stages:  # received: flagged as the header says (passed locally: already)
                inputs = tuple(t.requires_grad_(grad) for t, (_, _, grad) in zip(inputs, self._spec(a.stage - 1)))
        self._inputs[(a.stage, a.mb)] = inputs
        # what the stage's graph depends on besides its code: the micro-batch shape, mode, training
        # flag, and which params require grad (unfrozen, a param's use saved an output; [Note:
        # zero-bubble coverage]). One key for the saved outputs below and zb's analysis.
        key = (a.stage, self._mb_shape, self._mode, stage.training, tuple(p.requires_grad for p in stage.parameters()))
        record = self._split and torch.is_grad_enabled()
        if record:
            self._zb.begin(key)
        saved: set[int] = set()

        def pack(t):
            saved.add(t.untyped_storage().data_ptr())
            return t

        # Only an output that is sent away is deallocated, so only then does it matter which outputs
        # autograd saved. That is the stage's graph, the same for every micro-batch of a shape: it is
        # seen once through saved_tensors_hooks (a Python call per saved tensor: measured 4% of the
        # interleaved pp 2 step when paid on every forward) and remembered.
        sent = not stage.is_last and a.stage + 1 not in self.stages and torch.is_grad_enabled()
        watch = sent and key not in self._saved_outputs
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if watch else contextlib.nullcontext():
                out = stage(*inputs, targets=tgts[a.mb] if stage.is_last else None,
                            document_ids=None if docs is None else docs[a.mb])
        except BaseException as e:
            if record:
                self._zb.recording = None
            if isinstance(e, RuntimeError) and not stage.is_first and "leaf Variable that requires grad" in str(e):
                raise RuntimeError(f"{NAME}: stage {a.stage} wrote a leaf in place, one of its inputs or a param "
                                   f"({e}): what a stage receives is a leaf whose grad goes back to the previous "
                                   "stage; expected no in-place op on a stage's inputs (e.g. no ReLU(inplace=True) "
                                   "first in a stage) or params") from e
            raise
        if isinstance(out, torch.Tensor) and not stage.is_last:
            out = (out,)  # one tensor crosses the boundary (iterated, it was split into its rows)
        if record:
            self._ys[(a.stage, a.mb)] = (key, self._zb.end(key, a.stage, out))
        if stage.is_last:
            if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
                got = (f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) and out.dim()
                       else f"a {out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__)
                raise ValueError(f"{NAME}: the last stage ({a.stage}) returned {got}; expected the micro-batch's loss "
                                 "as a floating scalar tensor (a reduced loss: loss_fn(output, targets) -> mean or "
                                 "sum; a non-scalar loss trained on its sum while its mean was reported)")
            self._losses[a.mb] = out.detach()
            loss = out / self.m
            opt = self._optimizer_of(a.stage)
            if opt is not None and opt.fp16:  # the backward seeded with the dynamic loss scale, which the step
                loss = opt.scale_loss(loss)  # divides out (unscaled, the grads reached it 1/scale too small)
            self._outputs[(a.stage, a.mb)] = ((loss,), None)
        else:
            bad = [f"output {i} is {type(t).__name__}" for i, t in enumerate(out) if not isinstance(t, torch.Tensor)]
            if bad:
                raise ValueError(f"zerofuse.pipeline: stage {a.stage}'s {', '.join(bad)}; expected the outputs of a "
                                 "stage that is not the last to be tensors (a tensor or a flat tuple of them: what "
                                 "crosses a stage boundary)")
            if watch:
                self._saved_outputs[key] = tuple(t.untyped_storage().data_ptr() in saved for t in out)
            self._outputs[(a.stage, a.mb)] = (tuple(out), self._saved_outputs[key] if sent else (False,) * len(out))
            if a.stage + 1 in self.stages:  # the next stage on this rank (p == 1): passed locally
                self._recv[("F", a.stage + 1, a.mb)] = tuple(t.detach().requires_grad_(t.requires_grad) for t in out)

    def _mean_loss(self) -> torch.Tensor:
        last = self.num_stages - 1
        loss = torch.zeros((), dtype=torch.float32, device=self._device)
        if last in self.stages:
            loss = torch.stack([self._losses[i].float() for i in range(self.m)]).mean()
        if self.p > 1:  # the last stage's, summed with the others' zeros: through the Communicator, whose wait is
            # bounded and names the collective (a last stage that raised in forward_only left the peers in a
            # broadcast for the process group's timeout: a review's reproduction, 2026-12-07)
            self.comm.all_reduce_coalesced([loss], op="sum").wait()
        return loss
