"""Evals: one package per task, each with one entry point, plus the run plumbing they share.

=================  ==========================================================================
package            task (entry point)
=================  ==========================================================================
:mod:`.ruler`      RULER-style long-context tasks on a causal LM (``run_ruler``)
:mod:`.vision`     frozen-feature evals of a ViT: fidelity, k-NN, linear probe, retrieval (``run_feature_eval``)
:mod:`.clip`       CLIP zero-shot classification and image-text retrieval (``run_zeroshot_eval``, ``run_retrieval_eval``)
:mod:`.bench`      speed and memory of one attention layer or a whole model (``bench_attention``, ``bench_vision_model``, ``bench_causal_lm``)
:mod:`.compare`    several settings of several methods side by side, matched on a knob (``compare``)
:mod:`.tune`       the cheapest setting that meets an accuracy target (``tune_causal``, ``tune_vision``)
:mod:`.recall`     attention recall of a patched causal LM against the exact attention (``attention_recall``)
:mod:`.run`        reporting, resume, data-parallel processes, devices
=================  ==========================================================================

Each eval takes a model and returns a result dict.
"""
