"""What a pipeline cannot run as written: code, weights or hooks of the nn.Sequential itself, nn.SyncBatchNorm."""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

__all__ = ["check_plain_sequential", "sync_batch_norm_error", "sync_batch_norms"]

# The hooks a module runs or applies to its state dict, by the table torch keeps them in.
_HOOKS = {
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
    "_state_dict_pre_hooks": "state-dict pre-hooks",
    "_state_dict_hooks": "state-dict hooks",
    "_load_state_dict_pre_hooks": "load-state-dict pre-hooks",
    "_load_state_dict_post_hooks": "load-state-dict post-hooks",
}


def _profiler_range(hook: Any) -> bool:
    """Lightning's ``PyTorchProfiler`` hooks on every module (``RegisterRecordFunction``): they only name a range of
    the trace, which the stages' own ranges replace, so dropping them on the container changes nothing computed."""
    while isinstance(hook, partial):
        hook = hook.func
    return type(getattr(hook, "__self__", None)).__name__ == "RegisterRecordFunction"


def _additions(module: nn.Sequential) -> list[str]:
    """What ``module`` has beyond its layers: a stage keeps only the layers, so all of it would be dropped."""
    cls, found = type(module), []
    for method in ("forward", "__call__"):
        if getattr(cls, method) is not getattr(nn.Sequential, method):
            owner = next(c for c in cls.__mro__ if method in vars(c))
            found.append(f"its own {method} ({owner.__qualname__}.{method})")
    for table, what in (("_parameters", "parameters"), ("_buffers", "buffers")):
        names = [k for k, v in getattr(module, table).items() if v is not None]
        if names:
            found.append(f"{what} set on it directly ({', '.join(names)})")
    counts = (
        (len([h for h in getattr(module, t, {}).values() if not _profiler_range(h)]), w) for t, w in _HOOKS.items()
    )
    hooks = [f"{n} {what}" for n, what in counts if n]
    if hooks:
        found.append(f"hooks registered on it ({', '.join(hooks)})")
    return found


def check_plain_sequential(module: nn.Sequential, where: str) -> None:
    """Refuse an ``nn.Sequential`` (or subclass) with anything but its layers: its own ``forward``, parameters or
    buffers set on it directly, hooks on it. ``where`` names it in the error (``GPipeStage(module)``). Subclasses
    that only build their layers in ``__init__`` (torchvision's regnet ``AnyStage``) pass."""
    found = _additions(module)
    if not found:
        return
    raise TypeError(
        f"{where} is a {type(module).__qualname__} (an nn.Sequential) with {'; '.join(found)}. A pipeline keeps only "
        "the layers of the nn.Sequential, each stage some of them, run one after the other; what the container "
        "itself adds would be dropped silently: its forward never run, its weights neither trained nor saved, its "
        "hooks never called. Move it into a layer of the nn.Sequential: a forward's extra step (`* self.scale`) "
        "and the weights it uses become a final layer (a `Scale` module appended to the layers); a forward pre-hook "
        "goes on the first layer, a forward hook on the last. A forward that only runs the layers in order: "
        "pipeline nn.Sequential(*its layers) instead"
    )


def sync_batch_norms(module: nn.Module) -> list[str]:
    """The ``nn.SyncBatchNorm`` layers in ``module`` (timm's ``SyncBatchNormAct`` included), as "name (Class)"."""
    return [
        f"{name or 'the module itself'} ({type(m).__qualname__})"
        for name, m in module.named_modules()
        if isinstance(m, nn.SyncBatchNorm)
    ]


def sync_batch_norm_error(layers: list[str], where: str, fix: str) -> str:
    """Why ``layers`` (see :func:`sync_batch_norms`) of ``where`` cannot run in a pipeline, and ``fix``."""
    shown = ", ".join(layers[:6]) + (f" and {len(layers) - 6} more" if len(layers) > 6 else "")
    return (
        f"{where} holds nn.SyncBatchNorm layers: {shown}. Their forward synchronizes batch statistics over their "
        "process_group, by default every process of the job: the other stages of the pipeline never make that "
        "call, so on GPUs it waits forever (on CPU SyncBatchNorm fails: it needs GPU input). Build them as plain "
        "BatchNorm (nn.BatchNorm2d, timm's BatchNormAct2d; no nn.SyncBatchNorm.convert_sync_batchnorm) and " + fix
    )
