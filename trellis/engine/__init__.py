"""Trellis engine: the pure core (intents, events, decide/evolve) and the engine service."""
