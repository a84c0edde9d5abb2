from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
OFFICIAL_SAMPLE = SHARED / "data" / "rlver_train_profiles_sample.jsonl"


def _share_the_cores_between_workers():
    """Give each xdist worker (and the `rlver fit`, vLLM and rank processes it starts) its share of
    the cores as OpenMP threads.

    Left alone, every worker's torch takes every core: two workers on two cores run four OpenMP
    threads whose barriers wait on descheduled peers. Measured here: a test that takes 28 s alone
    took 70 s beside a busy vLLM server at two threads each, 31 s at one thread each (and the
    server answered 2.5x the requests); in the whole suite the same test took 292 s.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported before this file (a plugin): its pool is already sized
        sys.modules["torch"].set_num_threads(threads)


_share_the_cores_between_workers()


# Test folders in memory where there is room: the suite writes ~27 GB of checkpoints, and on a
# virtual disk each GB cost ~6 s of kernel CPU (measured here: 1.6 GB took 9.6 s of system time to
# the disk, 0.9 s to /dev/shm), time the training tests then lack. A passed test's folder is
# removed at once (tmp_path_retention_policy = "failed" in pyproject.toml), so the memory held is
# that of the tests running (the largest leaves ~3 GB), not the run's. RLVER_TEST_TMP=<folder>
# chooses the place (`disk`: pytest's default); pytest's own --basetemp wins over both.
MEMORY_TEMP = Path("/dev/shm")
MEMORY_TEMP_MIN_FREE_GIB = 12  # room for three workers' largest tests, with a margin
MEMORY_MIN_AVAILABLE_GIB = 16  # the processes' own peak in a whole run is ~13 GB


def _memory_backed_basetemp():
    """A fresh folder under /dev/shm for this run, or None where memory or the folder is short."""
    import shutil

    choice = os.environ.get("RLVER_TEST_TMP", "")
    if choice == "disk":
        return None
    if choice:
        root = Path(choice)
    else:
        if not sys.platform.startswith("linux") or not MEMORY_TEMP.is_dir():
            return None
        try:
            free = shutil.disk_usage(MEMORY_TEMP).free
            meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            available = int(meminfo["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return None
        if free < MEMORY_TEMP_MIN_FREE_GIB * 2**30 or available < MEMORY_MIN_AVAILABLE_GIB * 2**30:
            return None
        root = MEMORY_TEMP
    runs = root / f"rlver-tests-{os.getuid()}"
    runs.mkdir(parents=True, exist_ok=True)
    for earlier in runs.glob("run-*"):  # a failed run's folders stay until the next run
        if not _alive(int(earlier.name.removeprefix("run-") or 0)):
            shutil.rmtree(earlier, ignore_errors=True)
    return runs / f"run-{os.getpid()}"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return pid > 0


_MEMORY_TEMP_KEY = pytest.StashKey[Path]()
_PASSED_KEY = pytest.StashKey[bool]()


def pytest_configure(config):
    if hasattr(config, "workerinput") or config.option.basetemp:
        return  # an xdist worker takes its folder from the controller; --basetemp was given
    basetemp = _memory_backed_basetemp()
    if basetemp is not None:
        config.option.basetemp = str(basetemp)
        config.stash[_MEMORY_TEMP_KEY] = basetemp


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_PASSED_KEY] = exitstatus == 0


def pytest_unconfigure(config):
    import shutil

    basetemp = config.stash.get(_MEMORY_TEMP_KEY, None)
    if basetemp is None:
        return
    if config.stash.get(_PASSED_KEY, False):
        shutil.rmtree(basetemp, ignore_errors=True)
    else:
        print(f"\ntest folders kept (they hold memory until the next run): {basetemp}")


# The files that take longest (seconds of one worker in a whole run, docs/performance.md), so
# that they start first: xdist hands out whole files (`--dist loadfile`) in collection order
# (`--no-loadscope-reorder`; by default it orders them by how many tests they hold, which put
# the four-test chaos file last), and a long file started late leaves the other workers idle
# at the end. A file not named here runs after these, in its usual order; a stale list costs
# minutes, never a result.
LONGEST_FIRST = [
    "test_chaos.py",
    "test_engines.py",
    "test_recipe_twins.py",
    "test_train.py",
    "test_multiprocess.py",
    "test_sage_user.py",
    "test_warm_launcher.py",
    "test_lora.py",
    "test_stopping.py",
    "test_ranks_diverge.py",  # four 2-rank FSDP twins on the stand-in vLLM: ~3 min
    "test_gpu_bundle_check.py",  # two clean venvs importing torch, lightning and rlver: 4-8 min
    "test_ablation.py",
    "test_capabilities.py",  # lm-eval and vLLM on the tiny model: ~70 s, the last file to end when unlisted
    "test_console.py",
    "test_distributed.py",
    "test_rollout.py",
    "test_semantic_user.py",
    "test_faults.py",
    "test_packaging.py",
    "test_fuzz.py",
    "test_models.py",
    "test_agreement.py",
    "test_rank_watch.py",
    "test_hang_watch.py",
    "test_local_shards.py",
    "test_rendezvous.py",
    "test_recipe_numerics.py",
    "test_rollout_schedule.py",
    "test_official_protocols.py",
    "test_cli.py",
    "test_sentient.py",
    "test_gpu_check.py",
    "test_plugins.py",
    "test_plan.py",
]


def pytest_collection_modifyitems(config, items):
    order = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: tests keep their order


# The environment once every test file is imported, before any test runs (`pytest_collection_finish`).
_SESSION_ENVIRONMENT: dict[str, str] = {}


def pytest_collection_finish(session):
    _SESSION_ENVIRONMENT.update(os.environ)


@pytest.fixture(scope="module", autouse=True)
def _each_file_leaves_the_sessions_environment():
    """Put back, after each test file, the environment the session's tests started with.

    Imports in this process change it: vLLM's (by a test or a session fixture such as an
    in-process engine) set TORCHINDUCTOR_COMPILE_THREADS, LD_PRELOAD and others. Carried into the
    files after it, every `rlver` launch from those would see an environment the warm launcher was
    not started in and start another one (~12 s of CPU; 5 times in a whole run). Modules already
    imported here keep what they read; launches get the session's environment.
    """
    yield
    if _SESSION_ENVIRONMENT:
        current_test = os.environ.get("PYTEST_CURRENT_TEST")  # pytest's own, removed by it later
        os.environ.clear()
        os.environ.update(_SESSION_ENVIRONMENT)
        if current_test is not None:
            os.environ["PYTEST_CURRENT_TEST"] = current_test


@pytest.fixture(scope="session")
def policy():
    """The real embedded SmolLM2 policy, loaded once per test session."""
    from rlver.modeling.models import load_policy

    return load_policy("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(policy):
    return policy.tokenizer


_launcher = None


def _warm_launcher():
    global _launcher
    if _launcher is None:
        import atexit

        from tests.harness.warm_launcher import WarmLauncher

        _launcher = WarmLauncher(str(REPO))
        atexit.register(_launcher.close)
    return _launcher


def run_rlver(argv, *, cwd=REPO, env=None, timeout=1800, fresh=False, file_size_limit=None):
    """`rlver <argv>` in a new process, as `subprocess.run(capture_output=True, text=True)`.

    Forked from this worker's warm launcher (tests/harness/warm_launcher.py: the imports already made,
    about 7 s a launch saved) unless `fresh` or the launch could depend on import-time state.
    The timeout only catches a hang (it raises subprocess.TimeoutExpired). `file_size_limit`:
    the process's RLIMIT_FSIZE in bytes (a full disk's failed writes).
    """
    env = os.environ if env is None else env
    launcher = _warm_launcher()
    return launcher.run(argv, cwd=cwd, env=env, timeout=timeout, fresh=fresh, file_size_limit=file_size_limit)


def start_rlver(argv, *, cwd, env, new_session=False, fresh=False):
    """`rlver <argv>` in the background, as `subprocess.Popen(stdout=PIPE, stderr=STDOUT, text=True)`
    (`new_session`: in a process group of its own); warm as `run_rlver` is."""
    return _warm_launcher().popen(argv, cwd=cwd, env=env, new_session=new_session, fresh=fresh)


def run_cli(*args, env=None, check=False):
    """Run `rlver <args>` in a new process from the repo root; `env` adds variables."""
    result = run_rlver(args, env=None if env is None else {**os.environ, **env})
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, result.args, result.stdout, result.stderr)
    return result


def make_tiny_model(folder, max_position_embeddings=4096):
    """A 2-layer Llama with the embedded model's tokenizer, chat template and generation config.

    Random weights, a few MB: multi-process and recipe tests exercise the machinery
    (collectives, checkpoints, engines) without paying for the 135M model's maths.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from rlver.modeling.models import resolve_model_path

    source = resolve_model_path("smollm2-135m-instruct")
    base = LlamaConfig.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=base.vocab_size,
        hidden_size=128,  # head_dim 64: the smallest vLLM's CPU attention takes
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    GenerationConfig.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def server():
    """The scripted OpenAI-compatible user on 127.0.0.1 (recorded answers, real sockets)."""
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    with ScriptedServer(Script()) as running:
        yield running


def small_llama():
    """A 1-layer Llama with a 512-word vocabulary, seed 0: bf16 work on it stays cheap anywhere."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)
