"""Pillar 3: the reference replica (real model or emulated GPU) with a device-tier prefix cache."""
