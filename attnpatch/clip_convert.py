"""open_clip -> Hugging Face: copy an open_clip ``CLIP`` into a ``transformers.CLIPModel`` with the same weights.

:func:`open_clip_to_hf` maps the weights (and builds a ``CLIPProcessor`` whose tokenizer,
:func:`hf_clip_tokenizer_from_open_clip`, comes from open_clip's own BPE vocabulary), so the two
implementations -- and attnpatch's two adapters -- can be compared on one model. Both are also
importable from :mod:`attnpatch.clip_models`.
"""

from __future__ import annotations

import torch

from .errors import UnsupportedModelError

__all__ = ["hf_clip_tokenizer_from_open_clip", "open_clip_to_hf"]


def hf_clip_tokenizer_from_open_clip(context_length: int = 77):
    """A Hugging Face ``CLIPTokenizer`` built from open_clip's bundled BPE vocabulary (no download).

    The vocabulary and merges are open_clip's ``bpe_simple_vocab_16e6.txt.gz`` (the OpenAI CLIP
    BPE), with the special tokens spelled as Hugging Face spells them (``<|startoftext|>`` = 49406,
    ``<|endoftext|>`` = 49407). Token ids equal open_clip's ``SimpleTokenizer`` ids for ordinary
    text (both lower-case and split with the same pattern; open_clip additionally runs ``ftfy``).

    Args:
        context_length: ``model_max_length`` of the tokenizer (tokens).

    Returns:
        ``transformers.CLIPTokenizer``.
    """
    from open_clip.tokenizer import SimpleTokenizer
    from transformers import CLIPTokenizer

    st = SimpleTokenizer()
    rename = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    vocab = {rename.get(k, k): v for k, v in st.encoder.items()}
    merges = [p for p, _ in sorted(st.bpe_ranks.items(), key=lambda kv: kv[1])]
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=context_length)


def _act_name(mod: torch.nn.Module) -> str:
    from open_clip.transformer import QuickGELU

    if isinstance(mod, QuickGELU):
        return "quick_gelu"
    if isinstance(mod, torch.nn.GELU) and getattr(mod, "approximate", "none") == "none":
        return "gelu"
    raise UnsupportedModelError(f"activation {type(mod).__name__}: only QuickGELU and exact GELU have a Hugging Face CLIP equivalent")


