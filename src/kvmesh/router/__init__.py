"""Pillar 2: the KV-cache-aware router and OpenAI-compatible gateway."""
