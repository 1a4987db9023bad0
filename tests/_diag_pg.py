import gc, os, sys, types
import torch.distributed as dist

def loops():
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop" for t in os.listdir("/proc/self/task"))

def live_groups():
    gc.collect()
    pgs = [o for o in gc.get_objects() if isinstance(o, dist.ProcessGroup)]
    out = []
    default = dist.distributed_c10d._get_default_group()
    for pg in pgs:
        if pg is default: continue
        chain = []
        obj = pg
        for depth in range(6):
            refs = [r for r in gc.get_referrers(obj) if not isinstance(r, (types.FrameType, list)) or (isinstance(r, list) and r is not pgs)]
            refs = [r for r in refs if r is not pgs and not (isinstance(r, list) and any(x is pgs for x in [r]))]
            if not refs: break
            r = refs[0]
            desc = type(r).__name__
            if isinstance(r, dict):
                keys = [k for k, v in r.items() if v is obj][:2]
                desc += f" keys={keys!r:.80}"
            chain.append(desc)
            obj = r
        out.append(" <- ".join(chain))
    return loops(), len(out), out[:15]
