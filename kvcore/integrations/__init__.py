"""kvcore inside other engines.  :mod:`kvcore.integrations.vllm` makes kvcore the KV-cache
manager of vLLM's own scheduler; it imports vLLM lazily, and nothing else in kvcore imports it.
:mod:`kvcore.integrations.nanovllm` is a ``BlockManager`` for nano-vllm-style schedulers."""
