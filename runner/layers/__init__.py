"""Model building blocks: RMSNorm, rotary embeddings, tensor-parallel linear layers."""
