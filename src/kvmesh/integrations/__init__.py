"""Connectors that let other serving engines use the kvmesh store."""
