"""``torch.export`` programs and AOTInductor packages of the model's steps, and their loader.

Build side (needs the model)::

    from dsv4_compile.export import build_package
    build_package(model, "pkg/", max_tokens=1024)      # pkg/prefill.pt2, decode.pt2, weights.pt

Run side (needs only ``dsv4_compile``: no model code, no re-tracing)::

    import dsv4_compile                                 # registers the dsv4 ops the packages call
    from dsv4_compile.export import load_package
    model = load_package("pkg/")                        # model(**step_inputs, mode="decode") -> logits

:func:`export_step` exports one step of :class:`~dsv4_compile.models.DeepseekV4Model` (``mode``
``"prefill"`` or ``"decode"``, a static choice) with dynamic token and request counts; the
``dsv4`` ops stay in the program as themselves and the model's state buffers (caches, compressor
states, indexer keys) are buffers it mutates in place. :func:`build_package` compiles both steps
with AOTInductor into two ``.pt2`` files of code (no tensors in them) whose metadata
(``dsv4.step``) records the state buffers, the dynamic ranges and the ops called, next to one
``weights.pt``. :func:`load_package` loads them with ``torch._inductor.aoti_load_package``, loads
the weights once, allocates the state buffers once, and hands the same tensors to both packages
(``load_constants(..., user_managed=True)``), so a prefill's caches are what the next decode
reads; :class:`PackagedModel` checks the step inputs before running a package.

The packages call the ``dsv4`` ops through the dispatcher at run time: ``import dsv4_compile``
must precede loading (else ``Could not find schema for dsv4::...``), and the provider serving each
op is resolved on the machine that runs the package, as in eager use (``use_provider``,
``DSV4_COMPILE_PROVIDER`` and checked mode apply), and an op's error reaches the caller. That
holds from torch 2.13: before it, AOTInductor logs an exception raised by a custom op inside a
package and runs on, so building and loading packages need torch >= 2.13
(:func:`packages_supported`); ``torch.export`` itself works on every torch the package accepts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from . import checks
from .generation import StepLimits

MODES = ("prefill", "decode")
#: the step's inputs, in order (:mod:`dsv4_compile.generation`); token-indexed ones first
STEP_INPUTS = ("input_ids", "positions", "batch_index", "seq_lens", "req_slots")
TOKEN_INPUTS = STEP_INPUTS[:3]
#: the package metadata key holding the step's description (JSON)
METADATA_KEY = "dsv4.step"
#: the file holding the weights and constant buffers both packages use
WEIGHTS_FILE = "weights.pt"
#: the oldest torch whose packages pass a custom op's exception to the caller (:func:`packages_supported`)
MIN_TORCH = "2.13"


class Step(torch.nn.Module):
    """One step of ``model`` in a fixed ``mode``, with the step inputs as positional arguments
    (the module :func:`export_step` exports)."""

    def __init__(self, model: torch.nn.Module, mode: str):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.mode = model, mode

    def forward(self, input_ids, positions, batch_index, seq_lens, req_slots) -> torch.Tensor:
        return self.model(input_ids, positions, batch_index, seq_lens, req_slots, mode=self.mode)


def dynamic_shapes(max_tokens: int, max_requests: int) -> dict[str, dict[int, Any]]:
    """``torch.export`` dynamic shapes of the step inputs: tokens ``T`` in ``[1, max_tokens]``,
    requests ``B`` in ``[1, max_requests]``, independent (a decode step may extend)."""
    tokens = torch.export.Dim("tokens", min=1, max=max_tokens)
    requests = torch.export.Dim("requests", min=1, max=max_requests)
    return {name: {0: tokens if name in TOKEN_INPUTS else requests} for name in STEP_INPUTS}


def example_inputs(mode: str, device) -> dict[str, torch.Tensor]:
    """Step inputs to trace ``mode`` with: two requests, more tokens than requests (so tokens and
    requests are not traced as one size)."""
    from .generation import step_inputs

    if mode == "prefill":
        return step_inputs([[1, 2, 3], [4, 5, 6, 7, 8]], [0, 0], device)
    return step_inputs([[1, 2], [3, 4, 5]], [4, 6], device)  # decode mode, extending two requests


def export_step(model, mode: str, *, max_tokens: int | None = None) -> torch.export.ExportedProgram:
    """``torch.export`` one step of a :class:`~dsv4_compile.models.DeepseekV4Model`, tokens per
    step up to ``max_tokens`` (default: the cache's ``max_requests * max_seq_len``)."""
    from .models.metadata import counts_apart

    cache = model.cache
    max_tokens = max_tokens or cache.max_requests * cache.max_seq_len
    example = example_inputs(mode, next(model.parameters()).device)
    need = dict(max_tokens=(max_tokens, example["input_ids"].shape[0]),
                max_requests=(cache.max_requests, example["seq_lens"].shape[0]),
                max_seq_len=(cache.max_seq_len, int(example["seq_lens"].max())))
    for name, (value, least) in need.items():  # what the example inputs of the trace need
        if value < least:
            raise ValueError(f"{name} must be >= {least} to export a {mode} step, got {value}")
    with torch.no_grad(), counts_apart():
        return torch.export.export(
            Step(model, mode), (), example, dynamic_shapes=dynamic_shapes(max_tokens, cache.max_requests),
        )


def dsv4_ops(program: torch.export.ExportedProgram) -> list[str]:
    """The ``dsv4`` ops a program calls (``dsv4::name``), sorted."""
    return sorted({
        node.target.name() for node in program.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "dsv4"
    })


def describe(model, mode: str, program: torch.export.ExportedProgram, max_tokens: int) -> dict:
    """The ``dsv4.step`` metadata of a step's package: everything :func:`load_package` needs."""
    from . import __version__

    cache = model.cache
    return {
        "mode": mode,
        "device": next(model.parameters()).device.type,
        "max_tokens": max_tokens,
        "max_requests": cache.max_requests,
        "max_seq_len": cache.max_seq_len,
        "vocab_size": model.config.vocab_size,
        "kv_formats": cache.cache_formats(),
        "states": {  # by their names in the program (the Step wrapper's)
            f"model.{name}": {"shape": list(buf.shape), "dtype": str(buf.dtype).removeprefix("torch.")}
            for name, buf in sorted(model.state_buffers().items())
        },
        "ops": dsv4_ops(program),
        "torch": torch.__version__,
        "dsv4_compile": __version__,
    }


def packages_supported() -> bool:
    """Whether this torch runs packages safely: from 2.13 an exception a ``dsv4`` op raises inside
    a package reaches the caller; before, AOTInductor logs it and the package runs on."""
    return torch.torch_version.TorchVersion(torch.__version__) >= MIN_TORCH


def require_package_support() -> None:
    if not packages_supported():
        raise RuntimeError(
            f"AOTInductor packages of dsv4 steps need torch >= {MIN_TORCH} (found {torch.__version__}): "
            "before it, an error a dsv4 op raises inside a package (a rejected input, a forced "
            "provider that cannot serve) is logged and ignored, and the step runs on with outputs "
            "the op never wrote"
        )


def build_package(model, directory: str | os.PathLike, *, max_tokens: int | None = None) -> dict[str, str]:
    """Export both steps of ``model`` and compile each into ``directory/{mode}.pt2`` with
    AOTInductor (for the model's device), and save the weights and constant buffers once, to
    ``directory/weights.pt``; returns the paths by name. The packages hold code only (AOTInductor's
    ``package_constants_in_so=False``): the loader gives both the same weights and the same state
    buffers, which it allocates (they are not saved). Needs torch >= 2.13
    (:func:`packages_supported`)."""
    require_package_support()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cache = model.cache
    max_tokens = max_tokens or cache.max_requests * cache.max_seq_len
    paths, weights = {}, {}
    for mode in MODES:
        program = export_step(model, mode, max_tokens=max_tokens)
        meta = describe(model, mode, program, max_tokens)
        weights.update({name: t for name, t in (*program.state_dict.items(), *program.constants.items())
                        if name not in meta["states"]})
        paths[mode] = torch._inductor.aoti_compile_and_package(
            program, package_path=str(directory / f"{mode}.pt2"),
            inductor_configs={
                "aot_inductor.metadata": {METADATA_KEY: json.dumps(meta)},
                "aot_inductor.package_constants_in_so": False,
            },
        )
    paths["weights"] = str(directory / WEIGHTS_FILE)
    torch.save({name: t.detach() for name, t in weights.items()}, paths["weights"])
    return paths


class PackagedModel:
    """The two step packages of a directory, sharing one copy of the weights and one set of state
    buffers.

    ``model(input_ids, positions, batch_index, seq_lens, req_slots, mode="decode")`` runs the
    mode's package and returns the float32 logits ``[B, vocab]``, like the model it was built
    from (so :func:`dsv4_compile.generation.generate` drives it). ``states`` holds the state
    buffers by name; :meth:`reset` zeroes them.
    """

    def __init__(self, directory: str | os.PathLike, device_index: int = -1):
        require_package_support()
        directory = Path(directory)
        self.packages, self.meta = {}, {}
        for mode in MODES:
            path = directory / f"{mode}.pt2"
            if not path.is_file():
                raise FileNotFoundError(f"{path}: not a package of build_package (prefill.pt2 and decode.pt2)")
            self.packages[mode] = torch._inductor.aoti_load_package(str(path), device_index=device_index)
            raw = self.packages[mode].get_metadata().get(METADATA_KEY)
            if raw is None:
                raise ValueError(f"{path}: no {METADATA_KEY} metadata (not built by dsv4_compile.export.build_package)")
            self.meta[mode] = json.loads(raw)
        prefill, decode = self.meta["prefill"], self.meta["decode"]
        shared = ("device", "max_tokens", "max_requests", "max_seq_len", "vocab_size", "kv_formats", "states")
        differ = [k for k in shared if prefill[k] != decode[k]]
        if differ:
            raise ValueError(f"{directory}: prefill.pt2 and decode.pt2 were built from different models ({differ} differ)")
        device_type = decode["device"]
        if device_type != "cpu":  # the device's index, as the step inputs' ``device`` reports it
            index = device_index if device_index >= 0 else torch.get_device_module(device_type).current_device()
            self.device = torch.device(device_type, index)
        else:
            self.device = torch.device("cpu")
        device = self.device
        self.max_tokens, self.max_requests = decode["max_tokens"], decode["max_requests"]
        self.max_seq_len, self.vocab_size = decode["max_seq_len"], decode["vocab_size"]
        #: what :mod:`dsv4_compile.generation` checks before each step it builds (the model's build
        #: held max_seq_len within max_position_embeddings)
        self.step_limits = StepLimits(self.vocab_size, self.max_seq_len, self.max_seq_len, self.max_requests)
        self.states = {
            name: torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
            for name, spec in decode["states"].items()
        }
        weights_path = directory / WEIGHTS_FILE
        if not weights_path.is_file():
            raise FileNotFoundError(f"{weights_path}: the packages' weights (written by build_package) are missing")
        self.weights = torch.load(weights_path, map_location=device, weights_only=True)
        constants = {**self.weights, **self.states}
        for mode, package in self.packages.items():  # both use these very tensors: no copies
            missing = sorted(set(package.get_constant_fqns()) - set(constants))
            if missing:
                raise ValueError(f"{weights_path}: no tensors for {missing[:5]} of {mode}.pt2 (built from another model?)")
            package.load_constants(
                {name: constants[name] for name in package.get_constant_fqns()},
                check_full_update=True, user_managed=True,
            )

    @torch.no_grad()
    def reset(self) -> None:
        """Zero every state buffer in place (both packages keep reading them)."""
        for buf in self.states.values():
            buf.zero_()

    def check(self, inputs: dict[str, torch.Tensor], mode: str) -> tuple[int, int]:
        """Checks the step inputs (raises ``ValueError`` naming the argument); returns ``(T, B)``.
        Their values too (:meth:`_check_values`) on CPU, and in checked mode
        (``dsv4_compile.checked()``, a device sync) elsewhere."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for name in STEP_INPUTS:
            t = inputs[name]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.device != self.device:
                got = (f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"
                       if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"{name} must be a 1-D int64 tensor on {self.device}, got {got}")
        tokens, requests = inputs["input_ids"].shape[0], inputs["seq_lens"].shape[0]
        for name in STEP_INPUTS:
            want = tokens if name in TOKEN_INPUTS else requests
            if inputs[name].shape[0] != want:
                what = "input_ids' tokens" if name in TOKEN_INPUTS else "seq_lens' requests"
                raise ValueError(f"{name} must have {want} entries ({what}), got {inputs[name].shape[0]}")
        if requests and not 1 <= tokens <= self.max_tokens:
            raise ValueError(f"input_ids must have 1..{self.max_tokens} tokens (the package's range), got {tokens}")
        if requests > self.max_requests:
            raise ValueError(f"seq_lens must have at most {self.max_requests} requests (the package's range), got {requests}")
        if requests and (self.device.type == "cpu" or checks.checked_mode()):
            self._check_values(inputs)
        return tokens, requests

    def _check_values(self, inputs: dict[str, torch.Tensor]) -> None:
        """The data checks: values that would index outside the package's tables. Always on CPU
        (no sync to pay; an index out of range inside a compiled CPU kernel's parallel region
        aborts the process), in checked mode on other devices."""
        def bad(name, expected, value):
            raise ValueError(f"{name} must be {expected}, got {value}")

        ids = inputs["input_ids"]
        if ((ids < 0) | (ids >= self.vocab_size)).any():
            bad("input_ids", f"in [0, {self.vocab_size}) (the vocabulary)", ids.tolist())
        slots, seq_lens = inputs["req_slots"], inputs["seq_lens"]
        if ((slots < 0) | (slots >= self.max_requests)).any():
            bad("req_slots", f"in [0, {self.max_requests})", slots.tolist())
        if ((seq_lens < 1) | (seq_lens > self.max_seq_len)).any():
            bad("seq_lens", f"in [1, {self.max_seq_len}] (the cache's max_seq_len)", seq_lens.tolist())
        rows = inputs["batch_index"]
        if ((rows < 0) | (rows >= seq_lens.shape[0])).any():
            bad("batch_index", f"in [0, {seq_lens.shape[0]})", rows.tolist())
        positions = inputs["positions"]
        if ((positions < 0) | (positions >= seq_lens[rows])).any():
            bad("positions", "in [0, seq_lens[batch_index])", positions.tolist())

    def __call__(self, input_ids, positions, batch_index, seq_lens, req_slots, mode: str = "decode") -> torch.Tensor:
        inputs = dict(input_ids=input_ids, positions=positions, batch_index=batch_index,
                      seq_lens=seq_lens, req_slots=req_slots)
        _, requests = self.check(inputs, mode)
        if requests == 0:  # an empty batch: nothing to run
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.packages[mode](**inputs)


def load_package(directory: str | os.PathLike, device_index: int = -1) -> PackagedModel:
    """Load ``directory``'s packages (:func:`build_package`); ``import dsv4_compile`` first.
    Needs torch >= 2.13 (:func:`packages_supported`)."""
    return PackagedModel(directory, device_index)
