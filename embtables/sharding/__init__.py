"""Layer 3: multi-process sharding over torch.distributed (the only layer that talks to other ranks)."""
