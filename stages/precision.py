"""Precision and activation memory for a stage's layers.

* `autocast`: the context a stage runs its forward (and the last stage its
  loss) under, for ``precision`` "fp32", "bf16" or "fp16".
* `LossScaler`: dynamic loss scaling for fp16 whose skip decision comes from
  the caller, so that every stage of a pipeline skips the same steps.
* `checkpoint_layer`: activation checkpointing of one layer, its parameter
  names and state_dict keys unchanged.
* `compile_module`: ``torch.compile`` in place, its state_dict keys unchanged.

Parameters stay fp32 under every precision: autocast casts per op (weights
included, cached for the duration of the outermost autocast context), so the
optimizer, gradients, gradient reduction and checkpoints see fp32 tensors. What
crosses a stage boundary under "bf16"/"fp16" is whatever dtype the last layer
produced (usually the low-precision one), and its gradient travels back in that
same dtype.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import structlog
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "PRECISIONS",
    "LossScaler",
    "Precision",
    "autocast",
    "checkpoint_layer",
    "compile_module",
]

log = structlog.get_logger("evtrain.stages.precision")

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

_AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The context to run a forward under for ``precision`` on ``device``.

    "fp32" is a no-op; "bf16" and "fp16" are ``torch.autocast(device.type,
    dtype=...)``: matmuls, linear layers and convolutions run in the low
    precision, reductions such as ``cross_entropy`` stay in fp32, and which op
    runs in which dtype is torch's per-device autocast policy. Backward must run
    outside the context (torch's rule for autocast): the backward ops take the
    dtypes of their forward ops.

    Relies on torch's CPU autocast supporting both ``torch.bfloat16`` and
    ``torch.float16`` (torch 2.13: a ``Linear``, ``conv2d`` or ``bmm`` under fp16
    autocast on CPU returns float16). fp16 on a CPU without native fp16
    arithmetic is emulated and several times slower than fp32; it exists on CPU
    so that the loss-scaling path runs the same as on a GPU.

    Raises ``ValueError`` for a precision outside `PRECISIONS` or a device type
    torch has no autocast for.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"torch has no autocast for {device.type} devices ({precision})")
    return torch.autocast(device.type, dtype=dtype)


def _float32(value: float) -> float:
    # torch.amp.GradScaler keeps its scale in a float32 tensor; rounding the
    # same way keeps non-power-of-two factors and the overflow guard identical.
    return array("f", [value])[0]


class LossScaler:
    """Dynamic loss scaling for fp16, with the skip decision made globally.

    The policy is torch.amp.GradScaler's, with its defaults: the loss is
    multiplied by `scale` before backward; a step whose gradients hold an inf
    or a NaN is skipped and the scale multiplied by ``backoff_factor``; after
    ``growth_interval`` consecutive clean steps the scale is multiplied by
    ``growth_factor`` (unless that overflows float32) and the count restarts.
    A skipped step resets the count of clean steps to zero.

    GradScaler itself is not used because its inf check is per process and per
    optimizer: ``scaler.step(optimizer)`` skips when *this* process's gradients
    overflowed. In a pipeline each stage holds different parameters, so one
    stage would step while another skipped, and the weights of the model would
    no longer belong to one step. Here the caller decides from a fact that is
    the same on every stage: the step's global gradient norm, gathered over all
    stages, is non-finite exactly when some gradient on some stage is (an
    overflow in a gradient that crossed a boundary in fp16 reaches the
    parameter gradients of the stages before it). Every stage then calls
    ``update`` with the same ``found_inf`` and so keeps the same scale, the
    same clean-step count and the same skipped steps.

    Use, at each step boundary on every stage::

        loss = loss_fn(output, target) * scaler.scale   # last stage, before backward
        ...
        scaler.unscale_(grads)            # before the norm, so clipping sees true values
        norm = global_grad_norm(grads)    # the same value on every stage
        if not scaler.update(found_inf=not math.isfinite(norm)):
            optimizer.step()

    ``unscale_`` keeps infs and NaNs as they are, so computing the norm after it
    loses nothing. A norm judges the sum of squares, not each element: it is
    non-finite also when finite gradients square past float32's range
    (about 1.8e19 per element), which GradScaler's element check would let
    through; after unscaling such gradients are a divergence anyway.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, not {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, not {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), not {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, not {growth_interval}")
        self._scale = _float32(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0
        self.skipped = 0
        """Steps skipped so far (kept across a resume by `state_dict`)."""

    @property
    def scale(self) -> float:
        """The factor the last stage multiplies its loss by before backward."""
        return self._scale

    @property
    def growth_tracker(self) -> int:
        """Consecutive clean steps since the scale last changed or a step was skipped."""
        return self._growth_tracker

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Multiply ``grads`` in place by ``1 / scale`` (infs and NaNs stay non-finite)."""
        if grads:
            torch._foreach_mul_(grads, 1.0 / self._scale)

    def update(self, found_inf: bool) -> bool:
        """Apply the step's outcome to the scale; True when the step must be skipped.

        ``found_inf`` must be the same on every stage (see the class docstring).
        """
        if found_inf:
            self._scale = _float32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
            self.skipped += 1
            log.debug("loss scale backed off", scale=self._scale, skipped=self.skipped)
            return True
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            grown = _float32(self._scale * self.growth_factor)
            if grown != float("inf"):
                self._scale = grown
            self._growth_tracker = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, under torch.amp.GradScaler's keys plus ``skipped``.

        Either scaler's state dict loads into the other (GradScaler ignores
        ``skipped``; a GradScaler state loads here with ``skipped`` 0).
        """
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the same scale, policy and clean-step count."""
        self._scale = _float32(float(state["scale"]))
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
        self.skipped = int(state.get("skipped", 0))


def _apply(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


class _Checkpointed:
    """A module's forward, run under non-reentrant activation checkpointing."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # torch stashes the RNG state only of devices holding a *positional*
        # tensor argument; keyword tensors (a dict boundary value) go in as one
        # positional dict so that dropout on a GPU replays the same mask.
        return checkpoint(_apply, self.forward, args, kwargs, use_reentrant=False)


def _is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _Checkpointed)


def checkpoint_layer(module: nn.Module) -> None:
    """Run ``module``'s forward under ``torch.utils.checkpoint`` from now on.

    Its activations are dropped after the forward and recomputed during
    backward (``use_reentrant=False``). What this relies on, from torch:

    * the RNG state (CPU, and the devices of the tensor arguments) is stashed at
      the forward and restored for the recompute, and the autocast state is
      replayed, so dropout masks and dtypes match: gradients are bitwise equal
      to those without checkpointing;
    * any arguments, positional or keyword, and any output pytree are allowed,
      and arguments need not require grad (an embedding receiving ids);
    * under ``torch.no_grad()`` the forward runs plainly, storing nothing.

    Only the instance's ``forward`` attribute changes: parameter names,
    state_dict keys and submodules stay as they were (torch's
    ``checkpoint_wrapper`` would insert a module and rename every key). Hooks
    registered on ``module`` itself run once, outside the checkpoint; hooks on
    its submodules run again during the recompute. A copy (``copy.deepcopy``) stays
    checkpointed and computes with its own parameters. Calling it again on the
    same module changes nothing. Checkpoint before `compile_module`, which
    checks the combination.
    """
    if _is_checkpointed(module):
        return
    module.forward = _Checkpointed(module.forward)


def _capturable(call: Callable[..., Any]) -> Callable[..., Any]:
    def frame(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return frame


def compile_module(module: nn.Module, options: bool | Mapping[str, Any]) -> nn.Module:
    """``module`` compiled per ``options``; the same object, compiled in place.

    ``False`` leaves it as it is, ``True`` compiles with torch.compile's
    defaults, a mapping passes its items as ``torch.compile`` keyword arguments
    (``{"backend": "aot_eager"}``, ``{"mode": "max-autotune"}``, ...). An unknown
    keyword raises ``TypeError`` here, before any forward. Compilation itself
    happens at the first forward, and again for an input shape torch cannot
    treat as dynamic.

    Compiled the way ``nn.Module.compile`` does it, through the module's own
    ``_compiled_call_impl``: the parameters, their names and the state_dict
    keys stay the original's, so checkpoints, tied parameters and optimizer
    state are unaffected (``torch.compile(module)`` would return a wrapper
    whose keys all gain an ``_orig_mod.`` prefix), and a ``copy.deepcopy`` is
    an uncompiled module. Unlike ``nn.Module.compile`` itself, the compiled
    function is a frame of ours: torch.compile skips frames in torch.nn's own
    files, so in torch 2.13 ``nn.Linear(...).compile()`` compiles nothing and
    ``nn.Sequential(...).compile()`` compiles each user-defined child on its
    own; here the whole module is one graph whatever its class.

    A layer checkpointed by `checkpoint_layer` is traced into the compiled graph
    as torch's checkpoint operator, which only backends built on AOTAutograd
    (the default "inductor", "aot_eager") recompute faithfully; under the
    "eager" backend a checkpointed dropout layer gets gradients that differ
    from an uncompiled run's (torch 2.13), so that combination is refused with
    ``ValueError``.
    """
    kwargs: dict[str, Any]
    if isinstance(options, bool):
        if not options:
            return module
        kwargs = {}
    else:
        kwargs = dict(options)
    if kwargs.get("backend") == "eager" and any(_is_checkpointed(m) for m in module.modules()):
        raise ValueError(
            "torch.compile's 'eager' backend does not recompute checkpointed layers "
            "faithfully; use backend 'aot_eager' with activation checkpointing"
        )
    module._compiled_call_impl = torch.compile(_capturable(module._call_impl), **kwargs)
    return module
