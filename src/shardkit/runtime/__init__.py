"""Apply a Plan with torch.distributed: worlds, sharding, steps, verification."""
