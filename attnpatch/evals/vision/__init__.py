"""Frozen-feature evals of a vision model, dense vs patched (entry point: :func:`run_feature_eval`).

Modules: :mod:`.runner` (the eval: fidelity, k-NN, linear probe, retrieval), :mod:`.metrics` (the
metrics as pure functions of features and labels), :mod:`.images` (image sets: the embedded default, an
image folder or a ``datasets`` id), :mod:`.default_set` (the embedded default set), :mod:`.image_io` (decoding and checking image files),
:mod:`.preprocess` (resizing and normalisation), :mod:`.image_pass` (the batched image pass shared with
the CLIP evals: resume, data-parallel shares, throughput), :mod:`.table` (the table's columns and rows),
:mod:`.plots` (each eval's PNG: its metric against speed-up per setting, fidelity's per-layer error curves) and
:mod:`.sinks` (the attention-sink diagnostic).
"""

from __future__ import annotations

from .runner import TASKS, run_feature_eval

__all__ = ["run_feature_eval", "TASKS"]
