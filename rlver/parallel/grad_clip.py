"""Gradient clipping to the global norm, over every shard and rank (FSDP1, FSDP2, DDP, one process).

It scales gradients only; the optimizer step is the caller's."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rlver.parallel.sharding import dtensor_class, top_fsdp1_units, unwrap_ddp, uses_fsdp1


def clip_grad_norm(
    module_or_params: nn.Module | Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0
) -> float:
    """Clip gradients to the global norm over all shards and ranks; returns the pre-clip norm.

    The norm is the one the unsharded model would have (with the ranks' gradients averaged,
    as DDP/FSDP do), identical on every rank. A collective under FSDP: call on every rank.

    * FSDP1: the root's `clip_grad_norm_` (pass the FSDP root, or a module holding exactly one
      FSDP1 root; parameters alone are refused, their gradients are shards).
    * FSDP2 / DTensor parameters: each local shard's norm, reduced over the mesh dims it is
      sharded on, then every gradient scaled by the same factor; plain-tensor parameters
      alongside count as replicated. Every rank must hold the same parameters (it does).
    * DDP / plain: `torch.nn.utils.clip_grad_norm_` (DDP gradients are already all-reduced).

    Args:
        module_or_params: A module, or an iterable of parameters.
        max_norm: The largest allowed norm (`float("inf")`: measure without clipping).
        norm_type: The p of the p-norm (`float("inf")` allowed).
    """
    if isinstance(module_or_params, nn.Module):
        module = unwrap_ddp(module_or_params)
        if uses_fsdp1(module):
            units = top_fsdp1_units(module)
            if len(units) != 1:
                raise ValueError(
                    f"clip_grad_norm: {len(units)} FSDP1 roots in one module; clip each root separately"
                )
            inside = {id(p) for p in units[0].parameters()}
            if any(id(p) not in inside for p in module.parameters()):
                raise ValueError("clip_grad_norm: the module has parameters outside its FSDP1 root")
            return float(units[0].clip_grad_norm_(max_norm, norm_type))
        params = list(module.parameters())
    else:
        params = list(module_or_params)
    if any(getattr(p, "_fsdp_flattened", False) for p in params):
        raise ValueError("clip_grad_norm: FSDP1 parameters are shards; pass the FSDP module instead")
    dtensor = dtensor_class()
    if not any(isinstance(p, dtensor) for p in params):
        if not any(p.grad is not None for p in params):
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))
    total_norm = _dtensor_grad_norm(params, float(norm_type))
    coefficient = max_norm / (total_norm + 1e-6)
    if coefficient < 1.0:
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(coefficient)
    return total_norm


def _dtensor_grad_norm(params: list[nn.Parameter], norm_type: float) -> float:
    """The global gradient norm of parameters some of which are DTensors.

    Each DTensor gradient's local shard contributes to its (mesh, sharded mesh dims) group,
    reduced over those mesh dims; plain gradients count as replicated. Groups come from the
    parameters, not the gradients, so every rank runs the same collectives even where a
    gradient is missing.
    """
    infinite = math.isinf(norm_type)

    def local(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        if tensor is None or tensor.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=device)
        norm = torch.linalg.vector_norm(tensor, norm_type, dtype=torch.float32)
        return norm if infinite else norm**norm_type

    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b) if infinite else a + b

    dtensor = dtensor_class()
    groups: dict[tuple[int, tuple[int, ...]], tuple[Any, torch.Tensor]] = {}
    replicated = torch.zeros((), dtype=torch.float32)
    for param in params:
        grad: Any = param.grad  # a DTensor's gradient is a DTensor
        if isinstance(param, dtensor):
            dims = tuple(i for i, placement in enumerate(param.placements) if placement.is_shard())
            key = (id(param.device_mesh), dims)
            part = local(grad.to_local() if grad is not None else None, param.device)
            mesh, total = groups.get(key, (param.device_mesh, torch.zeros_like(part)))
            groups[key] = (mesh, combine(total, part))
        elif grad is not None:
            replicated = combine(replicated, local(grad, grad.device).cpu())
    op = torch.distributed.ReduceOp.MAX if infinite else torch.distributed.ReduceOp.SUM
    overall = replicated
    for (_, dims), (mesh, total) in groups.items():  # insertion order: the same on every rank
        for dim in dims:
            torch.distributed.all_reduce(total, op=op, group=mesh.get_group(dim))
        overall = combine(overall, total.cpu())
    return float(overall if infinite else overall ** (1.0 / norm_type))
