"""Routing traces: the canonical format, the asynchronous logger, the model hooks and importers."""
