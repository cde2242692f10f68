"""HuggingFace models built in configure_model(): transformers' own weight initialization, recorded like any other."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


class HuggingFaceInit:
    """While ``configure_model()`` is recorded, a transformers model initializes its weights as on a real device.

    transformers 5 skips a ``PreTrainedModel``'s weight initialization (``post_init()`` → ``init_weights()``) when
    its probe finds the meta device, leaving each layer's torch default: a GPT-2 with embeddings of std 1, not 0.02,
    and unscaled residual projections, silently another model. Here ``init_weights`` sees no meta device, so it runs
    at its usual point of construction (a change configure_model() makes afterwards still wins) by transformers' own
    rules (``_init_weights``, ``_is_hf_initialized``, tied weights), and the recorder notes its calls for the replay
    on each stage. transformers calls the torch.nn.init functions it saved at import, not the recorder's wrappers
    (some of them return at once on a meta tensor, unseen): those are wrapped too. (transformers 4 initialized on
    meta tensors, through their methods, which the recorder sees: there is nothing to patch.)

    transformers may be imported inside ``configure_model()``: :meth:`poll`, called on every recorded torch call
    while :attr:`pending`, patches once its ``PreTrainedModel`` exists, before any model of it is built.
    """

    def __init__(self, wrap: Wrap, wrapped: dict[int, Callable[..., Any]]) -> None:
        self._wrap = wrap
        # torch.nn.init's functions by the id of the recorder's wrapper on them: transformers imported inside
        # configure_model() saved the wrappers, which must not outlive the recording.
        self._wrapped = wrapped
        self._undo: list[tuple[Any, str, Any]] = []  # (dict or class, key, original), in patching order
        self.pending = True

    def poll(self) -> None:
        utils: Any = sys.modules.get("transformers.modeling_utils")
        model = getattr(utils, "PreTrainedModel", None)
        if model is None:  # not imported, or still being imported
            return
        self.pending = False
        saved: Any = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
        if isinstance(saved, dict):
            functions: dict[str, Callable[..., Any]] = saved
            for name, function in list(functions.items()):
                genuine = self._wrapped.get(id(function), function)
                self._undo.append((saved, name, genuine))
                saved[name] = self._wrap(genuine)
        probe = getattr(utils, "get_torch_context_manager_or_global_device", None)
        if probe is None or "init_weights" not in vars(model):
            return
        original = vars(model)["init_weights"]

        def init_weights(pretrained: Any, *args: Any, **kwargs: Any) -> Any:
            utils.get_torch_context_manager_or_global_device = lambda: None  # "no device context": initialize
            try:
                return original(pretrained, *args, **kwargs)
            finally:
                utils.get_torch_context_manager_or_global_device = probe

        self._undo.append((model, "init_weights", original))
        model.init_weights = init_weights

    def restore(self) -> None:
        for owner, key, original in reversed(self._undo):
            if isinstance(owner, dict):
                owner[key] = original
            else:
                setattr(owner, key, original)
        self._undo.clear()
