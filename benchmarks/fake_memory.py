"""A recipe's trainer memory per phase, measured by running its models on fake tensors, beside `rlver plan`.

No GPU and no weights: the recipe's real architectures (transformers' own modules, from the
config rlver ships), sharded with FSDP2 (`fully_shard` per decoder layer, then the root) over a
fake process group of `--world-size` ranks, with AdamW and the recipe's precision, run under
`FakeTensorMode` (shapes and dtypes, no data) while torch's `FSDPMemTracker` counts what one rank
holds. Phases measured, per rank:

- resident: the sharded float32 weights and AdamW's two states (after one optimizer step) of the
  policy and, for PPO, the critic (a backbone and a value head, as `rlver.modeling.critic`);
- scoring: a no-gradient forward of one micro-batch (`ppo.micro_batch_size` x `max_context_tokens`)
  through each network, the policy's log-probs from float32 logits;
- update: one micro-batch's forward and backward through the policy (log-probs and entropy from
  float32 logits, the recipe's gradient checkpointing) and the critic, before the optimizer step.

What it leaves out, so the plan's figures are compared without them: the CUDA context and the
engine (asleep: 1 GiB each in the plan), and rlver's own loss code (its chunked vocabulary maths
asks data-dependent questions fake tensors cannot answer: the loss here is the plan's assumption,
whole-vocabulary float32 log-softmax and entropy). The recipes shard with FSDP1; FSDP2 is measured
here (both keep float32 shards and gather bf16 units for compute).

    python benchmarks/fake_memory.py --config recipes/ppo_think.yaml --world-size 8
    python benchmarks/fake_memory.py --config recipes/ppo_think.yaml --world-size 8 32 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 2**30
RESIDENT_KINDS = ("Sharded Param", "OptState", "Buffer", "Total")
SKIPPED = ("CUDA context", "engine asleep", "resident")
NOT_TRACKED = ("CUDA context", "engine asleep")  # the plan's parts no tracker of tensors can see


def build_networks(config: Any, critic: bool) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy (a causal LM) and, for PPO, the critic (backbone + value head), from the config."""
    from transformers import AutoModel, AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    value = None
    if critic:
        backbone = AutoModel.from_config(config, dtype=torch.float32)
        value = Critic(backbone, config.hidden_size)
    return policy, value


