"""The fleet simulator: the product's routing policies and autoscaler over simulated
replicas, each the engine's real scheduler and block manager with a fitted step time."""
