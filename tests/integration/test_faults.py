"""Faults from outside: a flaky simulator endpoint, and one that dies, under a 2-process run.

The scripted server (a real HTTP server on 127.0.0.1) fails 30% of requests at random with
every failure a real endpoint shows; the run must complete, count each failure exactly, and
keep every failed dialogue out of the loss. An endpoint that goes away mid-run must end the
run after the retry budget with one error and a checkpoint of the last finished step.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from rlver.checkpoint.io import read_checkpoint_state
from tests.integration.test_multiprocess import launch, lay_out_data, read_scalars, run_fit, twin_config

pytestmark = pytest.mark.slow

RECIPE = "grpo_nothink"  # the paper's recipe twin: sage user, FSDP, 2 processes


def faulty_twin(workdir, model_dir, url, steps, **simulator):
    config = twin_config(RECIPE, workdir, model_dir, url, steps=steps)
    twin = yaml.safe_load(config.read_text())
    # Only training talks with the server, so its counters are the TensorBoard ones.
    twin["trainer"].update(num_sanity_val_steps=0, limit_val_batches=0)
    twin["model"]["simulator"].update(simulator)
    config.write_text(yaml.safe_dump(twin, sort_keys=False, allow_unicode=True))
    return config


def transcripts(workdir, ranks=2):
    folder = workdir / "runs" / RECIPE / "tensorboard" / "rollouts"
    return [
        json.loads(line)
        for rank in range(ranks)
        for line in (folder / f"train_rank{rank}.jsonl").read_text().splitlines()
    ]


def test_thirty_percent_faulty_requests_are_counted_exactly_and_never_trained_on(tmp_path, tiny_model_dir):
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    # A timed-out answer comes 2.5x past the client's limit, a slow one 20x inside it: wide
    # margins, so how fast this machine is cannot move an answer from one kind to the other.
    # Each kind the checks below need is also scheduled once, on the run's first plan and reply
    # calls (the marker "" is in every dialogue's prompt): the random draws come from each
    # request's content, i.e. from what the policy said, which another CPU's arithmetic or
    # another sampler changes, and then a kind could be missing from ~35 draws.
    scheduled = {
        ("", "plan", 1): "500",
        ("", "reply", 1): "429",
        ("", "plan", 2): "timeout",
        ("", "reply", 2): "garbage",
        ("", "plan", 3): "no_change",
    }
    script = Script(faults=scheduled, fault_rate=0.3, fault_seed=1, timeout_delay=10.0, slow_delay=0.2)
    lay_out_data(tmp_path)
    with ScriptedServer(script) as server:
        config = faulty_twin(
            tmp_path,
            tiny_model_dir,
            server.url,
            steps=3,
            timeout=4.0,
            max_retries=1,
            backoff_seconds=0.05,
            backoff_max_seconds=0.1,
            max_reasks=1,
        )
        started = time.monotonic()
        run_fit(tmp_path, "--config", config)
        print(f"3 steps in {time.monotonic() - started:.0f} s; served {dict(script.served)}")

    scalars = read_scalars(tmp_path / "runs" / RECIPE / "tensorboard")

    def total(tag):
        return sum(scalars.get(tag, []))

    served = script.served
    faults = sum(v for k, v in served.items() if k != "ok")
    assert faults >= 0.2 * sum(served.values()), served  # about 30% (slow answers among them)
    assert {"500", "429", "timeout", "garbage", "no_change"} <= set(served), served
    assert total("simulator/requests") == sum(served.values())
    # Transport failures: each retried one by its kind, each final one as a failed request.
    transport = sum(served[k] for k in ("429", "500", "503", "timeout", "garbage"))
    counted = sum(total(f"simulator/{k}") for k in ("http_429", "http_500", "http_503", "timeouts"))
    assert counted + total("simulator/failed_requests") == transport
    # Unreadable answers: each re-asked, or (the last try) counted as unparsed.
    malformed = served["no_change"] + served["words"]
    assert total("simulator/reasks") + total("simulator/unparsed_answers") == malformed

    records = transcripts(tmp_path)
    failed = [r for r in records if r["termination"] == "simulator_error"]
    assert len(records) == 3 * 2 * 4  # 3 steps x 2 ranks x (1 profile x 4 dialogues)
    assert 0 < len(failed) < len(records)
    assert total("rollout/simulator_errors") == len(failed) == total("simulator/dialogue_errors")
    # Every dialogue that did not fail trains; none that failed does.
    assert total("rollout/trained_dialogues") == len(records) - len(failed)


def test_an_endpoint_that_dies_ends_the_run_with_one_error_and_a_checkpoint(tmp_path, tiny_model_dir):
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    lay_out_data(tmp_path)
    server = ScriptedServer(Script()).__enter__()
    config = faulty_twin(
        tmp_path,
        tiny_model_dir,
        server.url,
        steps=500,
        timeout=1.0,
        max_retries=2,
        backoff_seconds=0.05,
        backoff_max_seconds=0.1,
        max_failures_in_a_row=4,
    )
    rollouts = tmp_path / "runs" / RECIPE / "tensorboard" / "rollouts" / "train_rank0.jsonl"
    process = launch(tmp_path, config)
    deadline = time.monotonic() + 1200
    while not (rollouts.exists() and rollouts.read_text().strip()):
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.1)
    server.__exit__(None, None, None)  # the endpoint goes away: connections are refused
    try:
        output, _ = process.communicate(timeout=1800)
    except Exception:
        process.kill()
        raise
    assert process.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("rlver fit: error:")]
    assert len(errors) == 1 and "looks down" in errors[0] and "max_failures_in_a_row: 4" in errors[0], output
    assert "Traceback" not in output, output[-3000:]
    checkpoint = tmp_path / "runs" / RECIPE / "checkpoints" / "last.ckpt"
    finished = {r["step"] for r in transcripts(tmp_path)}
    assert read_checkpoint_state(checkpoint)["global_step"] == len(finished) >= 1
    assert finished == set(range(len(finished)))
