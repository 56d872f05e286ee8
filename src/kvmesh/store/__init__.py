"""Pillar 1: the tiered KV store (CPU RAM, local disk, Redis/Valkey, shared directory)."""
