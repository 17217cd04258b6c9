"""The block pool's parts apart from its core (:mod:`kvcore.block_pool`): the prefix-cache maps
with their partial prompt-tail entries (:mod:`kvcore.pool.maps`) and the scheduler hints' reserve
(:mod:`kvcore.pool.hints`)."""
