"""Connectors that let other serving engines use the kvmesh store.

``vllm`` holds the vLLM (v1) KV connector; it is glue over engine-neutral parts: ``paged_kv``
(paged cache ↔ store arrays), ``request_tracker`` (what each request loads and saves),
``store_bridge`` (time-bounded synchronous calls into the store) and ``paged_transfer``
(running load and save plans against one paged cache).
"""
