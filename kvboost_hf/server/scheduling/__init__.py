"""How requests reach the model: memory admission and its calibration, a request's candidates as rows,
and the two queues ``--scheduler`` picks from (``workers``: one generate per worker thread;
``batch``: continuous batching over :mod:`kvboost_hf.batching`, whose scheduler decides each step)."""
