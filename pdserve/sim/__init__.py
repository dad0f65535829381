"""The simulator twin: the real scheduler, KV block manager, routing policies and engine loop, on modelled GPUs.

Pure Python (never torch). A heap-ordered event loop (`events`) drives N prefill and M decode engines (or N
colocated ones), each a real `LLMEngine` whose `SimExecutor` takes its step time from a time model
(`timemodel`: roofline for a named GPU, or DistServe-style coefficients fitted to the real engine); KV moves
over a contended link model (`link`); the conductor's flow (`conductor`) uses the real routing policies. Each
engine's host and disk KV tiers are the real `TieredKV`, its copies timed by `tier_io` on simulated links.
Pure decode batches are fast-forwarded with results identical to stepping (`fastforward`).

    from pdserve.sim.cluster import ClusterSpec, simulate
    run = simulate(workload, ClusterSpec(mode="pd", num_prefill=8, num_decode=8, tp=4), model, gpu, time_model)
"""
