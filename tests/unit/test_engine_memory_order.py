"""The GPU fixes that a CPU run cannot exercise, each held by a test that fails when it is reverted
(issue 42, item 5): the order of vLLM's sleep, wake and weight reload with the bytes the engine
holds at each (a recording stand-in for `vllm.LLM`), the train-start sync left out where the
engine holds the policy's own weights, and FSDP1 wrapped with float32 buffers and reductions
through the Lightning strategies rlver builds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlver.core.interfaces import SamplingSettings

WEIGHTS, KV_CACHE = 14, 49  # the engine's weights and KV cache (GiB), as for Qwen2.5-7B on 79.3 GiB


class MemoryRecordingLLM:
    """`vllm.LLM` as far as the engine drives it: what is awake, and every call with the GiB held then."""

    def __init__(self) -> None:
        self.awake = {"weights", "kv_cache"}  # a new engine holds both
        self.events: list[tuple[str, int]] = []

    @property
    def held(self) -> int:
        return WEIGHTS * ("weights" in self.awake) + KV_CACHE * ("kv_cache" in self.awake)

    def sleep(self, level):
        self.awake.clear()
        self.events.append((f"sleep {level}", self.held))

    def wake_up(self, tags):
        self.awake |= set(tags)
        self.events.append((f"wake {'+'.join(tags)}", self.held))

    def collective_rpc(self, function):
        function(SimpleNamespace(reload_weights=lambda weights_iterator: list(weights_iterator)))
        self.events.append(("reload", self.held))

    def reset_prefix_cache(self):
        self.events.append(("reset prefix cache", self.held))

    def generate(self, prompts, params, use_tqdm=False):
        assert self.awake == {"weights", "kv_cache"}, "generation needs the whole engine awake"
        self.events.append(("generate", self.held))
        return []


def recording_engine(monkeypatch, sleep_between_rollouts: bool = True):
    """A VLLMEngine around the recording LLM and a tiny policy; `vllm`'s two request classes are
    stand-ins too (importing vLLM takes a minute on a busy CPU, and none of it runs here)."""
    import sys

    from rlver_plugins.vllm_engine.engine import VLLMEngine

    from rlver.modeling.models import Policy
    from tests.conftest import small_llama

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **options: options))
    monkeypatch.setitem(sys.modules, "vllm.inputs", SimpleNamespace(TokensPrompt=lambda **prompt: prompt))
    engine = object.__new__(VLLMEngine)
    engine.policy = Policy(model=small_llama(), tokenizer=None, path="tiny", name="tiny")
    engine.llm, engine.weight_dtype, engine.tensor_parallel_size = MemoryRecordingLLM(), torch.bfloat16, 1
    engine.sync_every_step, engine.sleep_between_rollouts = True, sleep_between_rollouts
    engine._asleep, engine._sync_pending, engine.weights_version = set(), False, 0
    engine.stop_ids, engine._thread, engine._compile_nothing = [0], None, False
    return engine


def generate(engine):
    """A rollout's engine calls, as RolloutRunner.run makes them: the reload point every rank
    reaches, then the generation."""
    engine.prepare_for_rollout()
    engine.generate([[1, 2]], SamplingSettings(max_new_tokens=1))


def test_a_step_syncs_into_a_sleeping_engine_and_checkpoints_with_it_asleep(monkeypatch):
    """rollout -> release -> update -> sync -> checkpoint -> next rollout: the sync asked for
    after the update waits for the next rollout's start, so the checkpoint finds the engine holding
    nothing, and the reload runs with the weights awake alone (no KV cache) before the cache wakes."""
    engine = recording_engine(monkeypatch)
    llm = engine.llm
    generate(engine)  # the step's rollout
    engine.release_memory()  # the update gets the memory
    engine.sync_weights()  # the step's end
    assert llm.held == 0  # what the checkpoint, which runs now, shares the GPU with
    assert engine.weights_version == 0  # nothing reloaded yet
    generate(engine)  # the next step's rollout
    assert llm.events == [
        ("generate", WEIGHTS + KV_CACHE),
        ("sleep 2", 0),
        ("wake weights", WEIGHTS),
        ("reload", WEIGHTS),  # the gathered units stream into the weights with no KV cache held
        ("reset prefix cache", WEIGHTS),
        ("wake kv_cache", WEIGHTS + KV_CACHE),
        ("generate", WEIGHTS + KV_CACHE),
    ]
    assert engine.weights_version == 1


def test_a_sync_asked_while_the_engine_is_awake_puts_it_to_sleep_first(monkeypatch):
    """Validation after a generation, a resumed run's start: the engine holds its KV cache; the
    sync must not stream a unit on top of it."""
    engine = recording_engine(monkeypatch)
    engine.sync_weights()  # awake, as after a generation
    assert engine.llm.events == [("sleep 2", 0)]
    generate(engine)
    assert [event for event, _ in engine.llm.events][1:4] == ["wake weights", "reload", "reset prefix cache"]
    assert dict(engine.llm.events)["reload"] == WEIGHTS


def test_an_engine_that_never_sleeps_syncs_at_once(monkeypatch):
    """On CPU (no sleep mode) the sync reloads when asked, with nothing to wake."""
    engine = recording_engine(monkeypatch, sleep_between_rollouts=False)
    engine.sync_weights()
    assert engine.llm.events == [("reload", WEIGHTS + KV_CACHE), ("reset prefix cache", WEIGHTS + KV_CACHE)]
    assert engine.weights_version == 1


def test_an_overlapped_run_gets_an_engine_that_never_sleeps():
    """Its rollouts run beside the update: a sync deferred to their generation would read weights
    the update is changing."""
    from rlver.rollout.overlap import engine_for_overlap

    spec = engine_for_overlap({"name": "vllm", "sleep_between_rollouts": True})
    assert spec["sleep_between_rollouts"] is False and spec["own_thread"] is True
    assert engine_for_overlap("hf") == "hf"


@pytest.mark.parametrize(
    ("global_step", "ckpt_path", "engine_has_policy_weights", "syncs"),
    [
        (0, None, True, 0),  # a fresh start: the engine read the same files
        (0, "runs/x/last.ckpt", True, 1),  # restored weights
        (12, None, True, 1),  # a step was trained in this process (e.g. fit called twice)
        (0, None, False, 1),  # an engine that did not read the policy's files (the interface's default)
    ],
)
def test_train_start_syncs_only_weights_the_engine_does_not_hold(
    global_step, ckpt_path, engine_has_policy_weights, syncs
):
    from rlver.train.module import RLVERModule

    calls = []
    engine = SimpleNamespace(
        sync_weights=lambda: calls.append("sync"), starts_with_policy_weights=engine_has_policy_weights
    )
    module = SimpleNamespace(
        global_step=global_step,
        trainer=SimpleNamespace(ckpt_path=ckpt_path),
        runner=SimpleNamespace(engine=engine),
    )
    RLVERModule.on_train_start(module)
    assert len(calls) == syncs


# --------------------------------------------------------------------------- FSDP1 mixed precision
@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("path", ["shard_for_strategy", "strategy_setup_model"])
def test_bf16_mixed_fsdp_keeps_buffers_and_reductions_float32(one_process_group, path):
    """Both ways rlver wraps a model in FSDP1 under Lightning's bf16-mixed (which asks for bf16
    buffers and reductions): the wrapped module keeps the RoPE buffer and gradient reductions in
    float32, and its forward leaves inv_freq float32."""
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel

    from rlver.parallel.sharding import AnyDeviceFSDPStrategy, shard_for_strategy
    from tests.conftest import small_llama

    strategy = AnyDeviceFSDPStrategy(
        precision_plugin=FSDPPrecision("bf16-mixed"), parallel_devices=[torch.device("cpu")]
    )
    assert strategy.mixed_precision_config.buffer_dtype == torch.bfloat16  # what Lightning asks for
    model = small_llama()
    wrapped = (
        shard_for_strategy(model, strategy) if path == "shard_for_strategy" else strategy._setup_model(model)
    )
    assert isinstance(wrapped, FullyShardedDataParallel)
    config = wrapped.mixed_precision
    assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (
        torch.bfloat16, torch.float32, torch.float32,
    )  # fmt: skip
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    inv_freq = [buffer.dtype for name, buffer in wrapped.named_buffers() if name.endswith("inv_freq")]
    assert inv_freq and set(inv_freq) == {torch.float32}


def test_a_level_2_release_alone_marks_the_weights_for_reload(monkeypatch):
    """Issue 54 (7): a release that drops the weights (level 2) must leave the reload pending
    itself, not rely on a sync being asked before the next generation: a rollout that follows a
    release with no sync in between (a step dropped by a stop, an evaluation) reloads first."""
    engine = recording_engine(monkeypatch)
    generate(engine)
    engine.release_memory()  # level 2: the engine holds no weights now
    assert engine._sync_pending
    generate(engine)  # no sync_weights() in between
    assert [event for event, _ in engine.llm.events] == [
        "generate", "sleep 2", "wake weights", "reload", "reset prefix cache", "wake kv_cache", "generate",
    ]  # fmt: skip


def test_a_generation_before_the_pending_reload_fails_loudly(monkeypatch):
    """Issue 54 (1): the reload gathers FSDP shards, a collective. Done lazily inside `generate`,
    it ran on the ranks that generate and not on one whose dialogues all ended at the opening or
    that stopped at turn 0: the job hung. It runs in `prepare_for_rollout`, which every rank
    reaches (RolloutRunner.run calls it first); a generation without it is a bug, said at once."""
    engine = recording_engine(monkeypatch)
    engine.release_memory()
    with pytest.raises(RuntimeError, match="prepare_for_rollout"):
        engine.generate([[1, 2]], SamplingSettings(max_new_tokens=1))
    assert [event for event, _ in engine.llm.events] == ["sleep 2"]  # nothing reloaded behind its back
    engine.prepare_for_rollout()
    assert [event for event, _ in engine.llm.events][1:] == [
        "wake weights", "reload", "reset prefix cache", "wake kv_cache",
    ]  # fmt: skip
    engine.prepare_for_rollout()  # nothing pending: no second reload
    assert engine.weights_version == 1
    engine.release_memory()  # a stop at turn 0: everything the reload woke goes back to sleep
    assert engine.llm.held == 0


def test_the_runner_reloads_before_any_dialogue_can_end_or_stop():
    """A rank that stops at its first turn, or whose dialogues all end at the user's opening,
    still takes the reload: RolloutRunner.run asks the engine first, before openings or turns."""
    from rlver.core.interfaces import StopRequested
    from rlver.core.types import Profile
    from rlver.rollout.runner import RolloutRunner, RolloutSettings

    calls = []

    class Engine:
        def prepare_for_rollout(self):
            calls.append("prepare")

        def generate(self, prompts, sampling):
            calls.append("generate")
            raise AssertionError("never reached: the stop comes first")

    class Simulator:
        def __getattr__(self, name):
            calls.append(f"simulator.{name}")
            raise StopRequested  # the first thing the rollout asks of anyone else ends it

    runner = object.__new__(RolloutRunner)
    runner.engine, runner.simulator, runner.settings = Engine(), Simulator(), RolloutSettings()
    with pytest.raises(StopRequested):
        runner.run([Profile("p", "a user", "a scene", "the user", ("the user",), "listen", "hello")])
    assert calls[0] == "prepare"
