"""How a tensor-parallel parameter relates to the full (unsharded) parameter.

A ``TPSpec`` sits on each sharded parameter as ``param._zf_tp``. The full tensor is cut along
``dim`` into ``parts`` (one part for a plain layer; q, k and v for a fused QKV projection), and
every part is split over the ``tp`` ranks as ``torch.tensor_split`` does (the first ``n % tp``
ranks get one more row): rank r holds, concatenated, its piece of every part. The same spec slices
a full tensor (construction from full weights, loading a checkpoint saved at another TP size) and
merges the ranks' shards back (consolidation).
"""
from __future__ import annotations

import dataclasses

import torch


def tp_group_of(model: torch.nn.Module, tp_group, who: str):
    """The TP group a ZeRO model's grad norms must add up over: ``tp_group`` if given, else the
    model's ``tp_group`` attribute (zerofuse's models), else the one group its zerofuse.tp layers were
    built on (a custom model's clip norm was each TP rank's own part before: 12.9 and 14.5 on two
    ranks where the model's is 18.3, and the replicated params drifted apart). Checked against the
    TP size of every sharded param."""
    import torch.distributed as dist  # noqa: PLC0415

    if tp_group is None:
        tp_group = getattr(model, "tp_group", None)
    if tp_group is None:
        groups = {id(m.group): m.group for m in model.modules()
                  if getattr(m, "group", None) is not None and any(spec_of(p) for p in m.parameters(recurse=False))}
        if len(groups) > 1:
            raise ValueError(f"{who}: the model's tensor-parallel layers were built on {len(groups)} different "
                             "groups; pass tp_group= (the one their norms add up over)")
        tp_group = next(iter(groups.values()), None)
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    wrong = sorted({s.tp for s in map(spec_of, model.parameters()) if s is not None} - {size})
    if wrong:
        raise ValueError(f"{who}: the model holds tensor-parallel slices of a TP size {wrong}, expected tp_group to "
                         f"be a group of that size, got {'none' if tp_group is None else f'a group of {size}'}")
    return tp_group


def split_sizes(n: int, tp: int) -> list[int]:
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


_AGREED: set = set()  # (comm, n_local, vocab_size) a group has checked together: later calls need no all-reduce


def vocab_range(n_local: int, vocab_size: int | None, comm, who: str, device,
                unit: str = "logits") -> tuple[int, int, int]:
    """(vocab_size, start, end) of this rank's shard of n_local vocabulary entries. vocab_size=None:
    the TP group's shards summed (one small all-reduce; each rank's own guess, n_local x tp, differed
    between ranks of an uneven split: a wrong loss, or one rank raising while the others hung).
    A given vocab_size is checked against the group's shards at its first use (one all-reduce,
    then none): checked on each rank alone, a wrong one failed on the ranks whose shard it did not
    fit, while the others waited in the loss's all-reduce for the group's timeout."""
    from zerofuse.tp import comm as C  # noqa: PLC0415

    tp, rank = comm.world_size, comm.rank
    key = (id(comm), n_local, vocab_size)
    # (not while tracing or capturing a CUDA graph: the check reads the sizes on the host)
    if vocab_size is None or (key not in _AGREED and not torch.compiler.is_compiling() and not (
            torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing())):
        sizes = torch.zeros(tp, dtype=torch.int64, device=device)
        sizes[rank] = n_local
        C.all_reduce(sizes, comm)
        sizes = sizes.tolist()
        if vocab_size is not None and vocab_size != sum(sizes):
            raise ValueError(f"{who}: expected vocab_size to be the TP group's vocabulary, its shards {sizes} summed "
                             f"({sum(sizes)}), got {vocab_size}")
        vocab_size = sum(sizes)
        if split_sizes(vocab_size, tp) != sizes:
            raise ValueError(f"{who}: the TP group's vocabulary shards {sizes} are not the split of {vocab_size} "
                             f"over {tp} ranks ({split_sizes(vocab_size, tp)}, as ColumnParallelLinear makes it)")
        _AGREED.add(key)
    start, end = split_range(vocab_size, tp, rank)
    if end - start != n_local:
        raise ValueError(f"{who}: rank {rank} of {tp} expected {end - start} {unit} of a vocabulary of {vocab_size}, "
                         f"got {n_local}")
    return vocab_size, start, end


