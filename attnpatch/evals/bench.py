"""Speed and memory benchmarks: one attention layer (``bench attention``) and whole models (``bench model``).

Every ratio is measured side by side in one run: each length (or resolution) times the exact
baseline and every method back to back, with the same inputs, warm-up calls excluded, and
reports the median of the repeats.  Memory is the peak of what the call allocates on top of
its inputs (bytes): on CUDA from the caching allocator's peak statistics, on the CPU from the
PyTorch profiler's allocation events (tensors alive across operator boundaries; a kernel's
internal scratch is not seen).

Methods of ``bench attention``:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (causal with ``is_causal=True``),
  the baseline every ratio divides.
* ``fna`` (non-causal): farthest-point sampling of ``s`` landmarks on the keys (heads
  concatenated, as :mod:`attnpatch.patchers.vision_methods` does) and Nyström attention.
  Reported three ways: ``fps`` (landmark selection alone), ``nystrom`` (landmarks given) and
  ``fna`` = Nyström plus the FPS amortised over the ``reuse_layers`` layers that reuse one
  sampling (FNA samples once per forward), besides ``fna_incl`` = Nyström plus one whole FPS.
* ``anchor_attention`` (causal): stripe selection plus exact attention on the kept keys;
  sparsity and mean attention recall (exact softmax mass on the kept keys) are measured on
  the same inputs outside the timed calls; ``select`` times the selection alone.

Any bench can run beside a competing PyTorch process (:func:`background_load`, ``--background-load``):
a second program keeping every core busy, as a data-loader worker or another job does, is where
small multi-threaded kernels stall (FNA's ``s x s`` eigendecomposition took 60-1000 ms instead of
1-2 ms under it before it was pinned to one MKL thread).

Inputs are random normal ``q, k, v`` or captured from a real model (:func:`capture_qkv`,
``attnpatch bench capture``): random queries and keys give nearly uniform attention, where
AnchorAttention keeps almost every key, so causal numbers that mean something need captured inputs.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import AttnpatchError, OptionError

__all__ = [
    "ATTENTION_METHODS",
    "DEFAULT_LENGTHS",
    "time_call",
    "peak_extra_bytes",
    "scaling_exponent",
    "capture_qkv",
    "load_qkv",
    "bench_attention",
    "bench_vision_model",
    "bench_causal_lm",
    "plot_attention",
    "background_load",
    "BACKGROUND_LOAD_LIMIT_S",
]

ATTENTION_METHODS = ("fna", "anchor_attention")
BACKGROUND_LOAD_LIMIT_S = 900.0
DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
_FNA_BENCH_OPTIONS = ("s", "strategy", "pinv", "rtol", "newton_iters", "seed")


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1, device: torch.device | str = "cpu") -> list[float]:
    """Wall time of ``fn()`` in seconds, ``repeats`` times after ``warmup`` untimed calls (CUDA synchronised).

    Raises:
        OptionError: ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise OptionError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1 and warmup >= 0")
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated by one call of ``fn()`` above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset.  CPU: the PyTorch profiler's
    memory events (each top-level operator's allocations at its start, frees as they happen),
    so buffers alive across operator boundaries are counted and a fused kernel's internal
    tiles are not.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del out
        return int(peak)
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    points = []
    for e in prof.events():
        if e.name == "[memory]" or (e.cpu_parent is None and e.cpu_memory_usage):
            points.append((e.time_range.start, e.cpu_memory_usage))
    points.sort(key=lambda p: p[0])
    cur = peak = 0
    for _, b in points:
        cur += b
        peak = max(peak, cur)
    return int(peak)


@contextlib.contextmanager
def _native_stderr_silenced():
    """Silence file descriptor 2 (some PyTorch builds' profiler logs its start and stop there from C++)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def scaling_exponent(lengths: Sequence[float], seconds: Sequence[float]) -> float | None:
    """Slope of the least-squares line through ``(log N, log t)``: time grows like ``N ** slope``.

    Returns ``None`` with fewer than two points.
    """
    pts = [(math.log(n), math.log(t)) for n, t in zip(lengths, seconds) if t and t > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


# ---------------------------------------------------------------------------------------------
# a competing process

_LOAD_CODE = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
parent = int(sys.argv[2])
import torch
a = torch.randn(int(sys.argv[3]), int(sys.argv[3]))
a = torch.tanh(a @ a)
print("ready", torch.get_num_threads(), flush=True)
n = 0
while time.monotonic() < end and os.getppid() == parent:
    a = torch.tanh(a @ a)
    n += 1
"""


@contextlib.contextmanager
def background_load(limit_s: float | None = BACKGROUND_LOAD_LIMIT_S, *, size: int = 512, start_timeout_s: float = 120.0):
    """Run the block beside a competing PyTorch process: ``a = torch.tanh(a @ a)`` on ``size x size`` float32, looped.

    The process is what a data-loader worker or a second job does to a machine: a PyTorch
    program with PyTorch's default thread count (one per core) keeping every core busy.  It is
    a subprocess of this one, started before the block (the block begins once it has imported
    PyTorch and run its first product) and killed when the block ends or fails; it also stops
    itself after ``limit_s`` seconds and when this process goes away, so it never outlives a
    killed bench by more than one product.

    Yields a dict recorded in the bench JSON: ``command``, ``pid``, ``size``, ``threads`` (the
    competitor's torch threads), ``limit_s``, ``seconds`` (how long it ran beside the block) and
    ``alive_at_end`` (``False`` when the block outlived ``limit_s`` or the process died, so part
    of the bench ran without the load).  With ``limit_s=None`` nothing is started and it yields
    ``None``.

    Raises:
        OptionError: ``limit_s`` or ``size`` not positive.
        AttnpatchError: the process did not start within ``start_timeout_s``.
    """
    import subprocess
    import threading

    if limit_s is None:
        yield None
        return
    if not limit_s > 0 or size < 1:
        raise OptionError(f"background load: limit_s={limit_s}, size={size}: both must be positive")
    argv = [sys.executable, "-c", _LOAD_CODE, repr(float(limit_s)), str(os.getpid()), str(int(size))]
    info: dict[str, Any] = {
        "command": f"python -c 'a = torch.randn({size}, {size}); while True: a = torch.tanh(a @ a)' (default torch threads)",
        "size": int(size), "limit_s": float(limit_s),
    }
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    t0 = time.perf_counter()
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout_s)
        if not line or not line[0].startswith("ready"):
            raise AttnpatchError(f"background load: the competing process did not start within {start_timeout_s:.0f} s")
        info.update(pid=proc.pid, threads=int(line[0].split()[1]))
        t0 = time.perf_counter()
        yield info
    finally:
        info["alive_at_end"] = proc.poll() is None
        info["seconds"] = time.perf_counter() - t0
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a killed process always goes
            pass
        if proc.stdout is not None:
            proc.stdout.close()


