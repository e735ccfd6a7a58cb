"""``tome``: ToMe token merging for ViTs (the math: :mod:`attnpatch.attention.merge`).

ToMe changes the token count, so it is more than an attention function: each routed block runs
``x = x + attention(x)`` (with proportional attention), then this method's block hook merges ``r``
tokens of the residual stream by bipartite soft matching on the block's keys, then the MLP branch
runs on the fewer tokens (ToMe, arXiv 2210.09461, Sec. 3).  The adapters provide the split of each
block between its two branches (:func:`attnpatch.patchers.runtime.wrap_blocks`) and refuse models
whose blocks or read-out they cannot handle.

Per forward, the state holds the current token sizes (``[B, N]``, input tokens per token), the source
map (``[B, N0]``, the current token each input token was merged into: ToMe's ``trace_source``, kept as
an index) and the keys of the current block (the merge metric); after the last block they are
:attr:`~attnpatch.patchers.state.ForwardState.token_sizes` and ``token_source`` (read them with
:func:`attnpatch.token_sizes` / :func:`attnpatch.token_source` after a forward: the sizes weight a mean
over the output tokens, the source map reads one output per input patch, as tomesd's unmerge does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.exact import repeat_kv
from ...attention.merge import apply_merge, merge_destinations, merge_plan, proportional_attention
from ...errors import OptionError
from ...options import at_layer, check_fields, opt, options_of
from ..bench_hook import BenchCase, BenchInputs
from ..contract import ExactLimit, Knob, Method, ModelGeometry
from ..registry import register_method
from ..state import LayerContext, LayerRecord

__all__ = ["ToMeConfig", "tome_forward", "tome_block", "tome_mode", "check_tome", "current_sizes", "TOME"]


@dataclass(frozen=True)
class ToMeConfig:
    """Options of ToMe token merging (arXiv 2210.09461, Sec. 3).

    Attributes:
        r: tokens merged away in each block (between its attention and its MLP branch); at most half
            of the block's non-prefix tokens are, so late blocks may merge fewer.  ``r = 0`` merges
            nothing: exact attention.  A per-block schedule (one entry per attention layer, e.g.
            ``"0*4/16*8"``) merges ``r[i]`` tokens in block ``i``.
        proportional: proportional attention (Eq. 1): add ``log(size)`` to each key's logit, so a
            merged token weighs as the tokens it stands for.
    """

    r: int | tuple[int, ...] = field(default=8, metadata=opt(
        "int_schedule", "tokens merged away per block, between its attention and MLP branch (tokens; 0 = exact), or "
        "one per block", low=0, rule="must be an integer >= 0 (tokens per block), or a list of them, one per block"))
    proportional: bool = field(default=True, metadata=opt(
        "bool", "proportional attention: add log(token size) to each key's logit (ToMe Eq. 1)"))

    def r_at(self, layer: int) -> int:
        """Tokens merged away in block ``layer`` (0-based)."""
        return at_layer(self.r, layer)

    @property
    def r_max(self) -> int:
        """The most tokens any block merges (``r`` itself without a schedule)."""
        return max(self.r) if isinstance(self.r, tuple) else self.r

    def __post_init__(self) -> None:
        check_fields(self)


def check_tome(cfg: ToMeConfig, geo: ModelGeometry) -> None:
    """A per-block ``r`` has one entry per attention layer.

    Raises:
        OptionError: a schedule of the wrong length.
    """
    if isinstance(cfg.r, tuple) and len(cfg.r) != geo.num_layers:
        raise OptionError(f"r={list(cfg.r)}: a per-block schedule needs one entry per attention layer; the model has "
                          f"{geo.num_layers}")


def current_sizes(cfg: ToMeConfig, k: torch.Tensor, ctx: LayerContext) -> torch.Tensor | None:
    """The sizes ``[B, N]`` of this block's tokens (``None``: none merged yet), keeping this block's merge metric
    (the keys ``k`` ``[B, Hkv, N, D]`` averaged over heads) when it merges; shared with ``tome+fna``."""
    n = k.shape[2]
    st = ctx.shared("tome")
    st.setdefault("n0", n)  # tokens at the first routed block of this forward
    size = st.get("size")
    if size is not None and size.shape[1] != n:  # a block called on its own, outside the merged stack
        size = None
    if cfg.r_at(ctx.layer) > 0:
        st["metric"] = k.mean(dim=1)  # ToMe: keys averaged over heads
    return size


def tome_mode(cfg: ToMeConfig, size: torch.Tensor | None, ctx: LayerContext) -> str:
    """The record mode of a ToMe block: ``"dense:r=0"`` where it merges nothing and no earlier block merged (the
    block is the model's own), else ``"tome"``."""
    return "dense:r=0" if size is None and cfg.r_at(ctx.layer) == 0 else "tome"


def tome_forward(cfg: ToMeConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """One block's attention under ToMe: proportional attention over the current (merged) tokens,
    and the block's keys averaged over heads kept as the merge metric for :func:`tome_block`."""
    b, h, n, _ = q.shape
    size = current_sizes(cfg, k, ctx)
    out = proportional_attention(q, repeat_kv(k, h), repeat_kv(v, h), size if cfg.proportional else None, scale=ctx.scale)
    rec = LayerRecord(ctx.layer, tome_mode(cfg, size, ctx), n, n)
    if ctx.record:
        n0 = int(ctx.shared("tome")["n0"])
        rec.causal_pairs = torch.full((b, h), float(n0 * n0), dtype=torch.float64)
        rec.kept_pairs = torch.full((b, h), float(n * n), dtype=torch.float64)
    return out, rec


def tome_block(cfg: ToMeConfig, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
    """The block hook: merge ``r`` tokens of the residual stream ``x`` ``[B, N, C]`` (after the
    attention branch) by bipartite soft matching on this block's keys; returns ``[B, N - r', C]``.

    It also keeps the source map (ToMe's ``trace_source`` as an index): ``[B, N0]``, the output token each
    input token of the forward was merged into, in the forward state's
    :attr:`~attnpatch.patchers.state.ForwardState.token_source`; this block's own step (``[B, N]``, or ``None``
    when it merged nothing) stays in the shared ``"dest"`` for a composed method."""
    st = ctx.shared("tome")
    metric = st.pop("metric", None)
    st["dest"] = None
    r = cfg.r_at(ctx.layer)
    if r <= 0 or metric is None or metric.shape[1] != x.shape[1]:
        return x
    n = x.shape[1]
    size = st.get("size")
    if size is None or size.shape[1] != n:
        size = torch.ones(x.shape[:2], dtype=torch.float32, device=x.device)
    plan = merge_plan(metric, r, ctx.prefix_tokens)
    if plan is None:
        return x
    x, size = apply_merge(x, size, plan, ctx.prefix_tokens)
    dest = merge_destinations(plan, n, ctx.prefix_tokens)
    source = st.get("source")
    # composed with the earlier merges of this forward; a block called on its own starts from its own tokens
    source = dest.gather(1, source) if source is not None and st.get("source_points_into") == n else dest
    st["size"], st["source"], st["source_points_into"], st["dest"] = size, source, x.shape[1], dest
    if ctx.state is not None:
        ctx.state.token_sizes = size
        ctx.state.token_source = source
    return x


def tome_bench(cfg: ToMeConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: BenchInputs) -> BenchCase:
    """One block's ToMe work at ``N`` tokens: proportional attention (sizes as after earlier merges)
    plus the bipartite matching and the size-weighted merge of ``r`` tokens of a ``[B, N, H * D]``
    residual stream.  The speed-up ToMe gives comes from the tokens later blocks no longer see, which
    one layer does not show: ``attnpatch bench model`` measures it end to end."""
    b, h, n, d = q.shape
    gen = torch.Generator().manual_seed(0)
    size = torch.randint(1, 4, (b, n), generator=gen).to(q.device, torch.float32)
    x = torch.randn(b, n, h * d, generator=gen).to(q.device, q.dtype)
    p = inputs.prefix_tokens

    def attend():
        return proportional_attention(q, repeat_kv(k, h), repeat_kv(v, h), size if cfg.proportional else None, scale=inputs.scale)

    def merge():
        plan = merge_plan(k.mean(dim=1), cfg.r_max, p)
        return x if plan is None else apply_merge(x, size, plan, p)[0]

    def call():
        return attend(), merge()

    return BenchCase(call=call, parts={"attention": attend, "merge": merge}, note=f"one block: attention + merge of r={cfg.r_max}")


def _config(options: dict[str, Any]) -> ToMeConfig:
    return ToMeConfig(**options)


def _no_merge(tokens: int) -> dict[str, Any]:
    return {"r": 0}


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"r": round((1.0 - t) * (n // 8))}


TOME = register_method(
    Method(
        name="tome",
        summary="ToMe token merging: r tokens merged per block by bipartite soft matching, proportional attention",
        source="ToMe, Bolya et al., arXiv 2210.09461, Sec. 3 (Eq. 1)",
        options=options_of(ToMeConfig),
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        check=check_tome,
        forward=tome_forward,
        block_hook=tome_block,
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        token_roles=frozenset({"prefix"}),
        exact_limit_decl=ExactLimit(_no_merge, text="r = 0"),
        token_map=True,
        bench_hook=tome_bench,
        knob=Knob("r, N/8 down to 0 tokens per block", _knob),
        small_settings={"vision": dict(r=4)},
        details=(
            "ToMe: in every block, between the attention and the MLP branch, the `r` most similar token pairs of a "
            "bipartite split (cosine similarity of the block's keys averaged over heads) are merged by a size-weighted "
            "mean; attention adds `log(size)` to each key's logit. CLS and register tokens are never merged. The model's "
            "output has fewer tokens: the class token reads out as before, and `attnpatch.token_sizes(model)` gives each "
            "output token's size for a weighted mean, and `attnpatch.token_source(model)` the output token each input patch "
            "was merged into (dense read-outs take every patch's value through it). Needs blocks the patch can split (timm `Block`, open_clip "
            "residual blocks, HF DINOv2 / ViT / CLIP vision layers) and a class-token read-out."
        ),
    )
)
