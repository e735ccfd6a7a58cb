"""Evals: tasks, metrics and shared reporting. Each eval takes a model and returns a result dict."""
