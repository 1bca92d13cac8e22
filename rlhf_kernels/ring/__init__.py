"""Ring attention (sequence parallelism) over torch.distributed."""
