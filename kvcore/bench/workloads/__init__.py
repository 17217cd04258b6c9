"""Standalone workload scripts (run as ``python <file> --impl kvcore|vllm``; see kvcore.bench)."""
