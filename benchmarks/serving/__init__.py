"""Served runs: load against any OpenAI-compatible server, and what Ray Serve and HTTP cost on top of the engine."""