def open_clip_to_hf(model: torch.nn.Module):
    """Copy an open_clip ``CLIP`` (ViT image tower, standard text transformer) into a Hugging Face ``CLIPModel``.

    The mapping: ``visual.conv1`` -> ``vision_model.embeddings.patch_embedding``,
    ``class_embedding`` / ``positional_embedding`` -> the vision embeddings, ``ln_pre`` ->
    ``pre_layrnorm``, each ``resblocks[i]`` -> ``encoder.layers[i]`` (``attn.in_proj_*`` split into
    ``q/k/v_proj``, ``out_proj``, ``ln_1/ln_2`` -> ``layer_norm1/2``, ``mlp.c_fc/c_proj`` ->
    ``mlp.fc1/fc2``), ``ln_post`` -> ``post_layernorm``, ``proj`` -> ``visual_projection.weight``
    (transposed); the text tower likewise (``token_embedding``, ``positional_embedding``,
    ``ln_final`` -> ``final_layer_norm``, ``text_projection`` transposed); ``logit_scale``. The
    activation (QuickGELU or GELU) and the widths, depths and heads are read from the model.

    Args:
        model: an open_clip ``CLIP`` or ``CustomTextCLIP`` whose image tower is a plain
            ``VisionTransformer`` (class-token pooling, LayerNorm before the blocks, no attentional
            pooler) and whose text tower is open_clip's causal ``TextTransformer`` with argmax
            (end-of-text) pooling.

    Returns:
        ``(CLIPModel, CLIPProcessor)`` in eval mode, float32; the processor's tokenizer comes from
        :func:`hf_clip_tokenizer_from_open_clip` and its image processor mirrors open_clip's
        evaluation transform (shortest side to ``R`` bicubic, center crop ``R``, the model's mean/std).

    Raises:
        UnsupportedModelError: a tower that has no Hugging Face CLIP equivalent (the message says which part).
    """
    from open_clip import transformer as oct
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    visual = getattr(model, "visual", None)
    if not isinstance(visual, oct.VisionTransformer):
        raise UnsupportedModelError(f"open_clip_to_hf: the image tower is a {type(visual).__name__}, not a VisionTransformer")
    if visual.attn_pool is not None or visual.pool_type != "tok" or visual.final_ln_after_pool or isinstance(visual.ln_pre, torch.nn.Identity):
        raise UnsupportedModelError("open_clip_to_hf: the image tower pools differently from HF CLIP (attentional pool, avg pool, or no ln_pre)")
    text = getattr(model, "text", None) or model
    if isinstance(text, oct.TextTransformer):
        if text.cls_emb is not None or text.pool_type != "argmax":
            raise UnsupportedModelError("open_clip_to_hf: the text tower pools differently from HF CLIP (class token or non-argmax pooling)")
        tr, tok_emb, pos_emb, ln_final, tproj = text.transformer, text.token_embedding, text.positional_embedding, text.ln_final, text.text_projection
    elif hasattr(model, "token_embedding"):
        if getattr(model, "text_pool_type", "argmax") != "argmax":
            raise UnsupportedModelError("open_clip_to_hf: the text tower does not pool at the end-of-text token")
        tr, tok_emb, pos_emb, ln_final, tproj = model.transformer, model.token_embedding, model.positional_embedding, model.ln_final, model.text_projection
    else:
        raise UnsupportedModelError(f"open_clip_to_hf: the text tower is a {type(text).__name__}, not open_clip's TextTransformer")
    vblocks, tblocks = list(visual.transformer.resblocks), list(tr.resblocks)
    for blocks in (vblocks, tblocks):
        if not all(isinstance(b, oct.ResidualAttentionBlock) and isinstance(b.ls_1, torch.nn.Identity) for b in blocks):
            raise UnsupportedModelError("open_clip_to_hf: only plain ResidualAttentionBlocks (no LayerScale, no custom attention) map to HF CLIP")
    vw, tw = visual.transformer.width, tr.width
    patch = visual.patch_size[0] if isinstance(visual.patch_size, (tuple, list)) else visual.patch_size
    image_size = visual.image_size[0] if isinstance(visual.image_size, (tuple, list)) else visual.image_size
    if isinstance(tproj, torch.nn.Linear):
        if tproj.bias is not None:
            raise UnsupportedModelError("open_clip_to_hf: a text projection with bias has no HF CLIP equivalent")
        tproj_w = tproj.weight.detach()
    else:
        tproj_w = tproj.detach().t()
    vact, tact = _act_name(vblocks[0].mlp.gelu), _act_name(tblocks[0].mlp.gelu)
    if vact != tact:
        raise UnsupportedModelError(f"open_clip_to_hf: the towers use different activations ({vact}, {tact}); HF CLIP configs share one kind per tower")
    eps = float(vblocks[0].ln_1.eps)
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=tok_emb.num_embeddings, hidden_size=tw, intermediate_size=tblocks[0].mlp.c_fc.out_features,
            num_hidden_layers=len(tblocks), num_attention_heads=tblocks[0].attn.num_heads,
            max_position_embeddings=pos_emb.shape[0], hidden_act=tact, layer_norm_eps=eps,
            bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
        ),
        vision_config=dict(
            hidden_size=vw, intermediate_size=vblocks[0].mlp.c_fc.out_features, num_hidden_layers=len(vblocks),
            num_attention_heads=vblocks[0].attn.num_heads, image_size=int(image_size), patch_size=int(patch),
            hidden_act=vact, layer_norm_eps=eps,
        ),
        projection_dim=int(tproj_w.shape[0]),
        logit_scale_init_value=float(model.logit_scale.detach().reshape(-1)[0]) if hasattr(model, "logit_scale") else 2.6592,
    )
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten below
        hf = CLIPModel(cfg).eval()
    sd: dict[str, torch.Tensor] = {}

    def blocks_to(prefix: str, blocks) -> None:
        for i, b in enumerate(blocks):
            p = f"{prefix}.encoder.layers.{i}"
            wq, wk, wv = b.attn.in_proj_weight.detach().chunk(3)
            bq, bk, bv = b.attn.in_proj_bias.detach().chunk(3)
            sd.update({
                f"{p}.self_attn.q_proj.weight": wq, f"{p}.self_attn.k_proj.weight": wk, f"{p}.self_attn.v_proj.weight": wv,
                f"{p}.self_attn.q_proj.bias": bq, f"{p}.self_attn.k_proj.bias": bk, f"{p}.self_attn.v_proj.bias": bv,
                f"{p}.self_attn.out_proj.weight": b.attn.out_proj.weight.detach(), f"{p}.self_attn.out_proj.bias": b.attn.out_proj.bias.detach(),
                f"{p}.layer_norm1.weight": b.ln_1.weight.detach(), f"{p}.layer_norm1.bias": b.ln_1.bias.detach(),
                f"{p}.layer_norm2.weight": b.ln_2.weight.detach(), f"{p}.layer_norm2.bias": b.ln_2.bias.detach(),
                f"{p}.mlp.fc1.weight": b.mlp.c_fc.weight.detach(), f"{p}.mlp.fc1.bias": b.mlp.c_fc.bias.detach(),
                f"{p}.mlp.fc2.weight": b.mlp.c_proj.weight.detach(), f"{p}.mlp.fc2.bias": b.mlp.c_proj.bias.detach(),
            })

    sd.update({
        "vision_model.embeddings.patch_embedding.weight": visual.conv1.weight.detach(),
        "vision_model.embeddings.class_embedding": visual.class_embedding.detach(),
        "vision_model.embeddings.position_embedding.weight": visual.positional_embedding.detach(),
        "vision_model.pre_layrnorm.weight": visual.ln_pre.weight.detach(), "vision_model.pre_layrnorm.bias": visual.ln_pre.bias.detach(),
        "vision_model.post_layernorm.weight": visual.ln_post.weight.detach(), "vision_model.post_layernorm.bias": visual.ln_post.bias.detach(),
        "visual_projection.weight": visual.proj.detach().t(),
        "text_model.embeddings.token_embedding.weight": tok_emb.weight.detach(),
        "text_model.embeddings.position_embedding.weight": pos_emb.detach(),
        "text_model.final_layer_norm.weight": ln_final.weight.detach(), "text_model.final_layer_norm.bias": ln_final.bias.detach(),
        "text_projection.weight": tproj_w,
    })
    if hasattr(model, "logit_scale"):
        sd["logit_scale"] = model.logit_scale.detach().reshape(())
    blocks_to("vision_model", vblocks)
    blocks_to("text_model", tblocks)
    missing, unexpected = hf.load_state_dict({k: v.float().clone() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:  # pragma: no cover - a mapping bug
        raise UnsupportedModelError(f"open_clip_to_hf: missing {missing[:5]}, unexpected {unexpected[:5]}")
    pcfg = dict(getattr(visual, "preprocess_cfg", {}) or {})
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    ip = CLIPImageProcessor(
        size={"shortest_edge": int(image_size)}, crop_size={"height": int(image_size), "width": int(image_size)},
        image_mean=list(pcfg.get("mean", OPENAI_DATASET_MEAN)), image_std=list(pcfg.get("std", OPENAI_DATASET_STD)),
    )
    processor = CLIPProcessor(image_processor=ip, tokenizer=hf_clip_tokenizer_from_open_clip(pos_emb.shape[0]))
    return hf, processor
