"""The two read-outs of per-patch features: a linear probe and a training-free dense k-NN.

* **Linear probe** (DINOv2's linear segmentation protocol, arXiv 2304.07193, Sec. 7.4 "linear": a ``BNHead``,
  BatchNorm then a 1x1 convolution on the patch tokens of the last layer, or of the last 4 concatenated, its
  logits upsampled bilinearly to the label size).  Adapted to a CPU: the head trains on a bounded random
  sample of train patches (:class:`PatchSample`), each with the share of its label pixels in every class;
  with nearest upsampling inside a patch, the pixel cross-entropy that ignores void is this soft-label
  cross-entropy weighted by the patch's non-void pixels.  The BatchNorm statistics are the sample's; the training is
  a fixed number of AdamW steps, so it does not shrink with the sample.
  :func:`load_head` reads a released DINOv2 linear head instead (``decode_head.bn.*``, ``decode_head.conv_seg.*``).
* **Dense k-NN** (Hummingbird, Balazevic et al., arXiv 2306.01667, Sec. 3): a memory bank of train patch
  features and their labels (exact search by inner product of L2-normalised features); each val patch takes the
  softmax-weighted (temperature ``tau``) vote of its ``k`` nearest neighbours' labels.

Both give per-patch class scores ``[B, K, rows, cols]``; :func:`predict` upsamples them bilinearly to the
label size and takes the arg-max.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import DataError, OptionError
from .data import VOID

__all__ = ["SUBSAMPLES", "patch_label_shares", "PatchSample", "LinearHead", "train_linear_head", "check_head", "read_head", "load_head",
           "KnnBank", "predict"]

#: Label samples per patch side when a label map is read at patch resolution (``SUBSAMPLES**2`` per patch).
SUBSAMPLES = 8


def patch_label_shares(labels: np.ndarray, grid: tuple[int, int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's label shares: the label map ``[H, W]`` read at ``SUBSAMPLES`` x ``SUBSAMPLES`` points per patch
    of a ``rows x cols`` grid laid over the whole map (the image is resized to the model's square input).

    Returns:
        ``(shares [rows * cols, K] float32, valid [rows * cols] float32)``: per patch the share of its non-void
        samples in each class (zeros where every sample is void) and the share of its samples that are not void.
    """
    rows, cols = grid
    h, w = labels.shape
    ys = ((np.arange(rows * SUBSAMPLES) + 0.5) * h / (rows * SUBSAMPLES)).astype(np.int64)
    xs = ((np.arange(cols * SUBSAMPLES) + 0.5) * w / (cols * SUBSAMPLES)).astype(np.int64)
    sub = labels[np.ix_(ys, xs)].astype(np.int64).reshape(rows, SUBSAMPLES, cols, SUBSAMPLES).transpose(0, 2, 1, 3)
    sub = sub.reshape(rows * cols, SUBSAMPLES * SUBSAMPLES)
    valid = sub != VOID
    patch = np.repeat(np.arange(rows * cols), SUBSAMPLES * SUBSAMPLES).reshape(sub.shape)
    counts = np.bincount((patch * k + np.where(valid, sub, 0))[valid], minlength=rows * cols * k).reshape(rows * cols, k)
    n_valid = valid.sum(1)
    shares = counts / np.maximum(n_valid, 1)[:, None]
    return shares.astype(np.float32), (n_valid / sub.shape[1]).astype(np.float32)


