"""Inference: the plan (what lives where), greedy and sampled generation, the host KV cache
and the chat loop. See README.md beside this file."""
