"""Runs inside each engine process (one torch.distributed rank): process group, the layer, capture, measurement."""
