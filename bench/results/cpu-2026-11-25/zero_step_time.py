"""Median step time (rank 0) of zerofuse ZeRO stages on the bench_zero GPT, ws 2 gloo."""
import os, sys, time, tempfile, statistics, json
import torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank, init, stages, q):
    import zerofuse
    from zerofuse.models import GPT, GPTConfig
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    out = {}
    for stage in stages:
        model = GPT(GPTConfig(vocab_size=65, seq_len=128, n_layer=6, n_head=6, dim=384), seed=0)
        x = torch.randint(0, 65, (4, 129), generator=torch.Generator().manual_seed(rank))
        zerofuse.zero.parallelize(model, stage=stage)
        opt = zerofuse.zero.Optimizer(model, "adamw", lr=1e-3, weight_decay=0.01)
        ts = []
        for i in range(13):
            dist.barrier()
            t0 = time.perf_counter()
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ts.append(time.perf_counter() - t0)
        out[stage] = statistics.median(ts[3:]) * 1e3
        del model, opt
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    d = tempfile.mkdtemp()
    ps = [ctx.Process(target=run, args=(d + "/init", [0, 1, 2, 3], q, )) for _ in range(0)]
    procs = [ctx.Process(target=run, args=(r, d + "/init", [0, 1, 2, 3], q)) for r in range(2)]
    for p in procs: p.start()
    res = q.get()
    for p in procs: p.join()
    print(sys.argv[1], json.dumps({k: round(v, 1) for k, v in res.items()}), flush=True)
