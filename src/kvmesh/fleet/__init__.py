"""Launches engines, the router and the shared tier on one machine (`kvmesh up`, `kvmesh demo`)."""