def split_range(n: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's piece of n rows."""
    sizes = split_sizes(n, tp)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


@dataclasses.dataclass(frozen=True)
class TPSpec:
    dim: int
    parts: tuple[int, ...]  # sizes along dim of the full tensor's parts
    full_shape: tuple[int, ...]
    tp: int
    rank: int

    def local_size(self, rank: int | None = None) -> int:
        r = self.rank if rank is None else rank
        return sum(split_sizes(n, self.tp)[r] for n in self.parts)

    def slice(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This rank's (or ``rank``'s) shard of ``full`` (a new contiguous tensor)."""
        r = self.rank if rank is None else rank
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"zerofuse.tp: expected a full tensor of shape {list(self.full_shape)}, got "
                             f"{list(full.shape)}")
        out, off = [], 0
        for n in self.parts:
            a, b = split_range(n, self.tp, r)
            out.append(full.narrow(self.dim, off + a, b - a))
            off += n
        return torch.cat(out, dim=self.dim).contiguous()

    def place(self, full: torch.Tensor, shard: torch.Tensor, rank: int) -> None:
        """Copy rank's shard into its regions of ``full`` (merge, one shard at a time: a loader
        holds the full tensor and one shard, not every shard)."""
        off = local = 0
        for n in self.parts:
            a, b = split_range(n, self.tp, rank)
            full.narrow(self.dim, off + a, b - a).copy_(shard.narrow(self.dim, local, b - a))
            local += b - a
            off += n

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (in rank order)."""
        if len(shards) != self.tp:
            raise ValueError(f"zerofuse.tp: expected {self.tp} shards to merge, got {len(shards)}")
        pieces = []
        local_off = [0] * self.tp
        for n in self.parts:
            sizes = split_sizes(n, self.tp)
            for r, s in enumerate(shards):
                pieces.append(s.narrow(self.dim, local_off[r], sizes[r]))
                local_off[r] += sizes[r]
        return torch.cat(pieces, dim=self.dim)

    def to_json(self) -> dict:
        return {"dim": self.dim, "parts": list(self.parts), "full_shape": list(self.full_shape)}

    @staticmethod
    def from_json(d: dict, tp: int, rank: int) -> "TPSpec":
        return TPSpec(d["dim"], tuple(d["parts"]), tuple(d["full_shape"]), tp, rank)


def spec_of(p: torch.Tensor) -> TPSpec | None:
    return getattr(p, "_zf_tp", None)


# --------------------------------------------------------------------- marks on the Parameter objects
# A TPSpec (and sequence parallelism's hook summing a replicated param's grad over the TP group,
# zerofuse.tp.comm.sync_replicated_grads) lives on the Parameter object. Module.to_empty / .to(device)
# and load_state_dict(assign=True) replace the object, and torch.utils.swap_tensors (ZeRO's
# materialization off meta) swaps its __dict__ and leaves its hooks on the old tensor: the spec and
# the hook were lost (a checkpoint consolidated each rank's slice as the full tensor; the replicated
# grads stayed each rank's partial sums).

def param_marks(p: torch.Tensor) -> tuple:
    """What sits on the Parameter object: its attributes and its gradient hooks."""
    return dict(p.__dict__), p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None)


def put_marks(p: torch.Tensor, marks: tuple) -> None:
    """Put param_marks(old) on p (idempotent: the hook setter replaces, never adds)."""
    attrs, hooks, post = marks
    p.__dict__.update(attrs)
    if hooks:
        p._backward_hooks = hooks  # (the setter installs them on p's TensorImpl)
    if post:
        p._post_accumulate_grad_hooks = post


def swap_keeping_marks(p: torch.nn.Parameter, t: torch.Tensor) -> None:
    """Give the param ``p`` the tensor ``t`` in place (the same Python object, so the model, the
    optimizer and the hooks' owners keep it; .data cannot move a tensor on or off meta), with its
    attributes and gradient hooks (the one mechanism: ZeRO's materialization, a pipeline stage's)."""
    marks = param_marks(p)
    torch.utils.swap_tensors(p, torch.nn.Parameter(t, requires_grad=p.requires_grad))
    put_marks(p, marks)


class KeepsMarks:
    """Mixin for a torch.nn.Module whose params (its own or its submodules') carry marks: they
    survive ``_apply`` (to_empty, to, cuda, ...) and load_state_dict(assign=True). Call
    ``self._keep_marks_on_load()`` once in __init__."""

    def _apply(self, fn, recurse=True):
        marks = {n: param_marks(p) for n, p in self.named_parameters(remove_duplicate=False)}
        out = super()._apply(fn, recurse)
        self._put_marks(marks)
        return out

    def _put_marks(self, marks: dict) -> None:
        for n, p in self.named_parameters(remove_duplicate=False):
            if n in marks:
                put_marks(p, marks[n])

    def __copy__(self):
        """A shallow copy shares the groups, as before (copy.copy also asks __reduce_ex__)."""
        new = type(self).__new__(type(self))
        new.__setstate__(self.__dict__.copy())
        return new

    def __reduce_ex__(self, protocol):
        """Pickling (torch.save(model), copy.deepcopy) of a module holding a process group or a
        Communicator (tensor/expert parallelism) is refused by name: a group is this process's live
        connection, and a copy's params would lose their marks and the SP grad hooks."""
        import torch.distributed as dist  # noqa: PLC0415

        from zerofuse.comm import Communicator  # noqa: PLC0415

        for name, m in self.named_modules():
            held = [k for k, v in m.__dict__.items() if isinstance(v, (dist.ProcessGroup, Communicator))]
            if held:
                raise TypeError(f"zerofuse: {type(self).__name__} cannot be pickled or deep-copied: "
                                f"{(name + '.') if name else ''}{held[0]} holds a process group (tensor or expert "
                                "parallelism). Save its state_dict() (or use zerofuse.checkpoint) and build the "
                                "module again to load it")
        return super().__reduce_ex__(protocol)

    def _keep_marks_on_load(self) -> None:
        # (module-level hooks: local ones made the module unpicklable, torch.save(model) failed)
        self.register_load_state_dict_pre_hook(_marks_before_load)
        self.register_load_state_dict_post_hook(_marks_after_load)


def _marks_before_load(module, *_):
    module._zf_load_marks = {n: param_marks(p) for n, p in module.named_parameters(remove_duplicate=False)}


def _marks_after_load(module, _incompatible):
    marks = module.__dict__.pop("_zf_load_marks", None)
    if marks is not None:
        module._put_marks(marks)
