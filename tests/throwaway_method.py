"""The source text of a throwaway method file (exact attention with the logits times ``factor``), for the
tests that show a new method is one new file: they write it into a temporary package and discover it."""

_SOURCE = '''
"""A throwaway method: exact attention with the logits multiplied by ``factor`` (1.0 = exact), through SDPA."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnpatch.options import check_fields, opt, options_of
from attnpatch.patchers.contract import ExactLimit, Method
from attnpatch.patchers.registry import register_method
from attnpatch.patchers.state import LayerRecord


@dataclass(frozen=True)
class ScaledConfig:
    factor: float = field(default=1.0, metadata=opt("float", "multiplier of the attention logits", low=0.0, low_open=True))

    def __post_init__(self):
        check_fields(self)


def forward(cfg, q, k, v, ctx):
    lq, lk = q.shape[2], k.shape[2]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if ctx.causal:  # key j is visible to query i when j <= q_offset + i
        keep = torch.arange(lk, device=q.device)[None, :] <= ctx.q_offset + torch.arange(lq, device=q.device)[:, None]
    keep = keep[None, None]
    if ctx.key_valid is not None:  # padding keys hidden
        keep = keep & ctx.key_valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=ctx.scale * cfg.factor,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.nan_to_num(0.0), LayerRecord(ctx.layer, "scaled", lq, lk)  # rows with no visible key (padding queries): 0


def one(tokens):
    return {"factor": 1.0}


register_method(Method(
    name=__NAME__, summary="logits times factor, through SDPA (a test method)", source="a test",
    options=options_of(ScaledConfig), model_kinds=frozenset({"causal_lm", "vision"}),
    make_config=lambda o: ScaledConfig(**o), forward=forward, exact_limit_decl=ExactLimit(one, text="factor = 1"),
    small_settings={"causal_lm": {"factor": 0.5}, "vision": {"factor": 0.5}},
))
'''


def scaled_dense_source(name: str, **breakage: bool) -> str:
    """The text of a method file that registers the method ``name`` (model kinds: causal LMs and ViTs).

    ``breakage`` makes it wrong in one way, for tests that the checks catch it: ``bidirectional``
    (causal calls attend to later keys), ``ignore_padding`` (padding keys attended), ``layout``
    (returns ``[B, Lq, H, D]``), ``bad_calls`` (declares that it takes no causal calls).
    """
    src = _SOURCE.replace("__NAME__", repr(name))
    if breakage.pop("bidirectional", False):
        src = src.replace("    if ctx.causal:", "    if False:")
    if breakage.pop("ignore_padding", False):
        src = src.replace("    if ctx.key_valid is not None:", "    if False:")
    if breakage.pop("layout", False):
        src = src.replace("return out.nan_to_num(0.0), ", "return out.nan_to_num(0.0).transpose(1, 2), ")
    if breakage.pop("bad_calls", False):
        src = src.replace("forward=forward,", "forward=forward, causal_calls=False,")
    assert not breakage, breakage
    return src
