"""Thin SFT / RM / PPO trainers composed from rlhf_kernels."""
