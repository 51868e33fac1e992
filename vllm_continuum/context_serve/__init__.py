"""ContextServe: predict each tool call's duration class and dispatch its KV context.

FAST tools (ls, cat, git status...) get a strict pin for the predicted tool time, SLOW
tools (test suites, builds, installs) free or offload the context at once, UNCERTAIN
ones get Continuum's TTL. The predictor stacks, cheapest first:

- ``rules``: a user-extensible table of fast commands and slow prefixes;
- ``bayes``: a Normal-Inverse-Gamma posterior per tool, Thompson sampling;
- ``xgb``: an XGBoost classifier over ``features`` of the command text, trained in a
  background thread or loaded from a file;
- UNCERTAIN when no layer is confident.

``core.ContextServeCore`` (a ``ContinuumCore``) holds the decisions; ``config`` the knobs;
``stats`` the counters for metrics. Submodules are imported on use: ``stats`` and
``config`` stay free of numpy and xgboost.
"""
