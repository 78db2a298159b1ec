"""How ops on ShardTensors are routed: handler registries, the two torch hooks, and per-family rules."""
