"""`pdserve bench`: the load generator. `metrics` holds the pure metric math (no torch, no HTTP)."""
