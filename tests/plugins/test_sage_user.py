"""The `sage` LLM-played user against real HTTP servers on 127.0.0.1.

The scripted server (rlver_plugins.sage_user.scripted_server) answers over real
sockets and injects faults on a schedule; the slow tests also start a real
`vllm serve` whose user model is a 2-layer Llama with SmolLM2's tokenizer and chat template.
"""

import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from rlver_plugins.sage_user import SageUserSimulator
from rlver_plugins.sage_user.client import EndpointConfigError
from rlver_plugins.sage_user.parsing import ParseFailure, parse_planning, parse_reply
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer, call_kind
from rlver_plugins.sage_user.simulator import says_goodbye

from rlver.core.emotion import DIFFICULTIES
from rlver.core.types import Profile
from tests.conftest import REPO, make_tiny_model, run_cli

# A timeout no answer of the scripted server nears, however loaded the machine (its injected
# "timeout" fault waits longer): a request lost to load would change the counts the tests check.
FAST = {"timeout": 3.0, "backoff_seconds": 0.01, "backoff_max_seconds": 0.02}
EMPATHIC = "I understand, and I'm sorry. That sounds hard and I can feel how much it matters."
SECRET = "sk-rlver-test-6f1d2c9a"


def person(name, first_talk="Hi, got a minute?", **extra):
    return Profile(
        f"id-{name}",
        f"* Name: {name}\n* Job: baker",
        f"{name}'s bakery is failing and a friend walked away from the partnership.",
        "passive",
        ("a", "b", "c"),
        "You want deep empathy for what you feel, not shallow comfort.",
        first_talk=first_talk,
        extra=extra,
    )


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("text", "change"),
    [
        ("Content: x\nChange: +4", 4),
        ("Content: x\nChange: -6", -6),
        ("Content: x\nChange：-3", -3),  # full-width colon
        ("Content: x\n**Change:** [+5]", 5),  # Markdown bold and brackets
        ("Content: x\nChange：【－７】", -7),  # full-width sign and brackets
        ("Content: x\nChange: ＋３", 3),  # full-width digits
        ("Content: x\nChange: \u22128", -8),  # the Unicode minus sign
        ("Content: x\nChange:\n  +2 (from 40 to 42)", 2),  # value on the next line; first integer wins
        ("content: x\n- change: 0", 0),
    ],
)
def test_planning_change_is_read_from_loose_layouts(text, change):
    assert parse_planning(text).change == change


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("Content: x\nAnalyse: fine", "missing"),
        ("Content: x\nChange: slightly negative", "signed integer"),
        ("Content: x\nChange: minus five", "signed integer"),
        ("Content: x\nChange:", "signed integer"),
        ("I feel better now, +5", "missing"),  # a number, but not in the field
    ],
)
def test_planning_without_a_readable_change_fails(text, problem):
    with pytest.raises(ParseFailure, match=problem):
        parse_planning(text)


@pytest.mark.parametrize(
    "text",
    ["Content: x\nChange：-3", "Content: x\n**Change:** [+5]", "Content: x\nChange: ＋３", "Change:\n +2"],
)
def test_strict_parsing_reasks_every_loose_layout(text):
    parse_planning(text)  # readable by default
    with pytest.raises(ParseFailure, match="exactly as 'Change: <signed integer>'"):
        parse_planning(text, strict=True)
    assert parse_planning("Content: x\nChange: -3", strict=True).change == -3


def test_planning_fields_are_split():
    planning = parse_planning(
        "Content: asks about the bakery\nTargetCompletion: partly\nActivity: I soften\n"
        "Analyse: a bit better\nChange: +3"
    )
    assert planning.content == "asks about the bakery"
    assert planning.target_completion == "partly"
    assert planning.activity == "I soften"
    assert planning.analyse == "a bit better"
    assert planning.record(3.0)["TargetCompletion"] == "partly"


