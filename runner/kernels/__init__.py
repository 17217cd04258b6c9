"""Triton kernels (paged attention, KV store); tested on CPU under TRITON_INTERPRET=1."""
