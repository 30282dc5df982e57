"""One module's own forward, set per instance by zerofuse.patch: ``module.forward = Bound(module, make, *key)``.

A ``functools.partial`` of ``make(*key)`` (or of ``make`` itself without a key) over the module, so
``inspect.signature(module.forward)`` shows the function's parameters past the module (transformers
reads ``model.forward``'s: generate's attention_mask / position_ids, the Trainer's columns), and
picklable: it pickles as (module, make, *key) and is made again on load, as ``make(*key)`` may be
a function made at run time (a rebound class forward). ``torch.save(model)`` / ``copy.deepcopy``
of a patched model keep zerofuse's forwards, as a bound method's pickle (``getattr(module,
"forward")``, read before the module's state is set) would not: it came back as the class's stock
forward, or failed to load.
"""
from __future__ import annotations

import functools


class Bound(functools.partial):
    """``make(*key)(module, *args, **kwargs)``; see the module doc."""

    def __new__(cls, module, make, *key):
        self = super().__new__(cls, make(*key) if key else make, module)
        self._recipe = (make, *key)
        return self

    def __reduce__(self):
        return (type(self), (self.args[0], *self._recipe))


def forward_slot(mod) -> str:
    """Where the module's own forward is: accelerate's hooks (a model loaded with device_map, or
    offloaded) replace the instance's forward by a wrapper that moves the inputs, then calls
    ``_old_forward``: a patch goes there, under the hook (every such module was taken as patched
    already and left stock, silently; the attention and the LM forward replaced the hook)."""
    return "_old_forward" if "_hf_hook" in vars(mod) and "_old_forward" in vars(mod) else "forward"


def generate_synced(model, *args, **kwargs):
    """transformers' ``generate`` with ``synced_gpus=True`` unless the caller says otherwise, for a
    model ZeRO-3 shards over several ranks (``model.generate = Bound(model, generate_synced)``,
    zerofuse.zero.parallelize): every decoding step's forward gathers params with the other ranks,
    so a rank whose sequences all ended (eos) keeps stepping until every rank's have. transformers
    turns it on by itself for DeepSpeed ZeRO-3 and FSDP only: ranks stopping at other lengths waited
    in ZeRO-3's all-gather until the timeout (a review's reproduction, 2026-12-07)."""
    kwargs.setdefault("synced_gpus", True)
    return type(model).generate(model, *args, **kwargs)

