"""Serving past one machine: routing requests to the replica whose store holds their prefix (issue 25, in progress)."""
