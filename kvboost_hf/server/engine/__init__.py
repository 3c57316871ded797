"""One request to ``model.generate``: sampling settings, stop tokens, the ``--draft`` wiring."""
