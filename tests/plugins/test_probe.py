"""`rlver probe`: every scripted responder against a recipe's simulated users, one table."""

from __future__ import annotations

import json

import pytest

from rlver.cli import main
from rlver.commands.probe import ProbeRow, format_probe, scripted_strategies
from tests.conftest import REPO


def test_the_table_names_the_responders_the_simulator_does_not_punish():
    rows = [
        ProbeRow("sympathy", 64, 40.0, 45.0, 43.0, 47.0, 5.0, 3.0, 7.0, "gaming: ..."),
        ProbeRow("refusal", 64, 40.0, 25.0, 24.0, 26.0, -15.0, -16.0, -14.0, "gaming: ..."),
        ProbeRow("parrot", 64, 40.0, 39.5, 38.0, 41.0, -0.5, -2.0, 1.0, "gaming: ..."),
    ]
    table = format_probe(rows, simulator="embedded")
    assert "not punished (the change's interval reaches 0 or above): sympathy, parrot" in table
    assert [line.split()[-1] for line in table.splitlines()[2:5]] == ["NO", "yes", "NO"]


def test_the_scripted_engine_is_a_plugin_like_any_other_and_the_probe_reads_its_strategies_from_it():
    from rlver_plugins.scripted_engine import STRATEGIES as ENGINE_STRATEGIES

    from rlver.core.interfaces import RolloutEngine
    from rlver.core.plugins import get_registry

    assert "scripted" in get_registry().names("engines")
    # Declared on the interface, so core reads nothing a plugin does not promise; a sampling
    # engine has none.
    assert RolloutEngine.scripted_strategies == ()
    assert scripted_strategies() == ENGINE_STRATEGIES and "kind_refusal" in ENGINE_STRATEGIES


def test_an_unknown_strategy_is_one_error_naming_the_flag_and_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "--config", str(REPO / "recipes" / "quickstart.yaml"), "--strategies", "[flattery]"])
    err = capsys.readouterr().err
    assert "--strategies: unknown flattery" in err and "kind_refusal" in err


@pytest.mark.slow
@pytest.mark.parametrize("users", ["builtin:en_test", "builtin:sentient_test"], ids=["english", "chinese"])
def test_the_quickstarts_embedded_user_punishes_every_scripted_responder(users, tmp_path, capsys):
    """Issue 56's bar on the shipped profiles of both languages: no scripted responder reaches the
    users' start emotion, its whole interval over users below it."""
    argv = ["probe", "--config", str(REPO / "recipes" / "quickstart.yaml"), "--device", "cpu"]
    argv += ["--data.test_files", f"[{users}]", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "every scripted responder ends below the users' start, its whole interval" in out
    table = json.loads((tmp_path / "probe.json").read_text())
    assert [row["responder"] for row in table] == list(scripted_strategies())
    for row in table:
        assert row["punished"] and row["change_high"] < 0 and row["final_high"] < row["start"], row
        assert (tmp_path / f"{row['responder']}.jsonl").is_file()
