"""One set of endpoint options for the `sage` user, SAGE's / the reference's own simulators and the
`dimensions` judge: the same names build the same EndpointSettings, one check names every
problem, and the names used before still work, with one warning each."""

from __future__ import annotations

import functools
import pickle
import textwrap
import warnings

import pytest
from rlver_plugins.llm_judge import DimensionJudge
from rlver_plugins.sage_user import SageOfficialSimulator, SageUserSimulator, endpoint
from rlver_plugins.sage_user.endpoint import EndpointSettings

from rlver.core.plugins import PluginError, get_registry

SHARED = {
    "base_url": "http://127.0.0.1:9/v1",
    "model": "m",
    "api_key_env": "RLVER_TEST_ENDPOINT_KEY",
    "temperature": 0.3,
    "top_p": 0.9,
    "max_tokens": 300,
    "seed": 7,
    "timeout": 5.0,
    "max_retries": 1,
    "backoff_seconds": 0.5,
    "backoff_max_seconds": 2.0,
    "max_failures_in_a_row": 3,
    "max_concurrency": 4,
    "requests_per_second": 10.0,
    "cache_only": False,
    "max_reasks": 1,
    "response_format": "text",
}
SECRET = "sk-endpoint-secret-42"


@pytest.fixture
def sage_code(tmp_path):
    """The smallest folder SAGE's loader accepts (no text of theirs needed to build a simulator)."""
    (tmp_path / "simulator_response.py").write_text(
        textwrap.dedent("""
        def planning_reply(player): return player
        def player_reply(player): return player
        def chat_player(player): return player
        """)
    )
    (tmp_path / "npc_response.py").write_text(
        textwrap.dedent("""
        def call_npc(history):
            return call_llm([{"role": "system", "content": "Be kind."}, *history])
        """)
    )
    return tmp_path


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each old name warns once per process: start these tests with none warned yet."""
    monkeypatch.setattr(endpoint, "_warned", set())


def _settings(client):
    return client.client.settings if hasattr(client, "client") else client._client.settings


def test_the_three_clients_take_the_same_names_and_hold_the_same_settings(tmp_path, sage_code, monkeypatch):
    monkeypatch.setenv("RLVER_TEST_ENDPOINT_KEY", SECRET)
    options = {**SHARED, "cache": str(tmp_path / "answers.sqlite")}
    clients = [
        SageUserSimulator(**options),
        SageOfficialSimulator(code=str(sage_code), **options),
        DimensionJudge(**options),
    ]
    try:
        expected = EndpointSettings(**options)
        for client in clients:
            assert _settings(client) == expected, type(client).__name__
            assert SECRET not in repr(client) and SECRET not in repr(_settings(client))
    finally:
        for client in clients:
            client.close()
    # The settings hold the variable's name; only api_key() reads the key.
    assert "RLVER_TEST_ENDPOINT_KEY" in repr(expected) and expected.api_key() == SECRET


def test_flat_configs_of_the_three_kinds_pass_the_registry_with_the_same_names(tmp_path, sage_code):
    registry = get_registry()
    options = {**SHARED, "api_key_env": None, "cache": str(tmp_path / "c.sqlite")}
    registry.check("simulators", {"name": "sage", **options}, flag="--model.simulator")
    registry.check("simulators", {"name": "sage_official", "code": str(sage_code), **options}, flag="--s")
    registry.check("judges", {"name": "dimensions", **options}, flag="--judge")
    # An old name passes the check (the plugin maps it); a typo is still refused, by its flag.
    registry.check(
        "simulators", {"name": "sage", "base_url": "http://x", "model": "m", "cache_path": "c"}, flag="-s"
    )
    with pytest.raises(PluginError, match=r"--judge.cache_pth: unknown option; accepted: .*\bcache\b"):
        registry.check("judges", {"name": "dimensions", "cache_pth": "c"}, flag="--judge")


def test_one_check_names_every_problem_by_its_option(monkeypatch):
    monkeypatch.delenv("RLVER_NO_SUCH_KEY", raising=False)
    bad = EndpointSettings(
        base_url="127.0.0.1:8000/v1",
        model="m",
        api_key_env="RLVER_NO_SUCH_KEY",
        timeout=0,
        max_retries=-1,
        max_reasks=-2,
        max_concurrency=0,
        requests_per_second=0,
        cache_only=True,
        response_format="yaml",
    )
    problems = bad.problems(("text", "json_object"))
    assert [problem.split(" ")[0].rstrip(":") for problem in problems] == [
        "base_url",
        "api_key_env",
        "timeout",
        "max_retries",
        "max_reasks",
        "max_concurrency",
        "requests_per_second",
        "cache_only",
        "response_format",
    ]
    assert "response_format ('yaml') must be one of text, json_object" in problems
    with pytest.raises(ValueError) as error:
        bad.check("judge", ("text",), ["dimensions: odd"])
    message = str(error.value)
    assert message.startswith("judge: base_url ") and message.endswith("; dimensions: odd")
    assert message.count(";") == len(problems)  # one error, every problem in it
    EndpointSettings(base_url="https://example.org/v1", model="m").check("anyone")  # the defaults pass


@pytest.mark.parametrize(
    "kind, owner, formats",
    [
        ("sage", "sage simulator", "text, json_schema"),
        ("judge", "judge", "text, json_object"),
        ("sage_official", "sage_official simulator", "text, regex"),
    ],
)
def test_the_same_mistakes_read_the_same_in_every_client(kind, owner, formats, sage_code):
    build = {
        "sage": SageUserSimulator,
        "judge": DimensionJudge,
        "sage_official": functools.partial(SageOfficialSimulator, code=str(sage_code)),
    }[kind]
    with pytest.raises(ValueError) as error:
        build(
            base_url="http://127.0.0.1:9/v1", model="m", max_reasks=-1, cache_only=True, response_format="xml"
        )
    assert str(error.value) == (
        f"{owner}: max_reasks (-1) must be >= 0; cache_only needs cache; "
        f"response_format ('xml') must be one of {formats}"
    )


def test_old_names_map_to_the_new_ones_with_one_warning_each(tmp_path, sage_code, fresh_warnings):
    cache = str(tmp_path / "c.sqlite")
    with pytest.warns(FutureWarning, match="the option cache_path is now called cache"):
        user = SageUserSimulator("http://127.0.0.1:9/v1", "m", cache_path=cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second use of the same old name is quiet
        again = SageUserSimulator("http://127.0.0.1:9/v1", "m", cache_path=cache)
    assert _settings(user).cache == _settings(again).cache == cache
    # A pickled copy is rebuilt from today's names: no warning in the spawned process either.
    assert "cache" in user._options and "cache_path" not in user._options
    copy = pickle.loads(pickle.dumps(user))
    assert _settings(copy).cache == cache
    for client in (user, again, copy):
        client.close()

    with pytest.warns(FutureWarning) as caught:
        official = SageOfficialSimulator(
            code=str(sage_code), base_url="http://127.0.0.1:9/v1", model="m", max_attempts=3, structured=True
        )
    assert {str(w.message).split(":")[1].strip() for w in caught} == {
        "the option max_attempts is now called max_reasks (max_attempts",
        "the option structured is now called response_format (structured",
    }
    assert official.max_reasks == 2 and _settings(official).response_format == "regex" and official.structured
    official.close()

    with pytest.warns(FutureWarning) as caught:
        judge = DimensionJudge(
            base_url="http://127.0.0.1:9/v1", model="m", max_answer_retries=4, json_mode=True
        )
    assert len(caught) == 2 and "json_mode: true is response_format: json_object" in str(caught[1].message)
    assert judge.max_reasks == 4 and judge.response_format == {"type": "json_object"}
    judge.close()


def test_an_old_and_a_new_name_together_are_refused(fresh_warnings):
    with pytest.raises(ValueError, match="cache_path is the old name of cache; give only cache"):
        SageUserSimulator("http://127.0.0.1:9/v1", "m", cache="a.sqlite", cache_path="b.sqlite")
    with pytest.raises(ValueError, match="give only max_reasks"):
        DimensionJudge(base_url="http://127.0.0.1:9/v1", model="m", max_reasks=1, max_answer_retries=1)
