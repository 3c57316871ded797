"""Prometheus collectors (``/metrics``) and the JSON figures of ``/v1/stats``."""
