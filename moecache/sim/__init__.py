"""Trace-driven cache simulation: flat trace arrays, the policy interface and registry, replay drivers."""
