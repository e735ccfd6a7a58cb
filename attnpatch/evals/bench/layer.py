"""One attention layer (``attnpatch bench attention``): each method's time, peak memory and ratio to SDPA per length.

Every ratio is measured side by side in one run: each length times SDPA
(``torch.nn.functional.scaled_dot_product_attention``, causal with ``is_causal=True``, the
baseline every ratio divides) and every method back to back, with the same inputs, warm-up
calls excluded, and reports the median of the repeats.

What is timed for a method is what the method says (:meth:`~attnpatch.patchers.registry.Method.bench`,
a :class:`~attnpatch.patchers.bench_hook.BenchCase`): the whole layer, extra timed parts (FNA's
landmark sampling and Nyström product, AnchorAttention's stripe selection), an amortised time,
untimed statistics (sparsity, recall) and a note.  A method without a hook runs its forward on a
synthetic layer context, with SDPA where it hands back to exact attention.  This module knows no
method by name: any registered method whose model kinds fit the mode is measured (causal mode:
methods for causal LMs; non-causal mode: methods for ViTs).

Inputs are random normal ``q, k, v`` or captured from a real model (:func:`capture_qkv`,
``attnpatch bench capture``): random queries and keys give nearly uniform attention, where
sparse methods keep almost every key, so causal numbers that mean something need captured inputs.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch

from ...errors import OptionError
from ...patchers.bench_hook import BenchInputs, sdpa
from ...patchers.registry import MODEL_KINDS, Method, get_method, validate_options
from ...timing import time_call
from .timing import peak_extra_bytes, scaling_exponent

__all__ = ["DEFAULT_LENGTHS", "bench_attention", "layer_config"]

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)


def setting_label(method: str, options: dict[str, Any]) -> str:
    return method + (" (" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")" if options else "")


def layer_config(method: Method, options: dict[str, Any], *, causal: bool) -> Any:
    """The method's config for a one-layer bench in the given mode.

    Raises:
        OptionError: the method does not fit the mode (its model kinds), an option acts on the
            model as a whole (its declared ``model_scope``: across layers, or naming layers), or a bad option.
    """
    kind = "causal_lm" if causal else "vision"
    if not method.fits(kind):
        kinds = ", ".join(MODEL_KINDS.get(k, k) for k in sorted(method.model_kinds))
        if causal:
            raise OptionError(f"method {method.name!r} is non-causal (it fits {kinds} models); run it with --mode noncausal")
        what = "a causal prefill method" if "causal_lm" in method.model_kinds else f"a method for {kinds} models"
        raise OptionError(f"method {method.name!r} is {what}; run it with --mode causal")
    given = [n for n in options if n not in ("preset", "config")]
    unknown = sorted(set(given) - set(method.options))
    if unknown:
        raise OptionError(f"{method.name}: unknown option(s) {unknown}; bench attention takes {_layer_options(method)}")
    full = validate_options(method, options)  # an unknown preset, a bad value: the registry's message
    # a preset's or saved config's model-wide options count where they differ from the defaults
    implied = [n for n, o in method.options.items() if n not in given and full[n] != o.default]
    scoped = [n for n in given + implied if method.options[n].model_scope]
    if scoped:
        reason = method.options[scoped[0]].model_scope
        origin = "".join(f" ({k}={options[k]!r} sets {sorted(set(scoped) & set(implied))})" for k in ("preset", "config")
                         if k in options and set(scoped) & set(implied))
        raise OptionError(
            f"{method.name} options {sorted(scoped)}{origin} {reason} and do not apply to one attention layer; "
            f"bench attention takes {_layer_options(method)}"
        )
    return method.build_config(full)


def _layer_options(method: Method) -> str:
    names = [n for n, o in method.options.items() if not o.model_scope] + method.pseudo_options
    return ", ".join(names) or "no options"


def bench_attention(
    methods: Sequence[tuple[str, dict[str, Any]]],
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    causal: bool = False,
    batch: int = 1,
    heads: int = 6,
    kv_heads: int | None = None,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 1,
    reuse_layers: int = 6,
    qkv: dict[str, Any] | None = None,
    memory: bool = True,
    recall: bool = True,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time and memory of one attention layer per method and length, against SDPA in the same run.

    Args:
        methods: ``(name, options)`` pairs of registered methods whose model kinds fit the mode
            (``causal=True``: methods for causal LMs, e.g. ``anchor_attention``; ``causal=False``:
            methods for ViTs, e.g. ``fna``, ``sink_mask``; ``dense`` fits both).  Options as for
            :func:`attnpatch.patch`, single-layer ones only.
        lengths: sequence lengths ``N`` in tokens (with captured inputs: at most the captured length;
            the first ``N`` tokens are used, which for a causal model is exactly the ``N``-token prefix).
        causal: causal (LLM prefill) or non-causal (ViT) attention.
        batch, heads, kv_heads, head_dim: shape of random inputs (``kv_heads`` < ``heads`` = GQA).
        dtype, device: of the inputs (e.g. ``torch.bfloat16``, ``"cuda"``).
        repeats, warmup: timed calls (median reported) and untimed calls before them.
        reuse_layers: layers that share one per-forward computation, for amortised times (FNA: the
            layers that reuse one landmark sampling; DINOv2-S with the default sample layer 6 of 12: 6).
        qkv: captured inputs from :func:`load_qkv` (overrides the shape arguments).
        memory: also measure peak extra bytes of each call (one extra untimed call).
        recall: measure the methods' untimed statistics (AnchorAttention's sparsity and recall; one extra pass).
        seed: seed of random inputs.
        progress: called with a line of text as cells finish.

    Returns:
        ``{"rows": [...], "exponents": {label: slope}, "config": {...}}`` (and ``"plot_series"`` when a
        method asks for extra lines in the time plot); each row has ``N``, ``method``, ``seconds``
        (median), ``speedup`` (SDPA seconds / seconds), ``peak_bytes``, ``nxn_bytes`` (what one
        ``B x H x N x N`` score matrix in this dtype takes), and what the method's bench adds:
        ``fps_seconds``, ``nystrom_seconds``, ``fna_incl_seconds`` (FNA) or ``select_seconds``,
        ``sparsity``, ``recall`` (AnchorAttention), a ``note``.

    Raises:
        OptionError: a method that does not fit the mode, bad options or options that act on the
            whole model, or a length the captured inputs (or the method, e.g. FNA's ``s``) cannot serve.
        UnknownMethodError: a method that is not registered.
    """
    configs = [(name, opts, get_method(name)) for name, opts in methods]
    configs = [(name, opts, m, layer_config(m, dict(opts), causal=causal)) for name, opts, m in configs]
    if reuse_layers < 1:
        raise OptionError(f"reuse_layers={reuse_layers}: must be >= 1")
    if qkv is not None:
        cap_n = qkv["q"].shape[2]
        too_long = [n for n in lengths if n > cap_n]
        if too_long:
            raise OptionError(f"lengths {too_long}: the captured inputs have {cap_n} tokens")
        heads, kv_heads, head_dim = qkv["q"].shape[1], qkv["k"].shape[1], qkv["q"].shape[3]
        batch = qkv["q"].shape[0]
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise OptionError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    dev = torch.device(device)
    elem = torch.finfo(dtype).bits // 8
    rows: list[dict[str, Any]] = []
    series: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {}
    gen = torch.Generator().manual_seed(seed)
    for n in lengths:
        if qkv is not None:
            q, k, v = (qkv[x][:, :, :n].to(device=dev, dtype=dtype).contiguous() for x in ("q", "k", "v"))
            scale = float(qkv["scale"])
        else:
            q = torch.randn(batch, heads, n, head_dim, generator=gen).to(device=dev, dtype=dtype)
            k = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(device=dev, dtype=dtype)
            v = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(device=dev, dtype=dtype)
            scale = head_dim**-0.5
        nxn = batch * heads * n * n * elem

        def ref(q=q, k=k, v=v, scale=scale):
            return sdpa(q, k, v, scale=scale, causal=causal)

        t_ref = statistics.median(time_call(ref, repeats=repeats, warmup=warmup, device=dev))
        base = {"N": n, "batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "nxn_bytes": nxn}
        rows.append({**base, "method": "sdpa", "seconds": t_ref, "speedup": 1.0,
                     "peak_bytes": peak_extra_bytes(ref, dev) if memory else None})
        inputs = BenchInputs(scale=scale, causal=causal, reuse_layers=reuse_layers)
        for name, opts, method, cfg in configs:
            label = setting_label(name, opts)
            case = method.bench(cfg, q, k, v, inputs)
            series[label] = (tuple(case.exponents), dict(case.plot))

            def timed(fn):
                return statistics.median(time_call(fn, repeats=repeats, warmup=warmup, device=dev))

            parts = {p: timed(fn) for p, fn in case.parts.items()}
            t = case.seconds(parts) if case.seconds is not None else timed(case.call)
            row = {**base, "method": label, "seconds": t, "speedup": t_ref / t}
            row.update({f"{p}_seconds": s for p, s in parts.items()})
            if case.extra is not None:
                row.update(case.extra(parts, t_ref))
            row["peak_bytes"] = peak_extra_bytes(case.call, dev) if memory else None
            if case.note:
                row["note"] = case.note
            if recall and case.stats is not None:
                row.update(case.stats())
            rows.append(row)
            if progress is not None:
                progress(f"N={n} {label}: {t * 1e3:.1f} ms, {t_ref / t:.2f}x SDPA ({t_ref * 1e3:.1f} ms)")
    exps: dict[str, float | None] = {}
    for label in dict.fromkeys(r["method"] for r in rows):
        sel = [r for r in rows if r["method"] == label]
        exps[label] = scaling_exponent([r["N"] for r in sel], [r["seconds"] for r in sel])
        for part in series.get(label, ((), {}))[0]:
            exps[f"{label} [{part}]"] = scaling_exponent([r["N"] for r in sel], [r[f"{part}_seconds"] for r in sel])
    result = {
        "rows": rows,
        "exponents": exps,
        "config": {
            "mode": "causal" if causal else "noncausal", "lengths": list(lengths), "batch": batch, "heads": heads,
            "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "device": str(dev),
            "repeats": repeats, "warmup": warmup, "reuse_layers": reuse_layers, "inputs": "captured" if qkv is not None else "random",
        },
    }
    plots = {label: plot for label, (_, plot) in series.items() if plot}
    if plots:
        result["plot_series"] = plots
    return result