# ---------------------------------------------------------------------------------------------
# captured inputs


def capture_qkv(model, input_ids: torch.Tensor, layers: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Queries, keys and values of the given attention layers of a causal LM on ``input_ids``.

    The model is patched with ``dense`` for the call (unpatched afterwards) and the forward
    stops after the last requested layer, so the cost is that of those layers only.

    Args:
        model: a Hugging Face causal LM the patch supports.
        input_ids: ``[1, L]`` token ids.
        layers: attention-layer indices.

    Returns:
        ``{layer: {"q": [1, H, L, D], "k": [1, Hkv, L, D], "v": [1, Hkv, L, D], "scale": float}}`` (detached copies).

    Raises:
        OptionError: a layer index outside the model.
    """
    from ..patchers.core import patch, record_stats, unpatch

    want = sorted({int(x) for x in layers})
    got: dict[int, dict[str, Any]] = {}

    class _Done(Exception):
        pass

    def probe(ctx, q, k, v):
        if ctx.layer in want:
            got[ctx.layer] = {"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone(), "scale": float(ctx.scale)}
            if len(got) == len(want):
                raise _Done

    patch(model, "dense")
    try:
        from ..patchers.core import handle_of

        n = handle_of(model).num_layers
        bad = [x for x in want if not 0 <= x < n]
        if bad:
            raise OptionError(f"layers={bad}: the model has attention layers 0..{n - 1}")
        with torch.no_grad(), record_stats(model, probe=probe):
            try:
                model(input_ids, use_cache=False)
            except _Done:
                pass
    finally:
        unpatch(model)
    return got


def load_qkv(path: str | Path, layer: int | None = None) -> tuple[dict[str, Any], int]:
    """Load a file written by ``attnpatch bench capture``: ``(entry, layer)`` for ``layer`` (default: the first).

    ``entry`` is ``{"q": [B, H, L, D], "k": [B, Hkv, L, D], "v": [B, Hkv, L, D], "scale": float}`` on the CPU.

    Raises:
        AttnpatchError: missing file or layer.
    """
    p = Path(path)
    if p.is_dir():
        raise AttnpatchError(f"--qkv {path}: is a directory; give the file `attnpatch bench capture` wrote")
    if not p.is_file():
        raise AttnpatchError(f"--qkv {path}: no such file (write one with `attnpatch bench capture`)")
    bad = AttnpatchError(f"--qkv {path}: not a file written by `attnpatch bench capture` (expected {{layer: {{'q', 'k', 'v', 'scale'}}}})")
    try:
        data = torch.load(p, map_location="cpu")
    except Exception:
        raise bad from None
    ok = isinstance(data, dict) and data and all(
        isinstance(lk, int) and isinstance(e, dict) and {"q", "k", "v", "scale"} <= set(e)
        and all(isinstance(e[x], torch.Tensor) and e[x].dim() == 4 for x in "qkv")
        for lk, e in data.items()
    )
    if not ok:
        raise bad
    if layer is None:
        layer = min(data)
    if layer not in data:
        raise AttnpatchError(f"--layer {layer}: {path} holds layers {sorted(data)}")
    return data[layer], layer


# ---------------------------------------------------------------------------------------------
# one attention layer


def _split_fna_options(options: dict[str, Any]):
    from ..patchers.registry import get_method, validate_options

    method = get_method("fna")
    unknown = sorted(set(options) - set(method.options))
    if unknown:
        raise OptionError(f"fna: unknown option(s) {unknown}; bench attention takes {', '.join(_FNA_BENCH_OPTIONS)}")
    extra = sorted(set(options) - set(_FNA_BENCH_OPTIONS))
    if extra:
        raise OptionError(
            f"fna options {extra} act across layers and do not apply to one attention layer; "
            f"bench attention takes {', '.join(_FNA_BENCH_OPTIONS)}"
        )
    return method.make_config(validate_options(method, options))


def _anchor_config(options: dict[str, Any]):
    from ..patchers.registry import get_method, validate_options

    method = get_method("anchor_attention")
    extra = sorted({"dense_layers", "dense_heads"} & set(options))
    if extra:
        raise OptionError(f"anchor_attention options {extra} name model layers and do not apply to one attention layer")
    return method.make_config(validate_options(method, options))


def _label(method: str, options: dict[str, Any]) -> str:
    return method + (" (" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")" if options else "")


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
        methods: ``(name, options)`` pairs; ``fna`` needs ``causal=False``, ``anchor_attention``
            needs ``causal=True``.  Options as for :func:`attnpatch.patch` (single-layer ones only).
        lengths: sequence lengths ``N`` in tokens (with captured inputs: at most the captured length;
            the first ``N`` tokens are used, which for a causal model is exactly the ``N``-token prefix).
        causal: causal (LLM prefill) or non-causal (ViT) attention.
        batch, heads, kv_heads, head_dim: shape of random inputs (``kv_heads`` < ``heads`` = GQA).
        dtype, device: of the inputs (e.g. ``torch.bfloat16``, ``"cuda"``).
        repeats, warmup: timed calls (median reported) and untimed calls before them.
        reuse_layers: layers that share one FPS sampling, for FNA's amortised time (DINOv2-S
            with the default sample layer 6 of 12: 6).
        qkv: captured inputs from :func:`load_qkv` (overrides the shape arguments).
        memory: also measure peak extra bytes of each call (one extra untimed call).
        recall: measure AnchorAttention's sparsity and recall (one extra untimed pass).
        seed: seed of random inputs.
        progress: called with a line of text as cells finish.

    Returns:
        ``{"rows": [...], "exponents": {label: slope}, "config": {...}}``; each row has ``N``,
        ``method``, ``seconds`` (median), ``speedup`` (SDPA seconds / seconds), ``peak_bytes``,
        ``nxn_bytes`` (what one ``B x H x N x N`` score matrix in this dtype takes), and per
        method ``fps_seconds``, ``nystrom_seconds``, ``fna_incl_seconds`` (FNA) or
        ``select_seconds``, ``sparsity``, ``recall`` (AnchorAttention).

    Raises:
        OptionError: unknown method, a method that does not fit the mode, bad options, or a
            length the captured inputs or ``s`` cannot serve.
    """
    from ..attention.anchor import anchor_attention, select_stripes
    from ..attention.nystrom import nystrom_attention, select_landmarks

    configs = []
    for name, opts in methods:
        if name == "fna":
            if causal:
                raise OptionError("method 'fna' is non-causal (ViT attention); run it with --mode noncausal")
            configs.append((name, opts, _split_fna_options(dict(opts))))
        elif name == "anchor_attention":
            if not causal:
                raise OptionError("method 'anchor_attention' is a causal prefill method; run it with --mode causal")
            configs.append((name, opts, _anchor_config(dict(opts))))
        else:
            raise OptionError(f"method {name!r}: bench attention measures {', '.join(ATTENTION_METHODS)} (SDPA is always measured)")
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
    for name, _, cfg in configs:
        if name == "fna" and min(lengths) <= cfg.s:
            raise OptionError(f"fna s={cfg.s}: every length must exceed s (got N={min(lengths)})")
    dev = torch.device(device)
    elem = torch.finfo(dtype).bits // 8
    rows: list[dict[str, Any]] = []
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
        gqa = heads != kv_heads
        nxn = batch * heads * n * n * elem

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)

        t_ref = statistics.median(time_call(sdpa, repeats=repeats, warmup=warmup, device=dev))
        base = {"N": n, "batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "nxn_bytes": nxn}
        rows.append({**base, "method": "sdpa", "seconds": t_ref, "speedup": 1.0,
                     "peak_bytes": peak_extra_bytes(sdpa, dev) if memory else None})
        for name, opts, cfg in configs:
            label = _label(name, opts)
            if name == "fna":
                kr = k.repeat_interleave(heads // kv_heads, 1) if gqa else k
                vr = v.repeat_interleave(heads // kv_heads, 1) if gqa else v
                feats = kr.transpose(1, 2).reshape(batch, n, heads * head_dim)
                lm = select_landmarks(feats, cfg.s, prefix=1, strategy=cfg.strategy, seed=cfg.seed)

                def fps(feats=feats, cfg=cfg):
                    return select_landmarks(feats, cfg.s, prefix=1, strategy=cfg.strategy, seed=cfg.seed)

                def nys(kr=kr, vr=vr, lm=lm, cfg=cfg):
                    return nystrom_attention(q, kr, vr, lm, scale=scale, pinv=cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters)

                def whole(fps=fps, kr=kr, vr=vr, cfg=cfg):
                    return nystrom_attention(q, kr, vr, fps(), scale=scale, pinv=cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters)

                t_fps = statistics.median(time_call(fps, repeats=repeats, warmup=warmup, device=dev))
                t_ny = statistics.median(time_call(nys, repeats=repeats, warmup=warmup, device=dev))
                t_am = t_ny + t_fps / reuse_layers
                rows.append({
                    **base, "method": label, "seconds": t_am, "speedup": t_ref / t_am,
                    "fps_seconds": t_fps, "nystrom_seconds": t_ny, "fna_incl_seconds": t_ny + t_fps,
                    "speedup_incl": t_ref / (t_ny + t_fps), "speedup_nystrom": t_ref / t_ny, "reuse_layers": reuse_layers,
                    "s": cfg.s, "peak_bytes": peak_extra_bytes(whole, dev) if memory else None,
                })
            else:

                def anchor(cfg=cfg):
                    return anchor_attention(q, k, v, cfg, scale=scale)[0]

                def select(cfg=cfg):
                    return select_stripes(q, k, cfg, scale=scale)

                t_a = statistics.median(time_call(anchor, repeats=repeats, warmup=warmup, device=dev))
                dense_run = n < cfg.min_len or cfg.theta == math.inf
                t_s = None if dense_run else statistics.median(time_call(select, repeats=repeats, warmup=warmup, device=dev))
                row = {**base, "method": label, "seconds": t_a, "speedup": t_ref / t_a, "select_seconds": t_s,
                       "peak_bytes": peak_extra_bytes(anchor, dev) if memory else None}
                if dense_run:
                    row["note"] = "ran dense: N < min_len" if n < cfg.min_len else "ran dense: theta = inf"
                if recall:
                    _, st = anchor_attention(q, k, v, cfg, scale=scale, return_stats=True, compute_recall=True)
                    row["sparsity"] = float(1.0 - st.kept_pairs.sum() / st.causal_pairs.sum().clamp(min=1))
                    row["recall"] = float(st.recall.mean())
                    row["recall_min_head"] = float(st.recall.min())
                rows.append(row)
            if progress is not None:
                r = rows[-1]
                progress(f"N={n} {r['method']}: {r['seconds'] * 1e3:.1f} ms, {r['speedup']:.2f}x SDPA ({t_ref * 1e3:.1f} ms)")
    exps: dict[str, float | None] = {}
    for label in dict.fromkeys(r["method"] for r in rows):
        sel = [r for r in rows if r["method"] == label]
        exps[label] = scaling_exponent([r["N"] for r in sel], [r["seconds"] for r in sel])
        if label.startswith("fna"):
            exps[label + " [fps]"] = scaling_exponent([r["N"] for r in sel], [r["fps_seconds"] for r in sel])
            exps[label + " [nystrom]"] = scaling_exponent([r["N"] for r in sel], [r["nystrom_seconds"] for r in sel])
    return {
        "rows": rows,
        "exponents": exps,
        "config": {
            "mode": "causal" if causal else "noncausal", "lengths": list(lengths), "batch": batch, "heads": heads,
            "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "device": str(dev),
            "repeats": repeats, "warmup": warmup, "reuse_layers": reuse_layers, "inputs": "captured" if qkv is not None else "random",
        },
    }


# ---------------------------------------------------------------------------------------------
# whole models


def bench_vision_model(
    model,
    processor,
    settings: Sequence[tuple[str, dict[str, Any]]],
    *,
    resolutions: Sequence[int] = (224, 448, 896),
    batch: int = 1,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    images=None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Images per second of a ViT, unpatched vs each setting, at several resolutions, in one run.

    For every resolution the unpatched model, ``dense`` routed through the patch (the cost of
    the patch machinery itself, and the share of time in attention) and each setting are timed
    back to back on the same batch.

    Args:
        model: a ViT the patch supports (``Dinov2Model``, timm ViT, ...), in eval mode.
        processor: its preprocessing (see :func:`attnpatch.evals.images.make_preprocess`).
        settings: ``(method, options)`` pairs, e.g. ``[("fna", {"s": 64})]``.
        resolutions: square input sizes in pixels.
        batch: images per forward call.
        repeats, warmup: timed and untimed forward calls per cell.
        device: where the model runs.
        images: a list of PIL images (default: the embedded image set).
        progress: called with a line of text per finished cell.

    Returns:
        ``{"rows": [...]}``; each row: ``resolution``, ``tokens``, ``setting``, ``seconds``
        (median per forward), ``images_per_s``, ``speedup`` (vs unpatched), ``attention_share``
        (fraction of the forward spent in the patched attention calls; ``None`` unpatched), and
        ``note`` where a setting approximated nothing (``s >= N``).

    Raises:
        OptionError: a resolution below the patch size, or a bad setting (also
        UnknownMethodError / UnsupportedModelError from :func:`attnpatch.patch`).
    """
    from ..patchers.core import patch, time_attention, unpatch
    from ..patchers.registry import get_method, validate_options
    from .images import load_image_set, make_preprocess

    for name, opts in settings:
        validate_options(get_method(name), opts)
    if images is None:
        data = load_image_set(None)
        images = [data[i][0] for i in range(len(data))]
    pics = [images[i % len(images)] for i in range(batch)]
    dev = torch.device(device)
    model = model.to(dev).eval()
    rows = []
    patch_size = _patch_size(model)
    small = [r for r in resolutions if r < patch_size]
    if small:
        raise OptionError(f"resolutions {small}: must be at least the patch size, {patch_size} pixels")
    for res in resolutions:
        x = make_preprocess(processor, res)(pics).to(dev)
        tokens = _vision_tokens(model, x)

        def fwd():
            with torch.inference_mode():
                return model(x)

        t_ref = statistics.median(time_call(fwd, repeats=repeats, warmup=warmup, device=dev))
        rows.append({"resolution": res, "tokens": tokens, "setting": "unpatched", "seconds": t_ref,
                     "images_per_s": batch / t_ref, "speedup": 1.0, "attention_share": None})
        for name, opts in [("dense", {})] + list(settings):
            patch(model, name, **opts)
            try:
                with time_attention(model) as rec:
                    ts = time_call(fwd, repeats=repeats, warmup=warmup, device=dev)
                att = rec.attention_seconds[warmup:]
            finally:
                unpatch(model)
            t = statistics.median(ts)
            share = statistics.median(a / b for a, b in zip(att, ts)) if att else None
            rows.append({"resolution": res, "tokens": tokens, "setting": _label(name, opts), "seconds": t,
                         "images_per_s": batch / t, "speedup": t_ref / t, "attention_share": share})
            if name in ("fna", "fna+sink_mask") and int(opts.get("s", 64)) >= tokens:
                rows[-1]["note"] = "exact: s >= N"
            if progress is not None:
                progress(f"{res} px (N={tokens}) {rows[-1]['setting']}: {batch / t:.2f} img/s, {t_ref / t:.2f}x")
    return {"rows": rows, "config": {"resolutions": list(resolutions), "batch": batch, "repeats": repeats,
                                     "warmup": warmup, "device": str(dev)}}


def _vision_tokens(model, x: torch.Tensor) -> int:
    """Tokens the attention layers see (patches + CLS + registers), read from one patched forward."""
    from ..patchers.core import patch, record_stats, unpatch

    seen: list[int] = []
    patch(model, "dense")
    try:
        with torch.inference_mode(), record_stats(model, probe=lambda ctx, q, k, v: seen.append(q.shape[2])):
            model(x[:1])
    finally:
        unpatch(model)
    return seen[0]


def _patch_size(model) -> int:
    cfg = getattr(model, "config", None)
    vcfg = getattr(cfg, "vision_config", None) or cfg
    p = getattr(vcfg, "patch_size", None) or getattr(getattr(model, "patch_embed", None), "patch_size", 1)
    return int(p[0] if isinstance(p, (tuple, list)) else p)


def prefill_ids(tokenizer, length: int) -> torch.Tensor:
    """``[1, length]`` token ids of natural prose (the public-domain essay text the RULER tasks use), cycled if short."""
    from .haystack import essay_sentences

    text = " ".join(essay_sentences())
    ids = tokenizer(text[: length * 8])["input_ids"]
    while len(ids) < length:
        ids = ids + ids
    return torch.tensor([ids[:length]])


def bench_causal_lm(
    model,
    tokenizer,
    settings: Sequence[tuple[str, dict[str, Any]]],
    *,
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    repeats: int = 1,
    warmup: int = 0,
    device: str = "cpu",
    include_dense: bool = True,
    stats: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Prefill latency of a causal LM, unpatched vs each setting, at several prompt lengths, in one run.

    One prefill = one forward over the whole prompt computing only the last position's
    logits (``logits_to_keep=1``, no cache kept), on natural prose (:func:`prefill_ids`).

    Args:
        model, tokenizer: a Hugging Face causal LM the patch supports.
        settings: ``(method, options)`` pairs.
        lengths: prompt lengths in tokens.
        repeats, warmup: timed and untimed prefills per cell.
        device: where the model runs.
        include_dense: also time ``dense`` routed through the patch (the machinery's own cost and
            the share of time in attention); off saves one prefill per length at long lengths.
        stats: run one more (untimed) prefill per patched setting to measure its sparsity.
        progress: called with a line of text per finished cell.

    Returns:
        ``{"rows": [...]}``; each row: ``length``, ``setting``, ``seconds`` (median prefill),
        ``tokens_per_s``, ``speedup`` (vs unpatched), ``attention_share``, and for
        ``anchor_attention`` the ``sparsity`` of that prefill.

    Raises:
        OptionError / UnknownMethodError: a bad setting (checked before any prefill);
        UnsupportedModelError from :func:`attnpatch.patch` for a method that does not fit the model.
    """
    from ..patchers.core import patch, record_stats, time_attention, unpatch
    from ..patchers.registry import get_method, validate_options

    for name, opts in settings:
        validate_options(get_method(name), opts)
    dev = torch.device(device)
    model = model.to(dev).eval()
    rows = []
    for n in lengths:
        ids = prefill_ids(tokenizer, n).to(dev)

        def fwd():
            with torch.inference_mode():
                return model(ids, use_cache=False, logits_to_keep=1)

        t_ref = statistics.median(time_call(fwd, repeats=repeats, warmup=warmup, device=dev))
        rows.append({"length": n, "setting": "unpatched", "seconds": t_ref, "tokens_per_s": n / t_ref, "speedup": 1.0})
        for name, opts in ([("dense", {})] if include_dense else []) + list(settings):
            patch(model, name, **opts)
            try:
                with time_attention(model) as rec:
                    ts = time_call(fwd, repeats=repeats, warmup=warmup, device=dev)
                att = rec.attention_seconds[warmup:]
                sparsity = None
                if name != "dense" and stats:
                    with record_stats(model) as st:
                        fwd()
                    recs = [r for r in st.forwards[0].values() if r.causal_pairs is not None]
                    causal = sum(float(r.causal_pairs.sum()) for r in recs)
                    kept = sum(float(r.kept_pairs.sum()) for r in recs)
                    sparsity = 1.0 - kept / causal if causal else None
            finally:
                unpatch(model)
            t = statistics.median(ts)
            rows.append({"length": n, "setting": _label(name, opts), "seconds": t, "tokens_per_s": n / t,
                         "speedup": t_ref / t, "attention_share": statistics.median(a / b for a, b in zip(att, ts)),
                         "sparsity": sparsity})
            if progress is not None:
                progress(f"{n} tokens {rows[-1]['setting']}: {t:.2f} s, {t_ref / t:.2f}x")
    return {"rows": rows, "config": {"lengths": list(lengths), "repeats": repeats, "warmup": warmup, "device": str(dev)}}


# ---------------------------------------------------------------------------------------------
# plots


def plot_attention(result: dict[str, Any], path: str | Path, title: str = "") -> list[Path]:
    """Two PNGs from :func:`bench_attention`'s result: time vs N (log-log) and speed-up over SDPA vs N.

    Returns the written paths (``<stem>_time.png``, ``<stem>_speedup.png``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    labels = list(dict.fromkeys(r["method"] for r in rows))
    exps = result.get("exponents", {})

    colour = {lab: f"C{i}" for i, lab in enumerate(labels)}  # one colour per method in both plots

    def save(fig, ax, ylabel: str, default_title: str, suffix: str) -> Path:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title or default_title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = path.with_name(path.stem + suffix)
        fig.savefig(p, dpi=110)
        plt.close(fig)
        return p

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for lab in labels:
        sel = [r for r in rows if r["method"] == lab]
        e = exps.get(lab)
        ax.plot([r["N"] for r in sel], [r["seconds"] for r in sel], "o-", color=colour[lab], label=f"{lab} (slope {e:.2f})" if e else lab)
        if lab.startswith("fna"):
            e2 = exps.get(lab + " [fps]")
            ax.plot([r["N"] for r in sel], [r["fps_seconds"] for r in sel], "x--", color=colour[lab], label=f"FPS alone (slope {e2:.2f})" if e2 else "FPS alone")
    ax.set_yscale("log")
    out = [save(fig, ax, "seconds (median)", "attention time vs N", "_time.png")]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for lab in labels:
        if lab != "sdpa":
            sel = [r for r in rows if r["method"] == lab]
            ax.plot([r["N"] for r in sel], [r["speedup"] for r in sel], "o-", color=colour[lab], label=lab)
    ax.axhline(1.0, color="k", lw=0.8)
    out.append(save(fig, ax, "speed-up over SDPA (x)", "speed-up vs N", "_speedup.png"))
    return out
