"""``awex.sglang.receive`` without SGLang: configuration errors name the engine and TP rank."""

from __future__ import annotations

import pytest

import awex.sglang as aws


@pytest.fixture(autouse=True)
def raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests read the raised message; the default (report and return) has its own test."""
    monkeypatch.setenv("AWEX_SGLANG_ON_ERROR", "raise")


def test_tp_rank_from_env_without_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWEX_TP_RANK", "3")
    assert aws.tp_rank() == 3
    monkeypatch.setenv("AWEX_TP_RANK", "three")
    with pytest.raises(ValueError, match=r"AWEX_TP_RANK='three' is not an integer TP rank"):
        aws.tp_rank()


def test_missing_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWEX_TP_RANK", "1")
    monkeypatch.setenv("AWEX_ENGINE", "2")
    monkeypatch.delenv("AWEX_GATEWAY", raising=False)
    monkeypatch.setenv("AWEX_PAIR", "rl")
    with pytest.raises(RuntimeError) as e:
        aws.receive(object(), [])
    assert str(e.value) == (
        "awex.sglang.receive (engine 2, TP rank 1): AWEX_GATEWAY not set in the SGLang server's "
        "environment; launch it with AWEX_GATEWAY=http://HOST:PORT AWEX_PAIR=NAME [AWEX_ENGINE=N] [AWEX_TOKEN=...]"
    )


def test_payload_must_be_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWEX_TP_RANK", "0")
    monkeypatch.setenv("AWEX_ENGINE", "0")
    with pytest.raises(RuntimeError, match=r"^awex.sglang.receive \(engine 0, TP rank 0\): awex.sglang.receive "
                       r"takes its bytes from awex, not from the HTTP payload, but this rank received 2 tensors"):
        aws.receive(object(), [("a", 1), ("b", 2)])


def test_unreachable_gateway_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWEX_TP_RANK", "0")
    monkeypatch.setenv("AWEX_ENGINE", "1")
    monkeypatch.setenv("AWEX_GATEWAY", "http://127.0.0.1:9")
    monkeypatch.setenv("AWEX_PAIR", "rl")
    with pytest.raises(RuntimeError, match=r"^awex.sglang.receive \(engine 1, TP rank 0\): "):
        aws.receive(object(), [])
    assert aws._receiver is None


@pytest.mark.parametrize("setting", [None, "report", " Report ", "bogus"])
def test_by_default_a_failure_is_logged_and_the_call_returns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, setting: str | None
) -> None:
    # SGLang 0.5.23 ends the whole server on a loader exception: the loader logs and returns
    if setting is None:
        monkeypatch.delenv("AWEX_SGLANG_ON_ERROR")
    else:
        monkeypatch.setenv("AWEX_SGLANG_ON_ERROR", setting)
    monkeypatch.setenv("AWEX_TP_RANK", "1")
    monkeypatch.setenv("AWEX_ENGINE", "2")
    monkeypatch.delenv("AWEX_GATEWAY", raising=False)
    monkeypatch.setenv("AWEX_PAIR", "rl")
    with caplog.at_level("ERROR", logger="awex.sglang"):
        assert aws.receive(object(), []) is None
    messages = [r.getMessage() for r in caplog.records]
    assert messages[-1].startswith(
        "awex.sglang.receive (engine 2, TP rank 1): AWEX_GATEWAY not set in the SGLang server's environment"
    ), messages
    assert "not raised: SGLang 0.5.23 ends the server on a loader exception" in messages[-1]
    if setting == "bogus":
        assert messages[0] == "AWEX_SGLANG_ON_ERROR='bogus' is neither `report` nor `raise`; using `report`"


def test_the_wait_for_an_updates_event_ends_after_its_deadline() -> None:
    # the gateway fails an update at its deadline: a loader never waits past it (plus 10 s)
    assert aws._event_wait({"deadline_ms": 60_000, "elapsed_ms": 15_000}) == 55.0
    assert aws._event_wait({"deadline_ms": 5_000, "elapsed_ms": 9_000}) == 10.0
    assert aws._event_wait({"version": 3}) == 610.0
