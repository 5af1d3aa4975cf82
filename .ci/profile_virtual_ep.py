"""Where the time of a virtual-EP question goes (docs/bench.md, "Where a virtual-EP question's time goes").

On the device machine, from the repo root with the wheels installed as .ci/gpu-session.sh does:
    python3 .ci/profile_virtual_ep.py > profile.json      (PROFILE_CPU=1: a small layer on 4 CPU engines, a smoke run)
4 ranks share the GPU over gloo; each rank times, after a barrier and with the device synchronised: raw gloo
collectives on CUDA tensors, the layer build and weight init, forwards (and the collectives inside one, timed by
wrapping torch.distributed and megatron's aliases), forward+backward steps, comparisons; then the controller times
four probe questions on the warm cluster. Prints what it measured (the printed probe lines, then one JSON object).
"""
import json
import sys
import time


def eng_profile(cfg_dict, steps=3):
    import functools
    import sys
    import time
    import statistics

    import torch
    import torch.distributed as tdist

    from moe_lab import metrics
    from moe_lab.config import MoEConfig
    from moe_lab.engine import compat, layer as L, toolkit
    from moe_lab.engine.dist import STATE
    from moe_lab.questions.compound import experiment as compound

    out = {"rank": tdist.get_rank()}
    dev = STATE["torch_device"]

    def timed(fn):
        tdist.barrier(); toolkit.sync(); t0 = time.perf_counter(); r = fn(); toolkit.sync()
        return time.perf_counter() - t0, r

    # raw gloo collectives on CUDA tensors
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(1024 * 4096, device=dev).to(dt)
        g = torch.empty(4 * x.numel(), device=dev, dtype=dt)
        ts = [timed(lambda: tdist.all_gather_into_tensor(g, x))[0] for _ in range(3)]
        out[f"allgather_8Mel_{dt}"] = statistics.median(ts)
        y = torch.empty(x.numel(), device=dev, dtype=dt)
        ts = [timed(lambda: tdist.reduce_scatter_tensor(y, g))[0] for _ in range(3)]
        out[f"reduce_scatter_32Mel_{dt}"] = statistics.median(ts)
        ts = [timed(lambda: tdist.all_reduce(x))[0] for _ in range(3)]
        out[f"all_reduce_4Mel_{dt}"] = statistics.median(ts)
    cfg = MoEConfig(**cfg_dict)
    STATE.get("layers", {}).clear()
    torch.cuda.empty_cache()
    t, lyr = timed(lambda: compat.build_moe_layer(cfg, ep=4, tp=1, device=STATE["device"]))
    out["build_s"] = t
    from megatron.core import parallel_state as ps
    t, _ = timed(lambda: L.init_weights(lyr, cfg, ep_rank=ps.get_expert_model_parallel_rank(), tp_rank=0, tp=1))
    out["init_weights_s"] = t
    del lyr
    STATE.get("layers", {}).clear()
    torch.cuda.empty_cache()
    t, layer = timed(lambda: L.get_layer(cfg))
    out["get_layer_s"] = t
    t, tokens = timed(lambda: L.make_tokens(cfg, dev))
    out["tokens_s"] = t
    # collectives inside a forward
    acc = {}
    originals = {}
    names = ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
             "all_to_all_single", "all_reduce", "all_gather")

    def wrap(name, orig):
        @functools.wraps(orig)
        def w(*a, **k):
            toolkit.sync(); t0 = time.perf_counter(); r = orig(*a, **k); toolkit.sync()
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
            return r
        return w
    fwd = [timed(lambda: toolkit.forward(layer, tokens))[0] for _ in range(5)]
    out["forward_s"] = fwd
    patched = []
    for n in names:
        if hasattr(tdist, n):
            o = getattr(tdist, n); ww = wrap(n, o); setattr(tdist, n, ww); patched.append((tdist, n, o)); originals[id(o)] = ww
    for mn, m in list(sys.modules.items()):
        if mn.startswith("megatron.") and m is not None:
            for a, v in list(vars(m).items()):
                if id(v) in originals:
                    setattr(m, a, originals[id(v)]); patched.append((m, a, v))
    fw = [timed(lambda: toolkit.forward(layer, tokens))[0] for _ in range(3)]
    out["forward_with_sync_timers_s"] = fw
    out["collectives_per_forward_s"] = {k: v / 3 for k, v in acc.items()}
    acc.clear()
    R = compound._loss_weights(cfg, dev)
    st = [timed(lambda: compound._step([layer], tokens, 90, R))[0] for _ in range(2)]
    out["step_with_sync_timers_s"] = st
    out["collectives_per_step_s"] = {k: v / 2 for k, v in acc.items()}
    for m, a, v in patched:
        setattr(m, a, v)
    st = [timed(lambda: compound._step([layer], tokens, 90, R))[0] for _ in range(steps)]
    out["step_s"] = st
    A = compound._step([layer], tokens, 90, R)
    B = compound._step([layer], tokens, 90, R)
    t, _ = timed(lambda: compound._compare_grads(A["experts"], B["experts"]))
    out["compare_grads_s"] = t
    g0 = next(iter(A["experts"].values()))
    t, _ = timed(lambda: metrics.fingerprint(g0))
    out["fingerprint_one_expert_grad_s"] = t
    t, _ = timed(lambda: metrics.compare(g0, B["experts"][next(iter(B["experts"]))]))
    out["compare_one_expert_grad_s"] = t
    t, _ = timed(lambda: torch.equal(g0, B["experts"][next(iter(B["experts"]))]))
    out["equal_one_expert_grad_s"] = t
    o = toolkit.forward(layer, tokens)
    t, _ = timed(lambda: toolkit.compare_across_ranks({"out": o}))
    out["compare_across_ranks_s"] = t
    t, _ = timed(lambda: metrics.compare(o, o))
    out["compare_out_s"] = t
    out["n_expert_grads"] = len(A["experts"])
    out["cuda_max_alloc_GiB"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return out


def main():
    from moe_lab.config import ClusterConfig, MoEConfig
    from moe_lab.controller.cluster import Cluster
    from moe_lab.experiments import probe

    res = {}
    import os
    cpu = os.environ.get("PROFILE_CPU")
    cfg = MoEConfig.seed_report() if not cpu else MoEConfig(hidden=256, num_experts=8, topk=4, ffn_hidden=512, seq_len=128)
    t0 = time.time()
    cc = ClusterConfig(device="cpu", engines=4) if cpu else ClusterConfig(device="cuda", engines=4, ranks_per_gpu=4, timeout_s=300)
    with Cluster(cc) as c:
        res["ready_s"] = time.time() - t0
        res["engines"] = c.run(eng_profile, cfg.__dict__ | {"options": tuple(cfg.options)}, timeout=400)
        for rd, det in (("none", False), ("fp32", False), ("fp32", False), ("none", True)):
            q = cfg.replace(router_dtype=rd, deterministic=det)
            t = time.time()
            r = probe.run(c, q, trials=5)
            res.setdefault("probe", []).append({"cfg": f"{rd} det={det}", "wall_s": time.time() - t,
                                                "t_forward_s": r.get("t_forward_s")})
            print(res["probe"][-1], flush=True)
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
