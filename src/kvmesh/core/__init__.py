"""Formats that cross process boundaries: identities, block keys, KV events and their transport.

Every pillar (store, engine, router) depends on this package and on nothing of each other.
"""
