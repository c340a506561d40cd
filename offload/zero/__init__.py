"""ZeRO stages 1-3 on torch.distributed: the rank group and shard arithmetic (group), the
gradient reduction (grads) and the parameter gather and the rest (rest). See README.md."""
