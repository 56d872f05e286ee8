"""Discrete-event fleet simulator built on the engine's cost model and the router's own code."""
