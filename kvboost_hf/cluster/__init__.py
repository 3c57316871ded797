"""Serving past one machine (``kvboost-hf serve --ray``): Ray Serve replicas of the one-process app, and
the exact prefix router that sends a request to the replica whose store holds its prefix."""