def test_json_answers_are_read_by_their_keys():
    planning = parse_planning(
        '{"content": "asks", "target_completion": "partly", "analyse": "ok", "change": -3}'
    )
    assert (planning.change, planning.target_completion, planning.analyse) == (-3, "partly", "ok")
    assert parse_planning('```json\n{"Change": "+4"}\n```').change == 4
    reply = parse_reply('{"thinking": "calm", "origin": "x", "revision": "y", "response": "Fine."}')
    assert (reply.thinking, reply.response) == ("calm", "Fine.")
    with pytest.raises(ParseFailure, match="not valid JSON"):
        parse_planning('{"change": 3')
    with pytest.raises(ParseFailure, match="missing"):
        parse_planning('{"content": "no change here"}')
    with pytest.raises(ParseFailure, match="signed integer"):
        parse_planning('{"change": "a little"}')


def test_reply_response_keeps_the_users_punctuation():
    reply = parse_reply("Thinking: calm\nOrigin: draft\nChange: shorter\nResponse: “好吧，谢谢你。”")
    assert reply.response == "好吧，谢谢你。"
    assert reply.thinking == "calm"
    with pytest.raises(ParseFailure, match="missing"):
        parse_reply("Thinking: calm\nOrigin: draft")
    with pytest.raises(ParseFailure, match="empty"):
        parse_reply("Thinking: calm\nResponse:  ")


def test_goodbye_detection():
    assert says_goodbye("Okay. Bye!")
    assert says_goodbye("Thanks, good bye")
    assert says_goodbye("好的，再见。")
    assert not says_goodbye("By the way, maybe.")
    assert not says_goodbye("Goodbyes are hard for me")


