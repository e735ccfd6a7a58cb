"""What the command modules share for running: ``--device``, the scale-out options (``--resume``, ``--dtype``,
``--device-map``, ``--max-memory``) and the loader keywords they make, the per-process log, and the kept batches
(``--resume``) of a data-parallel image eval."""

from __future__ import annotations

from typing import Any

from ..errors import AttnpatchError
from .output import json_path

__all__ = ["DTYPES", "resolve_device", "scale_out_args", "rank_log", "open_store", "other_process_exit", "load_kwargs"]

#: ``--dtype`` choices.
DTYPES = ("float32", "bfloat16", "float16")


def resolve_device(name: str) -> str:
    """``--device``: ``auto`` resolved (cuda if available, else cpu), and a clear error for a device this
    machine cannot use (allowed: cpu, cuda, cuda:N)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise AttnpatchError(f"--device {name!r}: not a device name (allowed: auto, cpu, cuda, cuda:N)") from None
    if dev.type == "cpu":
        return name
    if dev.type != "cuda":
        raise AttnpatchError(f"--device {name!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise AttnpatchError(f"--device {name!r}: CUDA is not available on this machine (allowed here: cpu)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise AttnpatchError(f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def scale_out_args(q, *, device: bool = True, big: bool = True) -> None:
    """The options of every eval for long and big runs: ``--resume``, and with ``big`` (transformers models)
    ``--dtype``, ``--device-map``, ``--max-memory`` (and ``--device`` where the command has none yet).
    Data-parallel runs need no option: launched by ``torchrun`` or ``accelerate launch``, each process takes its share."""
    q.add_argument("--resume", action="store_true", help="continue a run that stopped: its finished cells or batches are read "
                   "back (from --json, or the <json>.parts folder of an image eval) and the run goes on with the same inputs")
    if not big:
        return
    if device:
        q.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto = cuda if available; "
                       "under a multi-process launch cuda:<local rank>)")
    q.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: %(default)s)")
    q.add_argument("--device-map", choices=["auto", "balanced", "sequential"],
                   help="spread a model that does not fit one device over the GPUs, CPU memory and disk (accelerate's "
                   "big-model loading; each attention module runs where its weights are); not with several processes")
    q.add_argument("--max-memory", metavar="DEVICE=SIZE,...", help="with --device-map: memory per device, e.g. 0=20GiB,1=20GiB,cpu=64GiB")


def rank_log(ranks):
    """The one-line log of this process: stderr on process 0, nothing on the others (process 0 says it)."""
    from ..log import log_stderr

    return log_stderr if ranks.main else (lambda line: None)


def open_store(args, ranks, n_images: int, settings, **extra):
    """The kept batches of an image eval (``<json>.parts``, ``--resume``); its run identity is the eval, model, data,
    image count, resolution, batch size, the settings after validation (written otherwise, the same run) and ``extra``.

    Raises:
        AttnpatchError: ``--resume`` of a folder another run wrote (the differing field named).
    """
    from ..evals.run.resume import BatchStore, same_path
    from ..log import log_stderr
    from ..patchers.registry import get_method, validate_options

    key = dict(
        eval=args.eval, model=same_path(args.model), data=same_path(args.data) or "default", n_images=n_images,
        resolution=args.resolution, batch_size=args.batch_size,
        settings=[(m, validate_options(get_method(m), dict(o))) for m, o in settings], **extra,
    )
    return BatchStore(json_path(args) + ".parts", key, ranks=ranks, resume=args.resume, log=log_stderr)


def other_process_exit(store, stop) -> int:
    """The exit of a process other than 0 after an image eval: process 0 reports; when the run finished, wait for it to
    be done with the kept batches (:meth:`~attnpatch.evals.run.resume.BatchStore.remove`)."""
    if stop is None:
        store.remove()
    return 130 if stop is not None else 0


def _max_memory(text: str | None) -> dict | None:
    """``"0=20GiB,cpu=64GiB"`` -> ``{0: "20GiB", "cpu": "64GiB"}`` (accelerate's ``max_memory``)."""
    if not text:
        return None
    import torch
    from accelerate.utils import convert_file_size_to_int

    out: dict = {}
    for part in text.split(","):
        dev, sep, size = part.partition("=")
        dev, size = dev.strip(), size.strip()
        if not sep or not dev or not size:
            raise AttnpatchError(f"--max-memory {text!r}: expected DEVICE=SIZE,... (e.g. 0=20GiB,cpu=64GiB; devices: GPU index, cpu, disk)")
        if not (dev.isdigit() or dev in ("cpu", "disk")):
            raise AttnpatchError(f"--max-memory: device {dev!r} is not a GPU index, cpu or disk")
        key = int(dev) if dev.isdigit() else dev
        if key in out:
            raise AttnpatchError(f"--max-memory: device {dev} is given twice ({out[key]} and {size}); give each device once")
        if isinstance(key, int) and key >= torch.cuda.device_count():
            raise AttnpatchError(f"--max-memory: GPU {key} does not exist on this machine ({torch.cuda.device_count()} CUDA device(s))")
        value = int(size) if size.isdigit() else size  # bytes, or a size with its unit
        try:
            if convert_file_size_to_int(value) <= 0:
                raise ValueError
        except (ValueError, TypeError):
            raise AttnpatchError(f"--max-memory: size {size!r} of {dev} is not a positive size (e.g. 512MB, 20GiB, or bytes: 1000000)") from None
        out[key] = value
    return out


def load_kwargs(args, ranks) -> dict[str, Any]:
    """The loader keywords (``dtype``, ``device``, ``device_map``, ``max_memory``) of ``args``, checked before loading.

    Raises:
        AttnpatchError: ``--max-memory`` without ``--device-map`` or malformed; ``--device-map`` in a
            multi-process run (each process would spread its model over every device).
    """
    import torch

    if args.max_memory and not args.device_map:
        raise AttnpatchError("--max-memory applies with --device-map only (e.g. --device-map auto --max-memory 0=20GiB,cpu=64GiB)")
    if args.device_map and ranks.distributed:
        exc = AttnpatchError(
            f"--device-map {args.device_map} with {ranks.world_size} processes: each process would spread its model over "
            "every device; run one process with --device-map, or several without it (one device each)"
        )
        exc.quiet = not ranks.main  # every process finds it: process 0 says it
        raise exc
    out: dict[str, Any] = {"dtype": getattr(torch, args.dtype)}
    if args.device_map:
        out.update(device_map=args.device_map, max_memory=_max_memory(args.max_memory))
    else:
        out["device"] = ranks.device(resolve_device(getattr(args, "device", "cpu")))
    return out
