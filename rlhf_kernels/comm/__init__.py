"""Bounded-memory rollout distribution over torch.distributed."""