class Critic(torch.nn.Module):
    """rlver.modeling.critic.ValueModel's shape: a backbone and a one-output head."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone, self.head = backbone, torch.nn.Linear(hidden_size, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(input_ids=input_ids).last_hidden_state).squeeze(-1)


def shard(module: torch.nn.Module, mesh: Any, compute_dtype: torch.dtype) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)


def policy_loss(policy: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """rlver's vocabulary maths on every position's logits (the plan's worst case): log-probs and
    entropy from float32 slices of the logits, recomputed in the backward (`in_vocab_chunks`)."""
    from rlver.modeling.batch import in_vocab_chunks, target_logprobs
    from rlver.modeling.loss_positions import _logprobs_and_entropy

    logits = policy(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    if not torch.is_grad_enabled():  # scoring: log-probs alone
        return target_logprobs(logits, targets).mean()
    both = in_vocab_chunks(_logprobs_and_entropy, logits, targets, dim=1, temperature=1.0)
    picked, entropy = both.unbind(-1)
    return -(picked.mean() + 0.001 * entropy.mean())


def value_loss(value: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return value(ids).float().pow(2).mean()


def measure(recipe: str, world_size: int) -> dict[str, Any]:
    """Peak GiB per phase on one rank, and `rlver plan`'s figure for each (without NOT_TRACKED)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig

    from rlver.cli import parse_recipe
    from rlver.modeling.precision import install_float32_head
    from rlver.plan.memory_plan import plan_recipe

    config = parse_recipe(recipe)
    arch, shape, phases = plan_recipe(config, gpu_memory_gib=79.3, world_size=world_size)
    planned = {
        phase.name: sum(size for label, size in phase.parts if not label.startswith(NOT_TRACKED)) / GIB
        for phase in phases
    }
    for phase in phases:  # the resident part inside the later phases, the context out of it
        planned[phase.name] -= sum(size for label, size in phase.parts if label == "resident") / GIB
    parts = {
        phase.name: {k: round(v / GIB, 2) for k, v in phase.parts if not k.startswith(SKIPPED)}
        for phase in phases
    }
    resident_phase = next(p for p in phases if p.name == "trainer resident")
    planned["trainer resident"] = sum(s for label, s in resident_phase.parts if "context" not in label) / GIB

    source = Path(arch.source.removeprefix("shipped: "))
    raw = json.loads((source if source.is_absolute() else REPO / source).read_text())
    hf_config = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    compute = torch.bfloat16 if shape.compute_bytes == 2 else torch.float32
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    mesh = init_device_mesh("cpu", (world_size,))
    measured: dict[str, float] = {}
    kinds: dict[str, dict[str, float]] = {}
    with FakeTensorMode():
        policy, value = build_networks(hf_config, shape.critic)
        networks = [n for n in (policy, value) if n is not None]
        if compute != torch.float32:
            install_float32_head(policy)  # as rlver's load_policy does under bf16
        if shape.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
            if value is not None:
                value.backbone.gradient_checkpointing_enable()
        for network in networks:
            shard(network, mesh, compute)
        optimizers = [torch.optim.AdamW(n.parameters(), lr=1e-6, foreach=False) for n in networks]
        ids = torch.randint(0, hf_config.vocab_size, (shape.micro_batch_size, shape.context_tokens))
        # One step first, outside the tracker: AdamW's states exist from then on.
        for network, optimizer, loss in zip(networks, optimizers, (policy_loss, value_loss), strict=False):
            loss(network, ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for name, work in (("trainer resident", None), ("scoring", "score"), ("update", "update")):
            tracker = FSDPMemTracker(mod=policy, optm=optimizers[0])
            with contextlib.ExitStack() as stack:
                stack.enter_context(tracker)
                before = _total(tracker.get_tracker_snapshot())
                if work == "score":
                    with torch.no_grad():
                        policy_loss(policy, ids)
                        if value is not None:
                            value_loss(value, ids)
                elif work == "update":
                    policy_loss(policy, ids).backward()
                    if value is not None:
                        value_loss(value, ids).backward()
            peak = _total(tracker.get_tracker_snapshot("peak"))
            if work is not None:  # what the peak was made of, beyond the resident shards and states
                kinds[name] = {
                    str(getattr(kind, "value", kind)): round(size / GIB, 2)
                    for snapshot in tracker.get_tracker_snapshot("peak").values()
                    for kind, size in snapshot.items()
                    if size and str(getattr(kind, "value", kind)) not in RESIDENT_KINDS
                }
            measured[name] = (before if work is None else peak - before) / GIB
            for network in networks:
                for parameter in network.parameters():
                    parameter.grad = None
        measured["trainer resident"] = _held(networks, optimizers) / GIB
    dist.destroy_process_group()
    rows = []
    for name in ("trainer resident", "scoring", "update"):
        rows.append({
            "phase": name if name == "trainer resident" else f"{name} (above resident)",
            "measured_gib": round(measured[name], 2),
            "planned_gib": round(planned[name], 2),
            "ratio": round(measured[name] / planned[name], 3) if planned[name] else None,
            "measured_at_peak": kinds.get(name, {}),
            "planned_parts": parts.get(name, {}),
        })  # fmt: skip
    return {"recipe": recipe, "world_size": world_size, "rows": rows}


def _total(snapshot: dict) -> float:
    return float(sum(v.get("Total", 0) for v in snapshot.values()))


def _held(networks: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of one rank's shards and optimizer states (the local tensors of each DTensor)."""

    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    held = sum(local_bytes(p) for n in networks for p in n.parameters())
    for optimizer in optimizers:
        for state in optimizer.state.values():
            held += sum(local_bytes(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a recipe YAML")
    parser.add_argument("--world-size", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    results = [measure(args.config, world) for world in args.world_size]
    for result in results:
        print(f"{result['recipe']} on {result['world_size']} ranks (GiB a rank, no CUDA context or engine)")
        print(f"  {'phase':<30} {'measured':>9} {'planned':>8} {'ratio':>6}")
        for row in result["rows"]:
            figures = f"{row['measured_gib']:>9.2f} {row['planned_gib']:>8.2f} {row['ratio']:>6}"
            print(f"  {row['phase']:<30} {figures}")
            if row["measured_at_peak"]:
                print(f"    measured at the peak: {row['measured_at_peak']}")
                print(f"    planned: {row['planned_parts']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
