"""The launcher's environment: torchrun's variables, or SLURM's mapped onto them (an srun step's
tasks are the ranks; the rendezvous host and port from the job), checked by name."""
from __future__ import annotations

import os
import re

from .cli import UsageError


def _slurm_master() -> str:
    """The first host of SLURM's node list: its first entry with each bracket's first value
    ("gpu[03-05,09],cpu1" -> "gpu03", "rack[1-2]-node[01-02]" -> "rack1-node01"; text after a
    bracket was dropped: "n[1-2]-ib" gave "n1", a review's reproduction, 2026-12-07)."""
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    host = re.split(r",(?![^\[]*\])", nodes)[0]  # (a comma inside brackets is a range's)
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], host)
    return host or "127.0.0.1"


def _slurm_port() -> int:
    """The rendezvous port of a SLURM job step: from the job id and the step id, over 10000 ports
    (29500 + job % 1000 gave two jobs whose ids agree mod 1000, and two steps of one job, one port)."""
    job, step = (int(v) if (v := os.environ.get(k, "")).isdigit() else 0 for k in ("SLURM_JOB_ID", "SLURM_STEP_ID"))
    return 20000 + (job * 17 + step) % 10000


def _dist_env() -> dict | None:
    """torch's launch variables when a launcher started us (torchrun, or SLURM mapped onto them)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {k: env.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    if srun_task() and env.get(SLURM_WORLD, "1") != "1":  # (check_dist_env: SLURM_STEP_NUM_TASKS=abc)
        world, nodes = env.get(SLURM_WORLD, ""), env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1")
        per_node = str(max(1, int(world) // int(nodes))) if world.isdigit() and nodes.isdigit() and int(nodes) else world
        return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": world, "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                "LOCAL_WORLD_SIZE": _step_tasks_here() or per_node}
    return None


def _step_tasks_here() -> str | None:
    """This node's task count in the srun step, from SLURM_STEP_TASKS_PER_NODE ("3,2", "2(x3),1")
    and SLURM_NODEID (the tasks over the nodes, evenly, before: 5 tasks on 2 nodes read 2 a node
    where the first holds 3, LOCAL_RANK 2 past LOCAL_WORLD_SIZE), None where they do not tell."""
    counts: list[str] = []
    for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [m.group(1)] * int(m.group(2) or 1)
    node, nodes = os.environ.get("SLURM_NODEID", ""), os.environ.get("SLURM_STEP_NUM_NODES", "")
    if nodes.isdigit() and int(nodes) != len(counts):  # (not this step's list: the split over the nodes)
        return None
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None


SLURM_WORLD = "SLURM_STEP_NUM_TASKS"  # the step's tasks (srun's); SLURM_NTASKS is the allocation's


def srun_task() -> bool:
    """A task of an srun job step (srun sets SLURM_STEP_NUM_TASKS). An sbatch script itself also
    carries SLURM_PROCID=0 and SLURM_NTASKS=N, but runs once, outside any step: taken for rank 0 of
    N, a job started there without srun waited in the rendezvous for ranks that never come, saying
    nothing (a review's reproduction, 2026-12-07); it launches --nproc ranks here instead."""
    return "SLURM_PROCID" in os.environ and SLURM_WORLD in os.environ


def slurm_without_srun() -> str | None:
    """A note when SLURM allocated several tasks but this process is no srun task (see srun_task)."""
    n = os.environ.get("SLURM_NTASKS", "1")
    if "RANK" in os.environ or srun_task() or "SLURM_JOB_ID" not in os.environ or n == "1":
        return None
    return (f"SLURM allocated SLURM_NTASKS={n} tasks, but this process is no srun task (a batch script or an "
            "salloc shell, in no srun step): it launches --nproc ranks on this node; start it with srun to run one "
            "rank per SLURM task")


def check_dist_env(env: dict | None) -> None:
    """The launcher's variables are whole numbers with 0 <= RANK < WORLD_SIZE, named as set (torch's
    int() traceback before; RANK=3 of WORLD_SIZE=2 waited STARTUP_S in the rendezvous for peers that
    never come, WORLD_SIZE=0 blamed --nproc; a review's reproductions, 2026-12-07)."""
    if env is None:
        return
    slurm = not ("RANK" in os.environ and "WORLD_SIZE" in os.environ)  # (_dist_env mapped SLURM's onto them)
    names = ({"RANK": "SLURM_PROCID", "WORLD_SIZE": SLURM_WORLD, "LOCAL_RANK": "SLURM_LOCALID",
              "LOCAL_WORLD_SIZE": f"{SLURM_WORLD} / SLURM_STEP_NUM_NODES"} if slurm else {k: k for k in env})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        v = env.get(key)
        if v is not None and not (v.isascii() and v.isdigit()):
            raise UsageError(f"environment: {names[key]}={v!r}: expected a whole number (set by the launcher)")
    if int(env["WORLD_SIZE"]) < 1 or int(env["RANK"]) >= int(env["WORLD_SIZE"]):
        raise UsageError(f"environment: {names['RANK']}={env['RANK']} of {names['WORLD_SIZE']}={env['WORLD_SIZE']}: "
                         "expected 0 <= rank < world size >= 1")


def _launcher_world() -> int | None:
    env = _dist_env()
    return None if env is None else int(env["WORLD_SIZE"])


def _slurm_endpoint() -> None:
    """Under SLURM: MASTER_ADDR and MASTER_PORT from the job where not set (each on its own: an
    exported MASTER_ADDR without a port failed in torch's env:// with a traceback)."""
    if "SLURM_PROCID" in os.environ:
        os.environ.setdefault("MASTER_ADDR", _slurm_master())
        os.environ.setdefault("MASTER_PORT", str(_slurm_port()))