class PatchSample:
    """A bounded random sample of train patches: features, label shares and non-void weights.

    The ``max_patches`` are spread evenly over the ``n_images`` train images (image ``i`` gives
    ``floor((i + 1) q) - floor(i q)`` of them, ``q = max_patches / n_images``, fewer where it has fewer patches that are
    not all void), drawn with a generator seeded by ``(seed, image index)``: a setting fitted on its own features samples
    the same patches as dense.  The sample lives in buffers allocated once at the first image (features in float16:
    ``max_patches * C * 2`` bytes), so nothing long-lived is allocated per image: many small arrays kept between each
    image's temporaries fragment the C heap, and the process's memory then grows with the number of train images.
    """

    def __init__(self, max_patches: int, n_images: int, k: int, seed: int = 0):
        self.k, self.seed = k, seed
        self.quota = max_patches / max(n_images, 1)
        self.max_patches = max_patches
        self._feats: np.ndarray | None = None
        self._shares = np.zeros((max_patches, k), np.float32)
        self._weights = np.zeros(max_patches, np.float32)
        self.count = 0

    def add(self, index: int, feats: torch.Tensor, labels: np.ndarray) -> None:
        """Add image ``index``'s patches: ``feats`` ``[rows, cols, C]``, ``labels`` its label map ``[H, W]``."""
        rows, cols, c = feats.shape
        shares, valid = patch_label_shares(labels, (rows, cols), self.k)
        cand = np.flatnonzero(valid > 0)
        share = math.floor((index + 1) * self.quota) - math.floor(index * self.quota)
        take = min(len(cand), share, self.max_patches - self.count)
        if take <= 0:
            return
        if self._feats is None:
            self._feats = np.zeros((self.max_patches, c), np.float16)
        rng = np.random.default_rng([self.seed, index])
        pick = np.sort(rng.choice(cand, size=take, replace=False))
        at = slice(self.count, self.count + take)
        self._feats[at] = feats.reshape(rows * cols, c)[torch.from_numpy(pick)].numpy()
        self._shares[at] = shares[pick]
        self._weights[at] = valid[pick]
        self.count += take

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(features [M, C] float32, shares [M, K], weights [M])``.

        Raises:
            DataError: no train patch had a non-void label.
        """
        if not self.count:
            raise DataError("no train patch has a label that is not void: nothing to fit a read-out on")
        m = self.count
        return self._feats[:m].astype(np.float32), self._shares[:m], self._weights[:m]


class _DecodeHead(torch.nn.Module):
    def __init__(self, channels: int, k: int):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(channels)
        self.conv_seg = torch.nn.Conv2d(channels, k, 1)


class LinearHead(torch.nn.Module):
    """DINOv2's ``BNHead`` as a module whose state dict uses its keys (``decode_head.bn.*``, ``decode_head.conv_seg.*``).

    ``forward(feats [B, rows, cols, C]) -> logits [B, K, rows, cols]`` (BatchNorm in eval mode, then the 1x1 convolution).
    """

    def __init__(self, channels: int, k: int):
        super().__init__()
        self.decode_head = _DecodeHead(channels, k)
        self.eval()

    @property
    def channels(self) -> int:
        return self.decode_head.conv_seg.in_channels

    @property
    def classes(self) -> int:
        return self.decode_head.conv_seg.out_channels

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = feats.permute(0, 3, 1, 2).float()
        return self.decode_head.conv_seg(self.decode_head.bn(x))


def train_linear_head(
    feats: np.ndarray, shares: np.ndarray, weights: np.ndarray, *, steps: int = 2000, batch_size: int = 1024,
    lr: float = 1e-3, weight_decay: float = 1e-4, seed: int = 0,
) -> tuple[LinearHead, dict]:
    """Fit a :class:`LinearHead` on a patch sample (AdamW, soft-label cross-entropy weighted by non-void share).

    The BatchNorm's running statistics are the sample's mean and variance (fixed); its affine parameters and the
    1x1 convolution are trained for a fixed number of ``steps`` (so the training does not shrink with the sample),
    on batches drawn in shuffled passes over the sample, with the step size decayed to zero on a cosine.

    Args:
        feats: ``[M, C]``; shares: ``[M, K]`` label shares per patch; weights: ``[M]`` non-void share per patch.
        steps, batch_size, lr, weight_decay, seed: the optimisation (AdamW steps, patches per step, peak step size,
            decay, shuffling seed).

    Returns:
        ``(head in eval mode, {"steps", "batch_size", "loss_first", "loss_last"})``: the losses are the mean
        weighted cross-entropy over the sample before and after training.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.from_numpy(feats)
    y = torch.from_numpy(shares)
    w = torch.from_numpy(weights)
    m, c = x.shape
    head = LinearHead(c, y.shape[1])
    bn = head.decode_head.bn
    with torch.no_grad():
        bn.running_mean.copy_(x.mean(0))
        bn.running_var.copy_(x.var(0, unbiased=False))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.nn.init.normal_(head.decode_head.conv_seg.weight, std=0.01)
        torch.nn.init.zeros_(head.decode_head.conv_seg.bias)

    def loss_of(idx):
        logits = head(x[idx][:, None, None, :])[:, :, 0, 0]
        loss = -(y[idx] * F.log_softmax(logits, dim=-1)).sum(-1)
        return (loss * w[idx]).sum() / w[idx].sum().clamp_min(1e-12)

    with torch.no_grad():
        first = float(loss_of(torch.arange(m)))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    bs = min(batch_size, m)
    order, at = torch.randperm(m, generator=gen), 0
    with torch.enable_grad():
        for _ in range(steps):
            if at + bs > m:
                order, at = torch.randperm(m, generator=gen), 0
            idx = order[at:at + bs]
            at += bs
            loss = loss_of(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    head.eval().requires_grad_(False)
    with torch.no_grad():
        last = float(loss_of(torch.arange(m)))
    return head, {"steps": steps, "batch_size": bs, "loss_first": first, "loss_last": last}


_HEAD_KEYS = ("decode_head.conv_seg.weight", "decode_head.conv_seg.bias", "decode_head.bn.weight", "decode_head.bn.bias",
              "decode_head.bn.running_mean", "decode_head.bn.running_var")


def check_head(sd, path: str) -> None:
    """Refuse a state dict that is not a DINOv2 linear head of consistent shapes (``conv_seg.weight`` ``[K, C, 1, 1]`` or
    ``[K, C]``, ``conv_seg.bias`` ``[K]``, every ``bn.*`` ``[C]``), in one line naming the file and the first bad key.

    Raises:
        DataError: a missing key or a shape that does not fit.
    """
    missing = [key for key in _HEAD_KEYS if not isinstance(sd, dict) or not isinstance(sd.get(key), torch.Tensor)]
    if missing:
        raise DataError(f"--head {path}: not a DINOv2 linear head; missing {', '.join(missing)}")
    wt = sd["decode_head.conv_seg.weight"]
    if wt.dim() not in (2, 4) or (wt.dim() == 4 and tuple(wt.shape[2:]) != (1, 1)):
        raise DataError(f"--head {path}: decode_head.conv_seg.weight has shape {tuple(wt.shape)}; expected [classes, channels, 1, 1]")
    k, c = wt.shape[:2]
    want = {"decode_head.conv_seg.bias": (k,), **{key: (c,) for key in _HEAD_KEYS[2:]}}
    for key, shape in want.items():
        if tuple(sd[key].shape) != shape:
            raise DataError(f"--head {path}: {key} has shape {tuple(sd[key].shape)}; the head's conv_seg ({k} classes, {c} channels) "
                            f"needs {list(shape)}")


def read_head(path: str | Path) -> dict:
    """The state dict of a DINOv2 linear head file, checked for its keys and shapes (:func:`check_head`); used to refuse a bad
    ``--head`` before the model loads.

    Raises:
        DataError: a missing or unreadable file, or not a DINOv2 linear head.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--head {path}: no such file")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle, zip and torch errors of a bad file
        raise DataError(f"--head {path}: not a file torch.load reads ({type(err).__name__}); expected a DINOv2 linear head "
                        "saved with torch.save (a state dict, or a checkpoint holding one under 'state_dict')") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    check_head(sd, str(path))
    return sd


def load_head(path: str | Path, channels: int, k: int) -> LinearHead:
    """A released DINOv2 linear segmentation head (``torch.load`` of a state dict, or of a checkpoint holding one
    under ``"state_dict"``) with keys ``decode_head.bn.*`` and ``decode_head.conv_seg.*``.

    Args:
        path: the file; channels: the feature channels it must take (``C`` times the layers read); k: the classes.

    Raises:
        DataError: a missing or unreadable file, missing keys, or a head of other channels or classes (the message
            gives both).
    """
    sd = read_head(path)
    wt = sd["decode_head.conv_seg.weight"]
    if wt.shape[1] != channels or wt.shape[0] != k:
        raise DataError(f"--head {path}: a head for {wt.shape[1]} channels and {wt.shape[0]} classes; the features have "
                        f"{channels} channels (--layers times the model's width) and the set has {k} classes")
    head = LinearHead(channels, k)
    own = {key: v for key, v in sd.items() if key.startswith("decode_head.bn.") or key.startswith("decode_head.conv_seg.")}
    own["decode_head.conv_seg.weight"] = wt.reshape(k, channels, 1, 1)
    own.setdefault("decode_head.bn.num_batches_tracked", torch.tensor(0))
    head.load_state_dict({key: v.float() if v.is_floating_point() else v for key, v in own.items()})
    return head.eval().requires_grad_(False)


class KnnBank:
    """Hummingbird's memory bank: L2-normalised train patch features, each with the arg-max class of its label shares;
    exact nearest neighbours by inner product (a matrix product and ``topk``, in chunks of queries: on this project's
    CPU it is several times faster than faiss's flat index at these sizes; see docs/benchmarks/segmentation.md).

    Args:
        feats: ``[M, C]``; shares: ``[M, K]`` (:class:`PatchSample`); k: neighbours; temperature: softmax temperature
            of the neighbours' cosine similarities.

    Raises:
        OptionError: ``k`` or ``temperature`` not positive.
    """

    #: query patches per matrix product (bounds the ``[chunk, M]`` similarity block: 256 x 100000 floats = 100 MB)
    CHUNK = 256

    def __init__(self, feats: np.ndarray, shares: np.ndarray, *, k: int = 30, temperature: float = 0.02):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise OptionError(f"k={k!r}: must be a positive int (neighbours)")
        if not temperature > 0:
            raise OptionError(f"temperature={temperature!r}: must be > 0")
        self.bank = F.normalize(torch.from_numpy(np.ascontiguousarray(feats, dtype=np.float32)), dim=-1)
        self.labels = torch.from_numpy(shares.argmax(1).astype(np.int64))
        self.classes = shares.shape[1]
        self.k, self.temperature = min(k, self.bank.shape[0]), float(temperature)

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        """Per-patch class scores ``[B, K, rows, cols]`` (vote shares) of ``feats`` ``[B, rows, cols, C]``."""
        b, rows, cols, c = feats.shape
        q = F.normalize(feats.reshape(-1, c).float(), dim=-1)
        votes = torch.zeros(q.shape[0], self.classes)
        for i in range(0, q.shape[0], self.CHUNK):
            sim, idx = (q[i:i + self.CHUNK] @ self.bank.T).topk(self.k, dim=-1)
            w = torch.softmax(sim / self.temperature, dim=-1)
            votes[i:i + self.CHUNK].scatter_add_(1, self.labels[idx], w)
        return votes.reshape(b, rows, cols, self.classes).permute(0, 3, 1, 2)


def predict(scores: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """Class map ``[H, W]`` int16 of one image's per-patch scores ``[K, rows, cols]``, upsampled bilinearly to ``size`` (H, W)."""
    up = F.interpolate(scores[None].float(), size=size, mode="bilinear", align_corners=False)[0]
    return up.argmax(0).numpy().astype(np.int16)
