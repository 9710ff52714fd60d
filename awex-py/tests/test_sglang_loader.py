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


def test_payload_carries_no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWEX_TP_RANK", "0")
    monkeypatch.setenv("AWEX_ENGINE", "0")
    with pytest.raises(RuntimeError, match=r"^awex.sglang.receive \(engine 0, TP rank 0\): awex.sglang.receive "
                       r"takes its bytes from awex, not from the HTTP payload, but this rank received 2 tensors "
                       r"\(first `a`\)"):
        aws.receive(object(), [("a", 1), ("b", 2)])


class _NoParameters:
    """A model without parameters: the Reader is built, and the gateway asked, at once."""

    def named_parameters(self):
        return iter(())


class _Empty:
    """Stands for a tensor: ``work_of`` reads only the entry's name."""


@pytest.mark.parametrize(
    ("payload", "want"),
    [
        ([], None),
        ([("awex.work/7/2/receive", _Empty())], {"version": 7, "attempt": 2, "phase": "receive"}),
        ([("awex.work/18446744073709551615/1/receive", _Empty())],
         {"version": 2**64 - 1, "attempt": 1, "phase": "receive"}),
    ],
)
def test_the_trigger_names_the_work(payload, want) -> None:
    assert aws.work_of(payload) == want


@pytest.mark.parametrize(
    "name", ["awex.work/7/0/receive", "awex.work/7/1/apply-all", "awex.work/x/1/receive", "awex.work/7/1",
             "awex.work/7/1/receive/extra", "awex.work/-1/1/receive",
             "awex.work/18446744073709551616/1/receive", "awex.work/7/4294967296/receive"],
)
def test_a_malformed_work_entry_is_refused(name) -> None:
    with pytest.raises(RuntimeError, match=r"^the trigger's work entry `awex\.work/.*` is not "
                       r"`awex\.work/<version>/<attempt>/<phase>` with phase one of receive"):
        aws.work_of([(name, _Empty())])


def test_a_work_entry_beside_other_tensors_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"received 2 tensors \(first `awex.work/1/1/receive`\)"):
        aws.work_of([("awex.work/1/1/receive", _Empty()), ("model.norm.weight", _Empty())])


def test_unreachable_gateway_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWEX_TP_RANK", "0")
    monkeypatch.setenv("AWEX_ENGINE", "1")
    monkeypatch.setenv("AWEX_GATEWAY", "http://127.0.0.1:9")
    monkeypatch.setenv("AWEX_PAIR", "rl")
    with pytest.raises(RuntimeError, match=r"^awex.sglang.receive \(engine 1, TP rank 0\): .*127\.0\.0\.1:9"):
        aws.receive(_NoParameters(), [("awex.work/1/1/receive", _Empty())])
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


def test_named_tensors_leave_out_what_sglang_marks_as_no_weight() -> None:
    """SGLang 0.5.23's FP8 KV-cache scales (``BaseKVCacheMethod.create_weights``: ``k_scale`` /
    ``v_scale`` of an attention layer, marked ``_skip_weight_check``) are not registered; the
    rest keep ``named_parameters()``'s order and lose ``torch.compile``'s ``_orig_mod.``."""

    class Param:
        pass

    weight, k_scale, v_scale, norm = Param(), Param(), Param(), Param()
    k_scale._skip_weight_check = True  # type: ignore[attr-defined]
    v_scale._skip_weight_check = True  # type: ignore[attr-defined]

    class Model:
        def named_parameters(self):
            return iter([
                ("model.layers.0.self_attn.kv_b_proj.weight", weight),
                ("model.layers.0.self_attn.attn_mqa.k_scale", k_scale),
                ("model.layers.0.self_attn.attn_mqa.v_scale", v_scale),
                ("_orig_mod.model.norm.weight", norm),
            ])

    assert aws.named_tensors(Model()) == [
        ("model.layers.0.self_attn.kv_b_proj.weight", weight),
        ("model.norm.weight", norm),
    ]
