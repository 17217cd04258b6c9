"""Adapters that let other engines' schedulers use kvcore unchanged."""
