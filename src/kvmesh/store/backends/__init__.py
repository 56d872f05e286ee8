"""Storage backends: one async, batch-first interface (:class:`~kvmesh.store.backends.base.Backend`).

``memory`` (LRU in RAM), ``disk`` (bounded local directory), ``redis`` (Redis / Valkey / Redis
Cluster) and ``fs`` (a directory shared by many processes). Backends move opaque encoded chunks;
verification, timeouts, breakers and metrics are added around them by
:class:`~kvmesh.store.tiered.TieredStore`.
"""
