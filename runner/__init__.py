"""runner: a paged-attention engine on kvcore."""
