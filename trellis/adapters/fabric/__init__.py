"""Fabric drivers behind engine.service.ports.FabricDriver; the simulated fabric so far."""