# --------------------------------------------------------------------------- scripted server
def test_faults_are_retried_reasked_or_recorded_exactly_as_scheduled(monkeypatch):
    monkeypatch.setenv("RLVER_TEST_USER_KEY", SECRET)
    faults = {
        ("Ana", "plan", 1): "429",  # retried once
        ("Ben", "plan", 1): "words",  # re-asked once
        ("Cy", "reply", 1): "timeout",  # retried once
        ("Dee", "plan", 1): "no_change",  # re-asked twice, then a simulator error
        ("Dee", "plan", 2): "no_change",
        ("Dee", "plan", 3): "no_change",
        ("Eve", "open", 1): "500",  # the generated opening is retried once
        ("Fay", "plan", 1): "fullwidth",  # readable as it is: no re-ask (strict_parsing would re-ask)
        ("Gus", "plan", 1): "500",  # three failed attempts: a simulator error
        ("Gus", "plan", 2): "503",
        ("Gus", "plan", 3): "500",
        ("Hal", "reply", 1): "no_response",  # the reply step fails three times
        ("Hal", "reply", 2): "no_response",
        ("Hal", "reply", 3): "no_response",
    }
    names = ["Ana", "Ben", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal"]
    with ScriptedServer(Script(faults=faults, api_key=SECRET, timeout_delay=6.0)) as server:
        simulator = SageUserSimulator(
            server.url,
            "scripted-user",
            api_key_env="RLVER_TEST_USER_KEY",
            max_retries=2,
            max_reasks=2,
            **FAST,
        )
        profiles = [person(n, first_talk=None if n == "Eve" else "Hi, got a minute?") for n in names]
        sessions = [simulator.open(p, seed=i) for i, p in enumerate(profiles)]
        openings = simulator.opening_batch(sessions)
        first = dict(zip(names, simulator.respond_batch(sessions, [EMPATHIC] * len(names))))
        alive = [s for s, n in zip(sessions, names) if not first[n].done]
        second = simulator.respond_batch(alive, ["Tell me more."] * len(alive))
        metrics = simulator.drain_metrics()
        simulator.close()

    assert openings[4].text and openings[4].reason["source"] == "generated"
    assert openings[4].reason["retries"] == 1
    failed = {n for n, turn in first.items() if turn.termination == "simulator_error"}
    assert failed == {"Dee", "Gus", "Hal"}
    for name in failed:  # no made-up emotion: it stays where it was, with the reason recorded
        assert first[name].emotion == 40.0 and first[name].change == 0.0 and first[name].text == ""
    assert "after 3 attempts" in first["Gus"].reason["error"]
    assert "'Change:' field is missing" in first["Dee"].reason["error"]
    assert "'Response:' field is missing" in first["Hal"].reason["error"]
    assert first["Ana"].reason["retries"] == 1
    assert first["Ben"].reason["reasks"] == 1
    assert first["Cy"].reason["retries"] == 1
    assert first["Dee"].reason["reasks"] == 2
    assert first["Hal"].reason["reasks"] == 2
    assert first["Gus"].reason["retries"] == 2
    assert first["Fay"].change == 3.0 and "reasks" not in first["Fay"].reason
    for name in ("Ana", "Ben", "Cy", "Eve"):
        assert first[name].change == 9.0  # the scripted user rewards the empathic reply
        assert first[name].reason["planning"]["change"] == 9.0
        assert first[name].emotion == 49.0
    assert all(turn.change == -4.0 for turn in second)
    assert metrics["retries"] == 5  # Ana 1, Cy 1, Eve 1, Gus 2
    assert metrics["http_429"] == 1
    assert metrics["http_500"] == 2 and metrics["http_503"] == 1
    assert metrics["timeouts"] == 1
    assert metrics["reasks"] == 5  # Ben 1, Dee 2, Hal 2
    assert metrics["unparsed_answers"] == 2
    assert metrics["failed_requests"] == 1
    assert metrics["dialogue_errors"] == 3
    assert server.script.served["ok"] + sum(
        count for fault, count in server.script.served.items() if fault != "ok"
    ) == len(server.script.requests)
    # the key went only into the Authorization header
    assert all(h.get("Authorization") == f"Bearer {SECRET}" for h in server.script.headers)
    assert SECRET not in repr(simulator)
    assert simulator.drain_metrics() == {}  # drained


def test_a_wrong_key_is_one_clear_error_without_the_key(monkeypatch):
    monkeypatch.setenv("RLVER_TEST_USER_KEY", "sk-wrong-key-123")
    with ScriptedServer(Script(api_key=SECRET)) as server:
        simulator = SageUserSimulator(server.url, "scripted-user", api_key_env="RLVER_TEST_USER_KEY", **FAST)
        session = simulator.open(person("Ana"), seed=0)
        simulator.opening_batch([session])
        with pytest.raises(EndpointConfigError, match="HTTP 401") as error:
            simulator.respond_batch([session], ["Hello."])
        assert "sk-wrong-key-123" not in str(error.value)
        assert len(server.script.requests) == 0  # rejected before the script ran, and not retried
        simulator.close()


def test_a_pickled_simulator_rebuilds_its_client_and_never_carries_the_key(monkeypatch):
    import pickle

    monkeypatch.setenv("RLVER_TEST_USER_KEY", SECRET)
    with ScriptedServer(Script(api_key=SECRET)) as server:
        original = SageUserSimulator(server.url, "scripted-user", api_key_env="RLVER_TEST_USER_KEY", **FAST)
        data = pickle.dumps(original)  # what a spawned training process receives
        original.close()
        assert SECRET.encode() not in data and b"RLVER_TEST_USER_KEY" in data
        copy = pickle.loads(data)
        session = copy.open(person("Ana"), seed=0)
        copy.opening_batch([session])
        turn = copy.respond_batch([session], [EMPATHIC])[0]
        copy.close()
    assert turn.change == 9.0 and turn.termination is None


def test_missing_key_variable_and_bad_options_fail_at_construction(monkeypatch):
    monkeypatch.delenv("RLVER_NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match="api_key_env: the environment variable RLVER_NO_SUCH_KEY"):
        SageUserSimulator("http://127.0.0.1:9/v1", "m", api_key_env="RLVER_NO_SUCH_KEY")
    with pytest.raises(ValueError, match=r"base_url .* must start with http"):
        SageUserSimulator("127.0.0.1:9/v1", "m")
    with pytest.raises(ValueError, match="cache_only needs cache"):
        SageUserSimulator("http://127.0.0.1:9/v1", "m", cache_only=True)
    with pytest.raises(ValueError, match="difficulty"):
        SageUserSimulator("http://127.0.0.1:9/v1", "m", difficulty="brutal")


def test_an_unreachable_endpoint_ends_dialogues_after_bounded_retries():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    simulator = SageUserSimulator(f"http://127.0.0.1:{port}/v1", "m", max_retries=3, **FAST)
    sessions = [simulator.open(person(n), seed=0) for n in ("Ana", "Ben")]
    simulator.opening_batch(sessions)
    turns = simulator.respond_batch(sessions, ["Hello."] * 2)
    metrics = simulator.drain_metrics()
    simulator.close()
    assert [t.termination for t in turns] == ["simulator_error"] * 2
    assert metrics["connection_errors"] == 6 and metrics["failed_requests"] == 2


def test_calls_of_all_dialogues_run_concurrently_within_the_limit():
    profiles = [person(f"P{i}") for i in range(8)]
    for limit, expected in ((32, 8), (3, 3)):
        with ScriptedServer(Script(latency=0.3)) as server:
            simulator = SageUserSimulator(
                server.url, "scripted-user", max_concurrency=limit, **FAST | {"timeout": 5}
            )
            sessions = [simulator.open(p, seed=i) for i, p in enumerate(profiles)]
            simulator.opening_batch(sessions)
            simulator.respond_batch(sessions, [EMPATHIC] * len(sessions))
            simulator.close()
            assert server.script.max_in_flight == expected
            assert len(server.script.requests) == 16  # planning + reply per dialogue


def test_requests_per_second_limits_the_pace():
    # aiolimiter lets a burst of `rate` through, then paces: 12 requests at 4/s span >= 2 s.
    with ScriptedServer(Script()) as server:
        simulator = SageUserSimulator(
            server.url, "scripted-user", requests_per_second=4, **FAST | {"timeout": 5}
        )
        sessions = [simulator.open(person(f"P{i}"), seed=i) for i in range(6)]
        simulator.opening_batch(sessions)
        started = time.monotonic()
        simulator.respond_batch(sessions, [EMPATHIC] * 6)
        elapsed = time.monotonic() - started
        simulator.close()
    assert len(server.script.requests) == 12
    assert elapsed >= 1.5


def test_success_ends_with_a_goodbye_and_difficulty_comes_from_the_profile():
    near_the_top = person("Ana", difficulty={"base": "normal", "start": 95})
    hard = person("Ben", difficulty="hard")
    chinese = person("Cy", first_talk="最近烦死了。", lang="zh")
    with ScriptedServer(Script()) as server:
        simulator = SageUserSimulator(server.url, "scripted-user", **FAST)
        sessions = [simulator.open(p, seed=0) for p in (near_the_top, hard, chinese)]
        openings = simulator.opening_batch(sessions)
        turns = simulator.respond_batch(sessions, [EMPATHIC] * 3)
        simulator.close()
        requests = server.script.requests
    assert [o.emotion for o in openings] == [95.0, DIFFICULTIES["hard"].start, 40.0]
    assert turns[0].emotion == 100.0 and turns[0].change == 5.0  # +9 asked, capped at 100
    assert turns[0].termination == "success" and "Goodbye" in turns[0].text
    reply_prompts = [r["messages"][1]["content"] for r in requests if call_kind(r["messages"]) == "reply"]
    assert sum("say goodbye" in p for p in reply_prompts) == 1
    systems = [r["messages"][0]["content"] for r in requests]
    assert any("demanding" in s and "Ben" in s for s in systems)  # hard wording for the hard profile
    assert any("你在扮演" in s and "Cy" in s for s in systems)  # Chinese prompt set for a Chinese profile
    assert sessions[1].difficulty.name == "hard"
    assert turns[1].change == 9.0  # hard: no clamp and, by default, no scaling of the model's change


def test_scale_changes_applies_the_levels_scales():
    with ScriptedServer(Script()) as server:
        simulator = SageUserSimulator(
            server.url, "scripted-user", difficulty="hard", scale_changes=True, **FAST
        )
        session = simulator.open(person("Ana"), seed=0)
        simulator.opening_batch([session])
        turn = simulator.respond_batch([session], [EMPATHIC])[0]
        simulator.close()
    assert turn.change == pytest.approx(9.0 * DIFFICULTIES["hard"].positive_scale)


def test_json_schema_format_sends_schemas_and_reads_json_answers():
    with ScriptedServer(Script()) as server:
        simulator = SageUserSimulator(server.url, "scripted-user", response_format="json_schema", **FAST)
        sessions = [simulator.open(person("Ana", first_talk=None), seed=0)]
        simulator.opening_batch(sessions)
        turn = simulator.respond_batch(sessions, [EMPATHIC])[0]
        simulator.close()
        requests = server.script.requests
    assert turn.change == 9.0 and turn.text and turn.termination is None
    assert [r["response_format"]["json_schema"]["name"] for r in requests] == ["opening", "planning", "reply"]
    change = requests[1]["response_format"]["json_schema"]["schema"]["properties"]["change"]
    assert change == {"type": "integer", "minimum": -10, "maximum": 10}  # the normal level's clamp
    assert requests[1]["messages"][-1]["content"].endswith(
        "keys: content, target_completion, activity, analyse, change."
    )


def test_the_cache_replays_a_run_without_the_endpoint(tmp_path):
    cache = tmp_path / "answers.sqlite"
    profiles = [person("Ana"), person("Ben", first_talk=None)]

    def run(url, **options):
        simulator = SageUserSimulator(url, "scripted-user", cache=str(cache), **FAST, **options)
        sessions = [simulator.open(p, seed=7) for p in profiles]
        turns = [simulator.opening_batch(sessions)]
        turns.append(simulator.respond_batch(sessions, [EMPATHIC, "Hm."]))
        turns.append(simulator.respond_batch(sessions, ["Go on.", "Why?"]))
        metrics = simulator.drain_metrics()
        simulator.close()
        return [[(t.text, t.emotion, t.termination) for t in batch] for batch in turns], metrics

    with ScriptedServer(Script()) as server:
        recorded, first_metrics = run(server.url)
        url = server.url
    replayed, metrics = run(url, cache_only=True)  # the server is gone
    assert replayed == recorded
    assert metrics["cache_hits"] == first_metrics["requests"] == 9
    assert "requests" not in metrics
    simulator = SageUserSimulator(url, "scripted-user", cache=str(cache), cache_only=True, **FAST)
    session = simulator.open(profiles[0], seed=8)  # another seed: requests the cache never saw
    simulator.opening_batch([session])
    turn = simulator.respond_batch([session], [EMPATHIC])[0]
    simulator.close()
    assert turn.termination == "simulator_error" and "no cached answer" in turn.reason["error"]


# --------------------------------------------------------------------------- end to end
def _files_containing(root, needle):
    found = []
    for path in Path(root).rglob("*"):
        if path.is_file() and needle.encode() in path.read_bytes():
            found.append(path)
    return found


@pytest.mark.slow
def test_training_with_failing_user_completes_and_never_writes_the_key(tmp_path, tiny_model_dir):
    """The tiny model trains (the faults and the files are the point; test_train.py trains SmolLM2)."""
    from tests.integration.test_train import read_scalars

    train = tmp_path / "train.jsonl"
    train.write_text(
        "\n".join(json.dumps(person(name).to_record()) for name in ("Ana", "Gus")) + "\n", encoding="utf-8"
    )
    faults = {("Gus", "plan", n): "500" for n in range(1, 5)}  # both Gus dialogues: 2 attempts each
    faults[("Ana", "plan", 1)] = "429"
    faults[("Ana", "reply", 1)] = "words"
    root = tmp_path / "run"
    with ScriptedServer(Script(faults=faults, api_key=SECRET)) as server:
        config = tmp_path / "sage.yaml"
        config.write_text(
            textwrap.dedent(f"""
            seed_everything: 0
            trainer:
              accelerator: cpu
              devices: 1
              max_steps: 1
              limit_val_batches: 0
              log_every_n_steps: 1
              enable_progress_bar: false
              default_root_dir: {root}
              logger:
                class_path: lightning.pytorch.loggers.TensorBoardLogger
                init_args: {{save_dir: {root}, name: tb, version: ""}}
              callbacks:
                - class_path: lightning.pytorch.callbacks.ModelCheckpoint
                  init_args: {{dirpath: {root}/checkpoints, save_last: true, save_top_k: 0}}
            model:
              policy: {tiny_model_dir}
              engine: hf
              simulator:
                name: sage
                base_url: {server.url}
                model: scripted-user
                api_key_env: RLVER_TEST_USER_KEY
                max_retries: 1
                max_reasks: 1
                timeout: 5
                backoff_seconds: 0.01
                backoff_max_seconds: 0.02
              advantage: grpo
              group_size: 2
              rollout: {{max_turns: 2, max_new_tokens: 12}}
              log_samples_every_n_steps: 1
            data:
              train_files: [{train}]
              batch_size: 2
            """)
        )
        result = run_cli("fit", "--config", config, env={"RLVER_TEST_USER_KEY": SECRET})
        assert result.returncode == 0, result.stderr[-3000:]
    scalars = read_scalars(root / "tb")
    assert scalars["rollout/simulator_errors"][0][1] == 2.0  # both Gus dialogues, left out of the loss
    assert scalars["simulator/retries"][0][1] == 3.0  # Ana's 429 once, Gus twice (1 retry each)
    assert scalars["simulator/http_500"][0][1] == 2.0
    assert scalars["simulator/reasks"][0][1] == 1.0
    assert scalars["simulator/dialogue_errors"][0][1] == 2.0
    records = [
        json.loads(line) for line in (root / "tb" / "rollouts" / "train_rank0.jsonl").read_text().splitlines()
    ]
    assert sorted(r["termination"] for r in records if r["profile_id"] == "id-Gus") == ["simulator_error"] * 2
    assert all(r["termination"] != "simulator_error" for r in records if r["profile_id"] == "id-Ana")
    assert (root / "checkpoints" / "last.ckpt").exists()
    assert SECRET not in result.stdout + result.stderr
    assert _files_containing(root, SECRET) == []
    assert _files_containing(tmp_path, SECRET) == []
    assert "RLVER_TEST_USER_KEY" in (root / "tb" / "config.yaml").read_text()  # the name is kept


# --------------------------------------------------------------------------- a real vLLM server
def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_user_endpoint(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:  # not imported: vLLM's import changes the environment
        pytest.skip("needs vLLM (`vllm serve`)")
    # The server, its structured outputs and SAGE's prompts are the real ones; the user model is
    # sized for any CPU. SmolLM2 took 15-20 s to read each ~3-5k-token SAGE prompt here (2 cores
    # with AVX-512), minutes on a slower CPU, and no check reads what a real model writes: its
    # answers missed SAGE's text format as a random model's do, and structured outputs hold
    # either to the JSON schema or SAGE's regex.
    model_dir = make_tiny_model(tmp_path_factory.mktemp("user-model"), max_position_embeddings=8192)
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm_server") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny-user",
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--max-model-len", "8192", "--dtype", "float32",  # SAGE's Chinese prompts: ~5k tokens
        "--kv-cache-memory-bytes", str(64 * 2**20),  # 64k of its tokens (1 KiB each); every start writes it all
        "--no-enable-chunked-prefill",  # vLLM 0.32 CPU: seeded requests crash after a chunked prefill
        # JSON as compact as a chat model writes it: the grammar's optional whitespace let a random
        # model pad an answer with blanks up to max_tokens (cut off: not JSON).
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
        # Two processes, not three: the engine's worker in its core process (`uni`), and that core
        # beside the API server (below), each a fresh interpreter importing vLLM (~10 s of CPU each).
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the size asked for
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 1800  # a hang guard, not a speed requirement
    try:
        while True:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited ({server.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up in 1800 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.mark.slow
@pytest.mark.parametrize("response_format", ["text", "json_schema"])
def test_dialogues_against_a_real_vllm_server(tmp_path, vllm_user_endpoint, response_format):
    """The served model does not follow SAGE's text format (SmolLM2 rarely did either): the parse
    / re-ask / error path must hold; with the server's structured outputs every answer is
    readable and the emotion really moves."""
    config = tmp_path / "rollout.yaml"
    config.write_text(
        textwrap.dedent(f"""
        model:
          engine: hf
          simulator:
            name: sage
            base_url: {vllm_user_endpoint}
            model: tiny-user
            language: en
            max_tokens: {64 if response_format == "text" else 400}
            response_format: {response_format}
            field_max_chars: {120 if response_format == "text" else 24}
            timeout: 1800  # a hang guard, not a speed requirement
            max_retries: 1
            max_reasks: 1
          rollout: {{max_turns: 2, max_new_tokens: 24}}
        data:
          test_files: [builtin:en_test]
        """)
    )
    out = tmp_path / "dialogues.jsonl"
    # Two users: a batch of concurrent dialogues (the recorded-answer tests cover larger ones).
    result = run_cli("rollout", "--config", config, "--split", "test", "--limit", "2", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)  # the summary and simulator counters, shown with `pytest -s`
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    counters = {}
    for line in result.stdout.splitlines():
        if line.startswith("simulator ") and not line.startswith("simulator errors"):
            name, value = line.split()[1:3]
            counters[name] = float(value)
    assert counters["requests"] >= 2  # at least one planning call per dialogue reached the server
    errors = 0
    reasks = 0
    for record in records:
        assert record["termination"] in {"simulator_error", "max_turns", "success", "failure", "goodbye"}
        users = [turn for turn in record["turns"] if turn["role"] == "user"]
        for before, after in itertools.pairwise(users):
            reasks += after["reason"].get("reasks", 0)
            if "planning" in after["reason"]:  # a parsed turn: the emotion moved by the applied change
                assert abs(after["change"]) <= 10
                assert after["reason"]["planning"]["change"] == after["change"]
                assert after["emotion"] == pytest.approx(
                    min(100, max(0, before["emotion"] + after["change"]))
                )
                assert after["text"]
            else:  # a failed turn: recorded, emotion untouched, the dialogue ended there
                assert after["reason"]["error"]
                assert after["emotion"] == before["emotion"] and after["text"] == ""
                assert after is users[-1] and record["termination"] == "simulator_error"
        errors += record["termination"] == "simulator_error"
    assert f"simulator errors    {errors}" in result.stdout
    assert counters.get("reasks", 0) == reasks
    assert counters.get("dialogue_errors", 0) == errors
    if response_format == "json_schema":
        assert errors == 0 and reasks == 0
        assert all(record["termination"] != "simulator_error" for record in records)
        assert all(record["num_turns"] >= 1 for record in records)


@pytest.mark.slow
def test_the_policys_thinking_never_reaches_the_user_model(policy):
    from rlver_plugins.formats import ThinkFormat

    from rlver.core.interfaces import Generation, RolloutEngine
    from rlver.rollout.runner import RolloutRunner, RolloutSettings
    from rlver.rollout.transcripts import to_sage_record

    class FixedReplyEngine(RolloutEngine):
        """Answers every prompt with the same thinking-format completion."""

        def generate(self, prompts, sampling):
            ids = policy.tokenizer("<think>SECRET-PLAN-42</think>I hear you, that sounds hard.")["input_ids"]
            ids = [*ids, policy.stop_token_ids[0]]
            return [Generation(tuple(ids), tuple([0.0] * len(ids)), "stop") for _ in prompts]

    with ScriptedServer(Script()) as server:
        simulator = SageUserSimulator(server.url, "scripted-user", **FAST)
        runner = RolloutRunner(
            policy,
            FixedReplyEngine(),
            simulator,
            ThinkFormat(),
            RolloutSettings(max_turns=3, max_new_tokens=64),
        )
        trajectories = runner.run([person("Ana"), person("Ben")])
        simulator.close()
        sent = json.dumps(server.script.requests)
    assert "I hear you, that sounds hard." in sent
    assert "SECRET-PLAN-42" not in sent and "<think>" not in sent
    for trajectory in trajectories:
        assert trajectory.termination == "max_turns" and trajectory.emotions == [40.0, 46.0, 52.0, 58.0]
        history = to_sage_record(trajectory)["history"]
        replies = [m for m in history if m["role"] == "assistant"]
        assert all(m["think"] == "SECRET-PLAN-42" and "SECRET" not in m["content"] for m in replies)


SAGE_PROTOCOL = REPO.parent / "shared" / "sage-protocol"


@pytest.mark.slow
@pytest.mark.skipif(not SAGE_PROTOCOL.is_dir(), reason="needs ../shared/sage-protocol (SAGE's code)")
def test_rlver_test_with_sages_own_code_against_a_real_vllm_server(tmp_path, vllm_user_endpoint):
    """`rlver test` with `sage_official`: SAGE's prompts to the user model behind `vllm serve`, 1
    user x 1 turn; the server's structured outputs hold each answer to the format SAGE's parser reads.

    Sized for any CPU: the request timeout is a hang guard (30 min), never a speed requirement;
    the work is SAGE's ~3-5k-token prompts to a 2-layer model, for one user and one turn: every
    call kind (opening, plan, reply) is in it. A second user and a second turn only repeated
    them with a longer history; SAGE's own code playing several users over several turns is
    checked against recorded answers (test_sentient.py, test_official_protocols.py)."""
    from rlver.data.profiles import resolve_profile_path

    # The benchmark's user whose profile is shortest: its ~5k-token prompts are the cost of this test.
    rows = resolve_profile_path("builtin:sentient_test").read_text(encoding="utf-8").splitlines()
    users = tmp_path / "shortest_user.jsonl"
    users.write_text(min(rows, key=len) + "\n", encoding="utf-8")
    root = tmp_path / "run"
    config = tmp_path / "official.yaml"
    config.write_text(
        textwrap.dedent(f"""
        trainer: {{accelerator: cpu, devices: 1, precision: 32-true, default_root_dir: {root}, limit_test_batches: 1}}
        model:
          policy: smollm2-135m-instruct
          engine: hf
          simulator:
            name: sage_official
            code: {SAGE_PROTOCOL}
            base_url: {vllm_user_endpoint}
            model: tiny-user
            response_format: regex
            field_max_chars: 24
            max_tokens: 400
            timeout: 1800
            max_retries: 1
          prompt_format: nothink
          rollout: {{max_turns: 1, max_new_tokens: 24, max_context_tokens: 8192}}
        data:
          test_files: [{users}]
          batch_size: 1
        """)
    )
    result = run_cli("test", "--config", config)
    assert result.returncode == 0, result.stderr[-3000:]
    records_path = next(root.rglob("sentient/*.jsonl"))
    records = [json.loads(line) for line in records_path.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 1
    moved = 0
    for record in records:
        spoken = [m for m in record["history"] if m["role"] == "user"]
        assert spoken[0]["emotion-point"] == 40 and len(spoken) == 2  # the opening and one reaction
        for before, after in itertools.pairwise(spoken):
            change = after["planning"]["change"]
            assert abs(change) <= 10 and after["emotion-point"] == min(100, before["emotion-point"] + change)
            assert after["content"]
            moved += change != 0
    assert "Score" in result.stdout
    print(result.stdout, "emotion moved on", moved, "of 1 turn")


@pytest.mark.parametrize("language", ["en", "zh"])
def test_the_reply_call_sees_the_feeling_not_the_planning_content_or_number(language):
    """SAGE's reply call gets TargetCompletion, Activity and Analyse only; `Change:` must not leak."""
    with ScriptedServer(Script()) as server:
        simulator = SageUserSimulator(server.url, "scripted-user", language=language, **FAST)
        sessions = [simulator.open(person("Ana"), seed=0)]
        simulator.opening_batch(sessions)
        simulator.respond_batch(sessions, [EMPATHIC])
        simulator.close()
        requests = server.script.requests
    reply = requests[-1]["messages"][-1]["content"]
    assert call_kind(requests[-2]["messages"]) == "plan" and call_kind(requests[-1]["messages"]) == "reply"
    assert "somewhat understood" in reply and "I weigh whether they get me" in reply and "partly" in reply
    assert "the partner responds to my story" not in reply  # Content
    assert "Change: +" not in reply and "Change: -" not in reply  # the number
