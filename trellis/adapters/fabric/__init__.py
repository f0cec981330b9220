"""Fabric drivers behind engine.ports.FabricDriver; the simulated fabric so far."""
