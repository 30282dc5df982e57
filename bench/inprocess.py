"""zerofuse-train's Trainer in this process (a world of one), for the step profilers
(profile_step.py on CPU, profile_gpu_step.py on a GPU)."""
from __future__ import annotations

import json
import tempfile


def trainer(flags: list[str]):
    """A set-up Trainer of ``zerofuse-train FLAGS`` with no evaluation, samples or checkpoints,
    writing to a temporary folder."""
    from zerofuse import train
    from zerofuse.train.loop import Trainer

    args = train._parser().parse_args(["--nproc", "1", "--eval-every", "0", "--sample-tokens", "0",
                                       "--ckpt-every", "0", "--out", tempfile.mkdtemp(), *flags])
    train.validate(args)
    t = Trainer(args, None)
    t._setup()
    return t


def finish(res: dict, path: str | None) -> int:
    """res written to path as JSON (if given), the process group closed."""
    import torch.distributed as dist

    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()
    return 0
