"""The lowest layer: the mesh value, partition specs, the per-thread context, primitives.

Nothing here imports a transport, a simulator or torch.distributed.
"""
