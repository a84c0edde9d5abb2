"""Sharded training on CPU: 2 processes over gloo, FSDP1 and FSDP2, raw and under Lightning.

Each multi-process test spawns 2 ranks (results go to files, asserted here); a rank that hangs
is killed after a timeout and fails the test. The tiny Llama is built from a config: no downloads.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlver.checkpoint.io import is_sharded_checkpoint, read_checkpoint_state
from rlver.parallel.full_weights import full_state_dict
from rlver.parallel.grad_clip import clip_grad_norm
from rlver.parallel.sharding import clean_name, decoder_layer_classes

WORLD = 2
MAX_NORM = 0.05  # far below the tiny model's gradient norm, so clipping is always active
LR = 0.1
GENERATE_LENGTHS = (3, 7)  # per rank: ranks run different numbers of forwards while generating
FLAVORS = ("fsdp1", "fsdp2", "ddp")


# ------------------------------------------------------------------------------------------ helpers
def _tiny_llama(seed: int = 0, tied: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).float()


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(100 + rank))


def _probe() -> torch.Tensor:
    return torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(7))


def _prompt() -> torch.Tensor:
    return torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(11))


def _generate(model: Any, length: int) -> torch.Tensor:
    # synced_gpus=False: transformers' default under FSDP (True) adds an all_reduce per token so
    # ranks stop together; inside gathered_for_generation no rank needs the others.
    return model.generate(
        _prompt(),
        max_new_tokens=length,
        min_new_tokens=length,
        do_sample=False,
        pad_token_id=0,
        synced_gpus=False,
    )


@contextlib.contextmanager
def _count_collectives() -> Iterator[list[int]]:
    """Count the torch.distributed collectives called inside (FSDP1 and FSDP2 call these)."""
    names = ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce", "broadcast")
    names += ("reduce_scatter_single", "reduce_scatter_tensor", "barrier")
    counts = [0]
    originals = {name: getattr(torch.distributed, name) for name in names if hasattr(torch.distributed, name)}

    def counting(function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[0] += 1
            return function(*args, **kwargs)

        return wrapper

    for name, function in originals.items():
        setattr(torch.distributed, name, counting(function))
    try:
        yield counts
    finally:
        for name, function in originals.items():
            setattr(torch.distributed, name, function)


def _reference_update(tied: bool = True) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One process, full model: the ranks' mean loss, clipped SGD step.

    Returns (pre-clip 2-norm, pre-clip max-norm, new state).
    """
    model = _tiny_llama(0, tied)
    loss = sum(model(input_ids=_batch(r), labels=_batch(r)).loss for r in range(WORLD)) / WORLD
    loss.backward()
    max_norm = max(float(p.grad.abs().max()) for p in model.parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return norm, max_norm, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, port: int, out: str, target: Any, init_group: bool, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        if init_group:
            torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
        result = target(rank, *args)
        torch.save(result, Path(out) / f"result_{rank}.pt")
    except BaseException:
        (Path(out) / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if torch.distributed.is_initialized():
            # Every rank past its last collective before any tears the group down: gloo aborts
            # (SIGABRT) a rank whose peer closed the connection under a finished-early send.
            with contextlib.suppress(Exception):
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _run_ranks(
    target: Any, out: Path, *args: Any, init_group: bool = True, timeout: float = 900
) -> list[Any]:
    """Run target(rank, *args) on 2 spawned ranks; their return values, or the test fails.

    A rank that fails ends the run at once (its peer would wait at the next collective until the
    timeout). The rendezvous port is free when drawn, but another process of the suite may bind it
    before rank 0 does (EADDRINUSE), or connect to it (a gloo "Connection reset by peer" with no
    traceback of the test's own): that run is started again on a new port, at most twice.
    """
    for attempt in range(3):
        errors, hung, processes = _launch_ranks(target, out, args, init_group, timeout)
        port_taken = "EADDRINUSE" in "".join(errors)
        only_resets = bool(errors) and all("Connection reset by peer" in error for error in errors)
        if not ((port_taken or only_resets) and attempt < 2):
            break
    if errors:
        codes = [process.exitcode for process in processes]
        pytest.fail("\n".join(errors) + f"\nexit codes {codes} (negative: ended by that signal)")
    if hung:
        pytest.fail(f"ranks {hung} still running after {timeout} s (a collective hung)")
    codes = [process.exitcode for process in processes]
    assert codes == [0] * WORLD, f"exit codes {codes}"
    return [torch.load(out / f"result_{rank}.pt", weights_only=False) for rank in range(WORLD)]


def _launch_ranks(
    target: Any, out: Path, args: tuple, init_group: bool, timeout: float
) -> tuple[list[str], list[int], list[Any]]:
    """One run of the ranks: (each failed rank's traceback, the ranks still running, the processes)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("error_*.txt"), *out.glob("result_*.pt")]:
        stale.unlink()
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    processes = [
        context.Process(target=_entry, args=(rank, port, str(out), target, init_group, args))
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
        if failed_at is None and any(out.glob("error_*.txt")):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 10:
            break  # a rank failed; its peer's own error, if any, had 10 s to be written
        time.sleep(0.2)
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(10)
            if process.is_alive():
                process.kill()
    errors = [
        f"rank {rank}:\n{(out / f'error_{rank}.txt').read_text()}"
        for rank in range(WORLD)
        if (out / f"error_{rank}.txt").exists()
    ]
    return errors, hung, processes


# ------------------------------------------------------------------------------------------ rank bodies
def _sharded_worker(rank: int, flavor: str) -> dict[str, Any]:
    from rlver.parallel.full_weights import gathered_for_generation
    from rlver.parallel.sharding import fsdp1_wrap, fsdp2_shard, is_sharded

    model = _tiny_llama(0)
    full_numel = sum(p.numel() for p in model.parameters())
    if flavor == "fsdp1":
        sharded = fsdp1_wrap(model, device="cpu")
    elif flavor == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        sharded = fsdp2_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    else:
        sharded = torch.nn.parallel.DistributedDataParallel(model)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in sharded.parameters()]
    result: dict[str, Any] = {
        "sharded": is_sharded(sharded),
        "local_numel": sum(p.numel() for p in local),
        "full_numel": full_numel,
        # cloned: for DDP the gathered tensors are the live parameters
        "init_state": {k: v.clone() for k, v in full_state_dict(sharded, cpu_offload=True).items()},
    }
    # the engine sync's streamed gather: every parameter once, one FSDP unit per chunk
    from rlver.parallel.full_weights import iter_full_weights

    result["streamed"], result["chunk_numels"] = {}, []
    for chunk in iter_full_weights(sharded):
        result["streamed"].update({name: tensor.clone() for name, tensor in chunk.items()})
        result["chunk_numels"].append(sum(tensor.numel() for tensor in chunk.values()))
    # the rollout engine's own copy (other weights), synced from the sharded parameters
    engine = _tiny_llama(1)
    engine.load_state_dict(result["init_state"], strict=True)
    with torch.no_grad():
        result["engine_logits"] = engine(input_ids=_probe()).logits
    # generation from the sharded module itself, ranks running different numbers of forwards
    generator = sharded.module if isinstance(sharded, torch.nn.parallel.DistributedDataParallel) else sharded
    with gathered_for_generation(sharded), _count_collectives() as counts:
        result["generated"] = _generate(generator, GENERATE_LENGTHS[rank])
    result["generation_collectives"] = counts[0]
    result["shared_prompt"] = _shared_prompt_passes(sharded, rank)
    # one clipped update with this rank's data
    optimizer = torch.optim.SGD(sharded.parameters(), lr=LR)
    loss = sharded(input_ids=_batch(rank), labels=_batch(rank)).loss
    loss.backward()
    result["max_norm"] = clip_grad_norm(sharded, float("inf"), norm_type=float("inf"))  # measures only
    result["norm"] = clip_grad_norm(sharded, MAX_NORM)
    optimizer.step()
    result["after_state"] = full_state_dict(sharded)
    return result


def _shared_prompt_passes(model: Any, rank: int) -> dict[bool, Any]:
    """The log-probs and global gradient norm of 3 sequences with a common 40-token prompt, the
    prompt run once (rlver.modeling.shared_prefix) and not, through the wrapper; the batch sizes the
    embedding saw. Gradients are dropped after (the update that follows starts from none)."""
    from rlver.modeling.loss_positions import policy_logprobs

    ids = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(200 + rank))
    ids[:, :40] = ids[0, :40]
    mask = torch.zeros_like(ids)
    mask[:, 41:] = 1
    embedding = next(m for name, m in model.named_modules() if name.endswith("embed_tokens"))
    passes = {}
    for share in (False, True):
        shapes: list[tuple[int, ...]] = []
        hook = embedding.register_forward_hook(
            lambda m, args, out, seen=shapes: seen.append(tuple(args[0].shape))
        )
        with torch.no_grad():
            scored, _ = policy_logprobs(model, ids, torch.ones_like(ids), mask, share_prefix=share)
        logprobs, _ = policy_logprobs(model, ids, torch.ones_like(ids), mask, share_prefix=share)
        (-(logprobs * mask).sum()).backward()
        hook.remove()
        passes[share] = (scored, logprobs.detach(), clip_grad_norm(model, float("inf")), shapes)
        for parameter in model.parameters():
            parameter.grad = None
    return passes


def _mixed_precision_worker(rank: int) -> dict[str, Any]:
    """FSDP1 under bf16 mixed precision: Lightning's config against rlver's (float32 buffers and
    gradient reductions), after one forward and backward."""
    from torch.distributed.fsdp import MixedPrecision

    from rlver.parallel.sharding import fsdp1_wrap, full_precision_reductions

    lightning_bf16_mixed = MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    result = {}
    for name, config in (
        ("lightning", lightning_bf16_mixed),
        ("rlver", full_precision_reductions(lightning_bf16_mixed)),
    ):
        sharded = fsdp1_wrap(_tiny_llama(0), device="cpu", mixed_precision=config)
        sharded(input_ids=_batch(rank), labels=_batch(rank)).loss.backward()
        result[name] = {
            "inv_freq": next(b for n, b in sharded.named_buffers() if n.endswith("inv_freq")).dtype,
            "master": {p.dtype for p in sharded.parameters()},
            "grads": {p.grad.dtype for p in sharded.parameters() if p.grad is not None},
        }
    return result


def _all_flavors_worker(rank: int) -> dict[str, dict[str, Any]]:
    results = {flavor: _sharded_worker(rank, flavor) for flavor in FLAVORS}
    results["mixed_precision"] = _mixed_precision_worker(rank)
    return results


class _TinyPolicyModule:
    """Built lazily: the LightningModule class needs lightning, imported in the ranks."""

    @staticmethod
    def create(policy: str) -> Any:
        import lightning as L

        from rlver.checkpoint.io import use_rlver_checkpoint_io
        from rlver.parallel.full_weights import gathered_for_generation
        from rlver.parallel.sharding import shard_for_strategy

        class TinyPolicy(L.LightningModule):
            def __init__(self, policy: str = "tiny") -> None:
                super().__init__()
                self.save_hyperparameters()
                self.automatic_optimization = False
                self.policy_model: Any = None
                self.norms: list[float] = []
                self.synced: dict[str, torch.Tensor] = {}
                self.tested: dict[str, torch.Tensor] = {}

            def configure_model(self) -> None:
                if self.policy_model is None:
                    self.policy_model = shard_for_strategy(_tiny_llama(0), self.trainer.strategy)

            def setup(self, stage: str) -> None:
                use_rlver_checkpoint_io(self.trainer.strategy)
                self.configure_model()  # as RLVERModule does: before Lightning's own call

            def configure_optimizers(self) -> Any:
                # AdamW as rlver: its state is sharded too (an SGD state is empty, and DCP drops it)
                return torch.optim.AdamW(self.policy_model.parameters(), lr=1e-3)

            def train_dataloader(self) -> Any:
                return torch.utils.data.DataLoader(list(range(4)), batch_size=1)

            def test_dataloader(self) -> Any:
                return torch.utils.data.DataLoader([0], batch_size=1)

            def training_step(self, batch: Any, batch_idx: int) -> None:
                optimizer = self.optimizers()
                with gathered_for_generation(self.policy_model):
                    _generate(self.policy_model, GENERATE_LENGTHS[self.global_rank])
                ids = _batch(int(batch[0]))
                optimizer.zero_grad()
                self.manual_backward(self.policy_model(input_ids=ids, labels=ids).loss)
                self.norms.append(clip_grad_norm(self.policy_model, MAX_NORM))
                optimizer.step()
                self.synced = full_state_dict(self.policy_model, cpu_offload=True)  # the engine sync

            def test_step(self, batch: Any, batch_idx: int) -> None:
                self.tested = full_state_dict(self.policy_model, cpu_offload=True)

        return TinyPolicy(policy)


def _lightning_worker(rank: int, flavor: str, root: str, policy: str) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rlver.parallel.sharding import AnyDeviceFSDPStrategy

    if flavor == "fsdp1":
        strategy: Any = AnyDeviceFSDPStrategy(state_dict_type="sharded")
    else:
        strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    module = _TinyPolicyModule.create(policy)
    trainer.fit(module)
    trainer.save_checkpoint(Path(root) / "last.ckpt")
    # torch's own gather, independent of rlver.parallel.sharding; no cpu_offload: under FSDP1 with a
    # CPU compute device, torch 2.13's offload path segfaults
    options = StateDictOptions(full_state_dict=True)
    return {
        "final": get_model_state_dict(module.policy_model, options=options),
        "synced": module.synced,
        "norms": module.norms,
        "wrapper": type(module.policy_model).__name__,
    }


# ------------------------------------------------------------------------------------------ fast tests
def test_clean_name_strips_wrapper_prefixes():
    name = "_orig_mod.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.up_proj.weight"
    assert clean_name(name) == "model.layers.0.mlp.up_proj.weight"
    assert clean_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_decoder_layer_classes_come_from_no_split_modules():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    assert decoder_layer_classes(_tiny_llama()) == {LlamaDecoderLayer}
    assert decoder_layer_classes(torch.nn.Linear(2, 2)) == set()


def test_plain_module_full_state_dict_and_clip():
    model = _tiny_llama()
    state = full_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    loss = model(input_ids=_batch(0), labels=_batch(0)).loss
    loss.backward()
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    grads_before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm(model, MAX_NORM)
    assert norm == pytest.approx(expected, rel=1e-5)
    scale = MAX_NORM / (norm + 1e-6)
    for before, p in zip(grads_before, model.parameters()):
        torch.testing.assert_close(p.grad, before * scale)
    assert clip_grad_norm(torch.nn.Linear(2, 2), 1.0) == 0.0  # no gradients yet


def test_read_checkpoint_state_file_and_errors(tmp_path):
    checkpoint = {"state_dict": {"policy_model.w": torch.ones(2)}, "hyper_parameters": {"policy": "p"}}
    torch.save(checkpoint, tmp_path / "one.ckpt")
    loaded = read_checkpoint_state(tmp_path / "one.ckpt")
    assert loaded["hyper_parameters"] == {"policy": "p"}
    assert torch.equal(loaded["state_dict"]["policy_model.w"], torch.ones(2))
    with pytest.raises(FileNotFoundError):
        read_checkpoint_state(tmp_path / "missing.ckpt")
    (tmp_path / "folder").mkdir()
    assert not is_sharded_checkpoint(tmp_path / "folder")
    with pytest.raises(ValueError, match="not a Lightning sharded checkpoint"):
        read_checkpoint_state(tmp_path / "folder")


# ------------------------------------------------------------------------------------------ 2 ranks
def _check_sharded_results(results: list[dict[str, Any]], sharded: bool) -> None:
    reference = _tiny_llama(0)
    expected = reference.state_dict()
    with torch.no_grad():
        expected_logits = reference(input_ids=_probe()).logits
    norm, max_norm, updated = _reference_update()
    assert norm > MAX_NORM  # the update below is a clipped one
    for rank, result in enumerate(results):
        assert result["sharded"] is sharded
        if sharded:  # each rank holds about half of the weights
            assert result["local_numel"] < 0.6 * result["full_numel"], rank
        # full-weight gather: the unsharded weights under the HF names, on every rank
        state = result["init_state"]
        assert state.keys() == expected.keys(), rank
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), (rank, name)
            assert state[name].device.type == "cpu"
        # the streamed sync: the parameters (the tied head once), at most one decoder layer or the
        # root's own weights (embeddings, final norm) gathered at a time when sharded
        parameters = dict(reference.named_parameters(remove_duplicate=False))  # the tied head too
        assert result["streamed"].keys() == parameters.keys(), rank
        for name, tensor in parameters.items():
            assert torch.equal(result["streamed"][name], tensor), (rank, name)
        if sharded:
            layer = sum(p.numel() for p in reference.model.layers[0].parameters())
            root = sum(parameters[n].numel() for n in parameters if ".layers." not in n)
            assert max(result["chunk_numels"]) == max(layer, root), rank
            assert len(result["chunk_numels"]) == len(reference.model.layers) + 1, rank
        # engine sync: the engine's copy computes the unsharded model's logits
        assert torch.equal(result["engine_logits"], expected_logits), rank
        # generation from the gathered sharded module equals the unsharded model's, and runs no
        # collective (ranks generate different numbers of tokens)
        assert result["generation_collectives"] == 0, rank
        assert torch.equal(result["generated"], _generate(reference, GENERATE_LENGTHS[rank])), rank
        # global grad norm and the clipped update
        assert result["norm"] == pytest.approx(norm, rel=1e-5), rank
        assert result["max_norm"] == pytest.approx(max_norm, rel=1e-5), rank
        for name, tensor in updated.items():
            torch.testing.assert_close(result["after_state"][name], tensor, rtol=1e-5, atol=1e-6)
    assert results[0]["norm"] == results[1]["norm"]  # bitwise identical on both ranks


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    """All flavours in one pair of ranks (one start-up: the imports dominate on 2 cores)."""
    return _run_ranks(_all_flavors_worker, tmp_path_factory.mktemp("ranks"))


@pytest.mark.slow
@pytest.mark.parametrize("flavor", FLAVORS)
def test_sharded_gather_sync_generation_and_clipping(flavor, sharded_results):
    _check_sharded_results([result[flavor] for result in sharded_results], sharded=flavor != "ddp")


@pytest.mark.slow
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_shared_prompt_runs_once_under_every_wrapper(flavor, sharded_results):
    """DDP takes the two forward calls of a shared prompt (the prompt alone, then the rows on its
    cache) before one backward; FSDP1 and FSDP2 take them without gradients (scoring) and run the
    plain pass under autograd (the rows' gradient would reach the prompt's layers inside, past the
    hooks that gather their weights). Log-probs and the global gradient norm equal the plain
    pass's on each rank."""
    two = [(1, 40), (3, 8)]
    for rank, result in enumerate(sharded_results):
        (plain_scored, plain, plain_norm, plain_shapes), (scored, shared, norm, shapes) = (
            result[flavor]["shared_prompt"][share] for share in (False, True)
        )
        assert plain_shapes == [(3, 48), (3, 48)], rank
        assert shapes == ([*two, *two] if flavor == "ddp" else [*two, (3, 48)]), rank
        torch.testing.assert_close(scored, plain_scored, atol=1e-5, rtol=0)
        torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
        torch.testing.assert_close(scored, plain, atol=1e-5, rtol=0)
        assert norm == pytest.approx(plain_norm, rel=1e-5), rank


@pytest.mark.slow
def test_bf16_mixed_keeps_buffers_and_gradient_reductions_in_float32(sharded_results):
    for result in sharded_results:
        lightning, ours = result["mixed_precision"]["lightning"], result["mixed_precision"]["rlver"]
        assert lightning["inv_freq"] == torch.bfloat16  # what Lightning's bf16-mixed alone does
        assert ours["inv_freq"] == torch.float32  # RoPE positions as the engine computes them
        assert ours["master"] == {torch.float32} and ours["grads"] == {torch.float32}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["fsdp1", "fsdp2"])
def test_lightning_sharded_checkpoint_reads_back_full_weights(flavor, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlver.checkpoint.export import load_policy_state

    folder = tmp_path / "tiny"
    _tiny_llama(0).save_pretrained(folder)
    root = tmp_path / "run"
    results = _run_ranks(
        _lightning_worker, tmp_path / "ranks", flavor, str(root), str(folder), init_group=False, timeout=900
    )
    assert results[0]["wrapper"] == (
        "FullyShardedDataParallel" if flavor == "fsdp1" else "FSDPLlamaForCausalLM"
    )
    final = results[0]["final"]
    initial = _tiny_llama(0).state_dict()
    assert not torch.equal(
        final["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"]
    )
    # training inside Lightning: one global norm, the engine sync saw the final weights
    assert results[0]["norms"] == results[1]["norms"] and len(results[0]["norms"]) == 2
    for result in results:
        assert result["synced"].keys() == initial.keys()
        assert all(torch.equal(result["synced"][k], final[k]) for k in final)

    path = root / "last.ckpt"
    assert path.is_dir() and is_sharded_checkpoint(path)
    checkpoint = read_checkpoint_state(path)
    assert checkpoint["hyper_parameters"]["policy"] == str(folder)
    assert checkpoint["global_step"] == 2
    prefix = "policy_model."
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    assert set(state) | {"lm_head.weight"} == set(initial) | {"lm_head.weight"}
    for name, tensor in state.items():
        assert torch.equal(tensor, final[name]), name
    # what `rlver export` does with it: a fresh HF model from the policy folder, strictly loaded
    exported = AutoModelForCausalLM.from_pretrained(folder)
    load_policy_state(exported, state, path)
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, final[name]), name

    # `trainer.test(ckpt_path=<folder>)` in one process (no sharded strategy)
    import lightning as L

    module = _TinyPolicyModule.create(str(folder))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / "test",
    )
    trainer.test(module, ckpt_path=path, verbose=False)
    assert module.tested.keys() == initial.keys()
    for name, tensor in final.items():
        assert torch.equal(module.tested[name], tensor), name


def test_a_swap_interrupted_anywhere_leaves_one_whole_checkpoint(tmp_path):
    from rlver.checkpoint.io import recover_checkpoints, swap_in

    def folder(name, marker):
        path = tmp_path / name
        path.mkdir()
        (path / "meta.pt").write_text(marker)
        return path

    last = folder("last.ckpt", "old")
    swap_in(folder(".last.ckpt.partial", "new"), last)
    assert (last / "meta.pt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "last.ckpt"
    ]
    # Killed after moving the old one aside, before moving the new one in: the old one comes back.
    (tmp_path / "last.ckpt").rename(tmp_path / ".last.ckpt.old")
    folder(".last.ckpt.partial", "newer, unfinished")
    assert recover_checkpoints(tmp_path) == [tmp_path / "last.ckpt"]
    assert (last / "meta.pt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "last.ckpt"
    ]
    # Killed after the new one went in, before the old one was deleted: the new one stays.
    folder(".last.ckpt.old", "stale")
    assert recover_checkpoints(tmp_path) == []
    assert (last / "meta.pt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "last.ckpt"
    ]
