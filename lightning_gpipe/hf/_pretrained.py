"""A pipelined HF backbone's weights in and out: each rank reads and writes only the tensors of its stage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_gpipe.hf._backbone import CausalLMHead, HFLayer, require_transformers

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_CHUNK = 16 << 20  # bytes read at a time where a tensor cannot be read into its own memory


def _layers(backbone: nn.Module) -> list[HFLayer]:
    layers = [m for m in backbone.modules() if isinstance(m, HFLayer)]
    if not layers and not isinstance(backbone, nn.Sequential | HFLayer):
        raise TypeError(
            f"{type(backbone).__name__} holds no layer of lightning_gpipe.hf.causal_lm_backbone(model): pass the "
            "backbone it made (self.backbone; under GPipeStrategy, this rank's stage of it)"
        )
    return layers


def named_hf_tensors(backbone: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """This rank's tensors of ``backbone`` (what :func:`causal_lm_backbone` made, or its pipeline stage) under their
    names in the HF model, as its ``state_dict()`` names them; a head tied to the embedding is not repeated."""
    for layer in _layers(backbone):
        for key, tensor in layer.state_dict(keep_vars=True).items():
            child, _, rest = key.partition(".")
            name = f"{layer.hf_names[child]}.{rest}"
            if isinstance(layer, CausalLMHead) and layer.tied_to and name == "lm_head.weight":
                continue
            yield name, tensor


def save_pretrained(backbone: nn.Module, folder: str | Path) -> None:
    """Write ``backbone``'s weights and config as a HF folder that ``AutoModelForCausalLM.from_pretrained`` loads.

    Collective when torch.distributed is initialized (every rank calls it, e.g. in ``on_train_end``): each rank writes
    the tensors of its stage that no lower rank holds into its own safetensors shard, and rank 0 the index and the
    config, so no rank gathers weights. Without a process group it writes one ``model.safetensors``.
    """
    require_transformers()
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # A shard (GPipeStrategy(data_parallel="fsdp")) gathered whole, one tensor at a time: every replica joins.
    mine = {name: _whole(t.detach()) for name, t in named_hf_tensors(backbone)}
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    held: list[Any] = [{n: t.nelement() * t.element_size() for n, t in mine.items()}]
    if distributed:
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, {n: t.nelement() * t.element_size() for n, t in mine.items()})
    owner: dict[str, int] = {}
    for r, names in enumerate(held):
        for name in names:
            owner.setdefault(name, r)  # replicas and stages holding a copy: the lowest rank writes it
    writers = sorted(set(owner.values()))
    files = {
        r: SINGLE if len(writers) == 1 else f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors"
        for i, r in enumerate(writers)
    }
    if rank in files:
        own = {n: t.to("cpu").contiguous() for n, t in mine.items() if owner[n] == rank}
        save_file(own, str(folder / files[rank]), metadata={"format": "pt"})
    if rank == 0:
        config = _layers(backbone)[0].config
        floating = [t.dtype for t in mine.values() if t.is_floating_point()]
        if floating:  # what from_pretrained(dtype="auto") restores
            config.dtype = floating[0]
        config.save_pretrained(folder)
        if len(writers) > 1:
            index = {
                "metadata": {"total_size": sum(held[owner[n]][n] for n in owner)},
                "weight_map": {n: files[owner[n]] for n in sorted(owner)},
            }
            (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if distributed:  # every file written before any rank goes on (and reads the folder, say)
        dist.barrier()


class _SafetensorsFile:
    """One safetensors file's header; reads a tensor straight into the memory of the tensor that receives it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            self.header: dict[str, Any] = json.loads(f.read(size))
        self.header.pop("__metadata__", None)
        self.start = 8 + size

    def read_into(self, name: str, dest: Tensor) -> None:
        entry = self.header[name]
        dtype, shape = _DTYPES[entry["dtype"]], torch.Size(entry["shape"])
        if shape != dest.shape:
            raise ValueError(
                f"{self.path}: {name} has shape {tuple(shape)}, the model's tensor {tuple(dest.shape)}: the folder "
                "holds another model than the config this backbone was built from"
            )
        begin, end = entry["data_offsets"]
        with open(self.path, "rb", buffering=0) as f, torch.no_grad():
            f.seek(self.start + begin)
            if dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous():
                _read_exactly(f, dest.detach().view(-1).view(torch.uint8).numpy())
                return
            flat, item = dest.detach().view(-1), dtype.itemsize
            per_chunk = max(1, _CHUNK // item)
            for first in range(0, flat.numel(), per_chunk):
                n = min(per_chunk, flat.numel() - first)
                buf = torch.empty(n, dtype=dtype)
                _read_exactly(f, buf.view(torch.uint8).numpy())
                flat[first : first + n].copy_(buf)
            assert f.tell() == self.start + end


def _read_exactly(f: Any, into: Any) -> None:
    view, done = memoryview(into), 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise EOFError(f"{f.name} ends inside a tensor: the file is truncated")
        done += got


def load_pretrained(backbone: nn.Module, folder: str | Path) -> None:
    """Copy the weights of the HF folder (``model.safetensors``, or shards with ``model.safetensors.index.json``)
    into ``backbone``, reading only the tensors this rank holds (under GPipeStrategy, its stage's), each straight into
    its parameter. Tensors HF's save_pretrained writes under other names or split (a mixture of experts, one tensor
    per expert) are read as ``from_pretrained`` converts them. Call it after setup (``on_fit_start``), on every
    rank."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map: dict[str, str] = json.loads((folder / INDEX).read_text())["weight_map"]
    elif (folder / SINGLE).is_file():
        weight_map = dict.fromkeys(_SafetensorsFile(folder / SINGLE).header, SINGLE)
    else:
        raise FileNotFoundError(
            f"{folder} holds neither {SINGLE} nor {INDEX}: pass a folder written by save_pretrained (a .bin-only "
            "checkpoint: load it once with from_pretrained and save_pretrained it)"
        )
    files: dict[str, _SafetensorsFile] = {}

    def file(name: str) -> _SafetensorsFile:
        if weight_map[name] not in files:
            files[weight_map[name]] = _SafetensorsFile(folder / weight_map[name])
        return files[weight_map[name]]

    missing = []
    for layer in _layers(backbone):
        converted: dict[str, Tensor] = {}
        for key, tensor in layer.state_dict(keep_vars=True).items():
            child, _, rest = key.partition(".")
            name = f"{layer.hf_names[child]}.{rest}"
            source = _source(name, weight_map, layer)
            if source is None:
                converted[name] = tensor
            else:
                _read(file(source), source, tensor)
        for name, tensor in converted.items():
            parts = _saved_parts(layer, name, tensor)
            if not parts or any(part not in weight_map for part in parts):
                missing.append(name)
                continue
            whole = torch.empty(tensor.shape, dtype=tensor.dtype)
            for part, where in parts.items():  # each saved tensor's elements, where they go in the model's
                piece = torch.empty(where.shape, dtype=tensor.dtype)
                file(part).read_into(part, piece)
                whole.view(-1)[where.reshape(-1)] = piece.reshape(-1)
            _copy(whole, tensor)
    if missing:
        raise KeyError(
            f"{folder} lacks {len(missing)} of this rank's weights ({', '.join(missing[:5])}"
            f"{' …' if len(missing) > 5 else ''}), under the model's names or those HF's save_pretrained converts "
            "them to: it was saved from another model than the config this backbone was built from"
        )


def _saved_parts(layer: HFLayer, name: str, tensor: Tensor) -> dict[str, Tensor]:
    """The names HF's save_pretrained writes the model's tensor ``name`` under (its revert_weight_conversion: a
    rename, or one tensor per expert), each with the positions of its elements in ``tensor``; {} if it converts none.
    The positions come from converting a tensor of positions the same way (8 bytes per element, once)."""
    if not layer.conversions:
        return {}
    from transformers.core_model_loading import revert_weight_conversion

    stand_in = SimpleNamespace(_weight_conversions=layer.conversions, config=layer.config)
    positions = torch.arange(tensor.numel()).reshape(tensor.shape)
    parts = revert_weight_conversion(stand_in, {name: positions})  # type: ignore[arg-type]
    return {} if list(parts) == [name] else parts


def _copy(whole: Tensor, tensor: Tensor) -> None:
    """``whole`` into ``tensor``; into a shard, its part (which every replica reads)."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            mine = distribute_tensor(whole.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.to_local().copy_(mine.to_local())
        else:
            tensor.copy_(whole)


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor().cpu() if isinstance(t, DTensor) else t


def _read(file: _SafetensorsFile, name: str, tensor: Tensor) -> None:
    """``name`` into ``tensor``; into a shard, its part of the whole tensor (which every replica reads)."""
    if not isinstance(tensor, DTensor):
        file.read_into(name, tensor)
        return
    whole = torch.empty(tensor.shape, dtype=tensor.dtype)
    file.read_into(name, whole)
    _copy(whole, tensor)


def _source(name: str, weight_map: dict[str, str], layer: HFLayer) -> str | None:
    if name in weight_map:
        return name
    if isinstance(layer, CausalLMHead) and layer.tied_to and name == "lm_head.weight" and layer.tied_to in weight_map:
        return layer.tied_to  # a tied head is saved once, as the embedding
    bare = name.partition(".")[2]  # GPT-2's original checkpoints name its modules without "transformer."
    return bare if bare in weight_map else None
