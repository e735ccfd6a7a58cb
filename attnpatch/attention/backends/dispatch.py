"""The one place that chooses a kernel: a capability table per operation, and the rule that reads it.

Every method's ``kernel`` option (``"auto"`` or a kernel's name) and every internal choice between a fused kernel
and a PyTorch path is answered here, by :func:`choose`: ``choose(op, kernel, call)`` returns the name of the kernel
that runs ``op`` on the tensors described by ``call`` (:class:`Call`: device, dtype, head size, lengths, padding).
The methods then run what it names; none of them looks at the device, the dtype or the option itself to pick one.
In the spirit of xformers' ``ops/fmha`` dispatch (each operator declares what it supports; one function picks).

The table (:data:`TABLE`) holds, per operation, its kernels in order of preference.  Each :class:`Kernel` declares:

* ``auto_on``: the device types where ``kernel="auto"`` may pick it (``"*"``: every device);
* ``devices``, ``dtypes`` and ``max_head_dim``: what it runs (``None``: anything); the Triton kernels also run CPU
  tensors under the Triton interpreter and inside a compile-only block (:mod:`.triton_support`);
* ``fits``: the rules that depend on the call (the pseudo-inverse kernel's ``s <= 64`` and float32 work, the
  compiled stripe attention's "no padding inside the keys", FlexAttention's inputs);
* ``prefer``: rules for ``"auto"`` only (the CPU FlexAttention minimum :data:`CPU_FLEX_MIN_KEYS`, a FlexAttention
  compile that failed earlier in this process);
* ``needs`` (cheap: Triton installed, the platform can build the C++ kernel) and ``ready`` (checked last, it may
  build: the compiled CPU kernel);
* ``fallback``: what a request by name that does not fit runs instead (``None``: it is refused).

``"auto"`` takes the first kernel of the operation that is auto on the call's device type and passes every check;
the last kernel of each operation is auto everywhere and checks nothing, so ``"auto"`` always runs.  A kernel asked for
by name runs where its checks pass (``prefer`` aside), else runs its ``fallback``, else raises :class:`KernelError`
with one text: ``kernel='NAME' <why>; allowed here: <the names that would run>``.  :func:`refusal` gives the same
text without raising (``patch()`` asks it before any forward).

Operations: ``fps`` (farthest-point sampling), ``pinv`` (the ``"rtol"`` pseudo-inverse of FNA's landmark kernel;
``pinv_newton`` and ``pinv_exact``, its other modes, have one kernel each),
``anchor_select`` and ``anchor_attend`` (AnchorAttention's stripe selection and attention over kept stripes),
``stripe_attend`` (that attention without the Triton path: XAttention's block attention), ``anchor_merge`` (the PyTorch path of that attention: one masked fused call, or a
flash-attention call per part merged by log-sum-exp where the CPU's kernel returns it), ``a_shape``,
``vertical_slash`` and ``block_topk`` (the block-sparse baselines: FlexAttention or the gather path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ...errors import OptionError
from . import cpu_kernel, flex, triton_support
from .triton_support import TRITON_DTYPES

__all__ = ["Call", "Kernel", "KernelError", "TABLE", "CPU_FLEX_MIN_KEYS", "choose", "refusal", "allowed", "kernels_of",
           "needs_warm_up", "masked_rows_are_zero"]


class KernelError(OptionError, RuntimeError):
    """A kernel asked for by name that cannot run these inputs here (device, dtype, shape, or not installed or built).

    Both an :class:`~attnpatch.errors.OptionError` (a ``ValueError``: the option's value does not fit) and a
    ``RuntimeError`` (the machine lacks what it needs)."""


@dataclass(frozen=True)
class Call:
    """What a kernel choice depends on.

    Attributes:
        device: where the tensors are; dtype: their dtype.
        head_dim: columns per head (``None``: not known).
        keys: causal keys of the call (``q_offset + Lq``; tokens), for length rules.
        side: ``s`` of the ``s x s`` matrices of a pseudo-inverse.
        work_dtype: the dtype a pseudo-inverse works in (float32 or float64).
        inner_padding: whether some key inside a sequence is padding.
        select_dtype: AnchorAttention's selection precision (``"float32"``, ``"bfloat16"``).
        requires_grad: whether the inputs need gradients with autograd on (FlexAttention's path is inference-only).
    """

    device: torch.device
    dtype: torch.dtype
    head_dim: int | None = None
    keys: int | None = None
    side: int | None = None
    work_dtype: torch.dtype | None = None
    inner_padding: bool = False
    select_dtype: str | None = None
    requires_grad: bool = False

    @classmethod
    def of(cls, x: torch.Tensor, **facts) -> "Call":
        """The call on tensor ``x`` (its device, dtype, last dimension as ``head_dim``, gradient need)."""
        return cls(x.device, x.dtype, head_dim=x.shape[-1] if x.dim() else None,
                   requires_grad=bool(x.requires_grad and torch.is_grad_enabled()), **facts)


Rule = Callable[[Call], "str | None"]


@dataclass(frozen=True)
class Kernel:
    """One kernel of an operation in :data:`TABLE` (module docstring for the fields)."""

    name: str
    auto_on: tuple[str, ...] = ("*",)
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    max_head_dim: int | None = None
    needs: Callable[[], "str | None"] | None = None
    fits: Rule | None = None
    prefer: Rule | None = None
    ready: Callable[[], "str | None"] | None = None
    fallback: str | None = None
    warm: bool = False  # a one-time build or JIT compile that patch() pays instead of the first timed call
    triton: bool = False  # runs CPU tensors under the Triton interpreter or inside a compile-only block too


#: ``kernel="auto"`` of the block-sparse baselines on the CPU: FlexAttention from this many keys (``q_offset + Lq``) on,
#: else the gather path; ``None``: never.  ``None`` because the gather path measured faster on the CPU at every length
#: tried, with about half the causal pairs kept (``benchmarks/flex_cpu.py``, side by side; the numbers:
#: docs/benchmarks/cpu.md).
#: On CUDA ``"auto"`` is always FlexAttention.
CPU_FLEX_MIN_KEYS: dict[str, int | None] = {"a_shape": None, "vertical_slash": None, "block_topk": None}

_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _names(dtypes) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


# the backends' state is read through their modules (``triton_support.TRITON_AVAILABLE``, ``cpu_kernel.stripe_kernel``)
# at each call, so that a test can stand in for a machine without Triton or without a compiler


def _triton_installed() -> str | None:
    return None if triton_support.TRITON_AVAILABLE else "needs Triton (pip install triton)"


def _compiled_supported() -> str | None:
    return cpu_kernel.kernel_supported()


def _compiled_built() -> str | None:
    return None if cpu_kernel.stripe_kernel() is not None else f"cannot run here: {cpu_kernel.kernel_status()}"


def _no_inner_padding(c: Call) -> str | None:
    return "does not take padding inside the keys" if c.inner_padding else None


def _pinv_kernel_fits(c: Call) -> str | None:
    if c.side is not None and c.side > 64:
        return f"takes s <= 64 landmarks (s x s register tiles), not s={c.side}"
    if c.work_dtype not in (None, torch.float32):
        return f"works in float32 (rtol >= 1e-2, no float64 input), not {c.work_dtype}"
    return None


def _select_float32(c: Call) -> str | None:
    return None if c.select_dtype in (None, "float32") else f"selects in float32, not {c.select_dtype}"


def _flex_fits(c: Call) -> str | None:
    if c.requires_grad:
        return "is inference-only (inputs require grad)"
    return flex.flex_unsupported(c.device, c.dtype)


def _flex_prefer(op: str) -> Rule:
    def rule(c: Call) -> str | None:
        broken = flex.flex_broken()
        if broken is not None:
            return f"failed to compile in this process ({broken})"
        if c.device.type == "cpu":
            floor = CPU_FLEX_MIN_KEYS[op]
            if floor is None or c.keys is None or c.keys < floor:
                return "the gather path is faster on the CPU at this length"
        return None

    return rule


def _lse_op() -> str | None:
    return None if _FLASH_LSE is not None else "needs PyTorch's CPU flash-attention kernel with log-sum-exp"


_TRITON = dict(auto_on=("cuda",), devices=("cuda",), needs=_triton_installed, warm=True, triton=True)
_COMPILED = dict(auto_on=("cpu",), devices=("cpu",), needs=_compiled_supported, ready=_compiled_built, warm=True)
#: attention over kept keys without the Triton path (AnchorAttention's compiled kernel, or PyTorch operations)
_STRIPE = [Kernel("compiled", dtypes=(torch.float32,), fits=_no_inner_padding, **_COMPILED), Kernel("torch")]


def _block_sparse(op: str) -> list[Kernel]:
    return [Kernel("flex", auto_on=("cuda", "cpu"), fits=_flex_fits, prefer=_flex_prefer(op)), Kernel("gather")]


#: Per operation, its kernels in order of preference (module docstring).
TABLE: dict[str, list[Kernel]] = {
    "fps": [Kernel("triton", **_TRITON), Kernel("compiled", **_COMPILED), Kernel("torch")],
    "pinv": [Kernel("triton", fits=_pinv_kernel_fits, **_TRITON), Kernel("products", auto_on=("cuda",)),
             Kernel("eigh")],
    # the other pseudo-inverse modes have one form each
    "pinv_newton": [Kernel("newton")],
    "pinv_exact": [Kernel("svd")],
    # AnchorAttention's Triton tiles are compiled and checked (registers, spills, shared memory) up to head dim 128
    "anchor_select": [Kernel("triton", dtypes=TRITON_DTYPES, max_head_dim=128, **_TRITON),
                      Kernel("compiled", fits=_select_float32, fallback="torch", **_COMPILED), Kernel("torch")],
    "anchor_attend": [Kernel("triton", dtypes=TRITON_DTYPES, max_head_dim=128, **_TRITON), *_STRIPE],
    "stripe_attend": _STRIPE,
    "anchor_merge": [Kernel("flash_lse", auto_on=("cpu",), devices=("cpu",),
                            dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16), needs=_lse_op,
                            fits=_no_inner_padding),
                     Kernel("masked")],
    "a_shape": _block_sparse("a_shape"),
    "vertical_slash": _block_sparse("vertical_slash"),
    # "gather" is the stripe attention over the kept blocks ("stripe_attend": "auto"); "compiled" and "torch" name its
    # two kernels, by name only
    "block_topk": _block_sparse("block_topk") + [replace(k, auto_on=()) for k in _STRIPE],
}

_DEVICE_TEXT = {"cuda": "CUDA", "cpu": "CPU"}


def kernels_of(op: str) -> list[str]:
    """The kernel names of ``op``, in order of preference (``"auto"`` not included).

    Raises:
        KeyError: an unknown operation.
    """
    return [k.name for k in TABLE[op]]


def _why_not(k: Kernel, c: Call, *, auto: bool) -> str | None:
    """Why kernel ``k`` cannot run ``c`` (``auto``: also its auto-only rules), or ``None``."""
    if k.needs is not None and (why := k.needs()) is not None:
        return why
    if k.dtypes is not None and c.dtype not in k.dtypes:
        return f"takes {_names(k.dtypes)} tensors, not {c.dtype}"
    kind = c.device.type
    if k.devices is not None and kind not in k.devices:
        if not (k.triton and kind == "cpu" and (triton_support.interpreted() or triton_support.compiling())):
            where = " or ".join(_DEVICE_TEXT.get(d, d) for d in k.devices)
            extra = (" (on CPU tensors only under the Triton interpreter, TRITON_INTERPRET=1 set before attnpatch is "
                     "imported)") if k.triton else ""
            return f"runs on {where} tensors{extra}, not {kind} tensors"
    if k.max_head_dim is not None and c.head_dim is not None and c.head_dim > k.max_head_dim:
        return f"takes head dims up to {k.max_head_dim}, not {c.head_dim}"
    if k.fits is not None and (why := k.fits(c)) is not None:
        return why
    if auto and k.prefer is not None and (why := k.prefer(c)) is not None:
        return why
    if k.ready is not None and (why := k.ready()) is not None:
        return why
    return None


def _kernel(op: str, kernel: str) -> Kernel | None:
    """The table entry named ``kernel`` (``None`` for ``"auto"``).

    Raises:
        OptionError: a name that is neither ``"auto"`` nor one of ``op``'s kernels.
    """
    if kernel == "auto":
        return None
    for k in TABLE[op]:
        if k.name == kernel:
            return k
    allowed_values = ", ".join(repr(n) for n in ["auto", *kernels_of(op)])
    raise OptionError(f"kernel={kernel!r}: allowed values are {allowed_values}")


def allowed(op: str, call: Call) -> list[str]:
    """The values of ``kernel`` that run ``op`` on ``call``: ``"auto"`` and every kernel whose checks pass (a kernel
    whose request falls back to another counts only where it fits)."""
    return ["auto"] + [k.name for k in TABLE[op] if _why_not(k, call, auto=False) is None]


def refusal(op: str, kernel: str, call: Call) -> str | None:
    """Why ``kernel`` cannot run ``op`` on ``call`` (one line: ``kernel='NAME' <why>; allowed here: ...``), or ``None``
    where it runs (or falls back to a kernel that does).

    Raises:
        OptionError: an unknown kernel name.
    """
    k = _kernel(op, kernel)
    if k is None or k.fallback is not None:
        return None
    why = _why_not(k, call, auto=False)
    if why is None:
        return None
    return f"kernel={kernel!r} {why}; allowed here: {', '.join(map(repr, allowed(op, call)))}"


def choose(op: str, kernel: str, call: Call) -> str:
    """The kernel that runs ``op`` on ``call`` when the method's option is ``kernel`` (module docstring).

    Args:
        op: a key of :data:`TABLE`.
        kernel: ``"auto"`` or one of the operation's kernel names.
        call: the inputs (:class:`Call`).

    Returns:
        A kernel name of ``op``.

    Raises:
        OptionError: an unknown kernel name (the message lists the allowed values).
        KernelError: a kernel asked for by name that cannot run ``call`` here and has no fallback.
    """
    k = _kernel(op, kernel)
    if k is None:
        for cand in TABLE[op]:
            if ("*" in cand.auto_on or call.device.type in cand.auto_on) and _why_not(cand, call, auto=True) is None:
                return cand.name
        return TABLE[op][-1].name  # unreachable: the last kernel of every operation runs anything
    why = _why_not(k, call, auto=False)
    if why is None:
        return k.name
    if k.fallback is not None:
        return k.fallback
    raise KernelError(f"kernel={kernel!r} {why}; allowed here: {', '.join(map(repr, allowed(op, call)))}")


def needs_warm_up(op: str, kernel: str, call: Call) -> bool:
    """Whether the kernel :func:`choose` picks pays a one-time build or JIT compile on its first call (the compiled
    CPU kernel, the Triton kernels), which ``patch()`` then pays instead of the first timed forward."""
    name = choose(op, kernel, call)
    return next(k for k in TABLE[op] if k.name == name).warm


def masked_rows_are_zero(device: torch.device) -> bool:
    """Whether the device's fused attention (``scaled_dot_product_attention`` with an additive mask) gives zeros for a
    query row whose every key is masked: the CPU kernel does; elsewhere such a row is NaN and the caller zeroes it."""
    return device.type == "cpu"
