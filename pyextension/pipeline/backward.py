"""The pipeline runtime's backward actions: B (a whole backward), and the zero-bubble split's I
(input grads) and W (weight grads) ([Note: zero-bubble split] in zerofuse/pipeline/runtime.py)."""
from __future__ import annotations

import torch


def _run_backward(tensors, grads, inputs=(), *, keep_graph=False, accumulate=True):
    """Backward through the engine without torch.autograd's shape check of the outputs (they may
    have been deallocated after sending; their graph recorded the real shapes). accumulate=False
    returns the grads of ``inputs`` (as torch.autograd.grad) instead of accumulating into .grad."""
    return torch.autograd.Variable._execution_engine.run_backward(
        tuple(tensors), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)


class Backwards:
    """Pipeline's backward actions (state: the Pipeline's _outputs, _inputs, _recv, _grads_in, _ys)."""

    def _optimizer_of(self, stage: int):
        """The zero.Optimizer stepping ``stage``'s params (None: none built, or a plain model)."""
        eng = self._engine if self._engine is not None else getattr(self.stages[stage], "_zerofuse_zero", None)
        return eng.live_optimizer() if eng is not None else None

    def _output_grads(self, a):
        outs, _ = self._outputs.pop((a.stage, a.mb))
        if self.stages[a.stage].is_last:
            return outs, (torch.ones_like(outs[0]),)
        grads = self._recv.pop(("B", a.stage, a.mb))  # one per output that requires grad
        return tuple(o for o in outs if o.requires_grad), tuple(grads)

    def _finish_input_grads(self, a, grads):
        inputs = self._inputs.pop((a.stage, a.mb))
        if self.stages[a.stage].is_first:
            return
        g = tuple(x if x is not None else torch.zeros_like(t) for x, t in zip(grads, inputs) if t.requires_grad)
        if a.stage - 1 in self.stages:
            self._recv[("B", a.stage - 1, a.mb)] = g
        else:
            self._grads_in[(a.stage, a.mb)] = g

    def _backward_B(self, a):
        outs, grads = self._output_grads(a)
        inputs = self._inputs[(a.stage, a.mb)]
        _run_backward(outs, grads)
        self._finish_input_grads(a, [t.grad if t.requires_grad else None for t in inputs])

    def _backward_I(self, a):
        outs, grads = self._output_grads(a)
        inputs = self._inputs[(a.stage, a.mb)]
        float_in = [t for t in inputs if t.is_floating_point() and t.requires_grad]
        zb_key, rec = self._ys[(a.stage, a.mb)]
        ys = [y for _, mod_outs in rec for y in mod_outs]
        once = self._zb.in_I(zb_key, a.stage)  # [Note: zero-bubble coverage]
        wanted = float_in + ys + once
        # (nothing to differentiate - a frozen first stage - is no backward: the engine asserts on it)
        got = (_run_backward(outs, grads, wanted, keep_graph=True, accumulate=False) if outs and wanted
               else [None] * len(wanted))
        dx, dys, donce = got[:len(float_in)], got[len(float_in):len(float_in) + len(ys)], got[len(float_in) + len(ys):]
        it = iter(dys)
        self._ys[(a.stage, a.mb)] = [(params, [(y, g) for y, g in zip(mod_outs, it) if g is not None])
                                     for params, mod_outs in rec]
        self._accumulate(a.stage, once, donce)  # a fused loss head's weight grads: made in its forward
        it = iter(dx)
        self._finish_input_grads(a, [next(it) if t.is_floating_point() and t.requires_grad else None for t in inputs])

    def _accumulate(self, stage: int, params, grads) -> None:
        """Grads computed outside a backward into .grad, handed to a ZeRO stage as one backward's."""
        done = []
        for p, g in zip(params, grads):
            if g is not None:
                # (autograd.grad hands back a fused loss's saved grads with their history, where
                # backward's AccumulateGrad detaches: copied into ZeRO's buffer, the history made
                # stage 1's in-place copy raise "a leaf Variable that requires grad")
                g = g.detach()
                p.grad = g if p.grad is None else p.grad + g
                if p is not self._tied_mirror:  # the mirror is no param of any optimizer or ZeRO stage
                    done.append(p)
        eng = self._engine or getattr(self.stages[stage], "_zerofuse_zero", None)
        if eng is not None and done:
            eng.grads_ready(done)

    def _backward_W(self, a):
        """Each module's weight grads from its outputs' grads saved by I, asking autograd for its
        own params only (so it computes no input grad again)."""
        params, grads = [], []
        for mod_params, pairs in self._ys.pop((a.stage, a.mb)):
            if pairs:
                params += mod_params
                grads += _run_backward([y for y, _ in pairs], [g for _, g in pairs], mod_params, accumulate=False)
        self._accumulate(a.stage, params, grads)
