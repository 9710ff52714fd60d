"""A pair's commit policy across engines, chosen at connect through the Python controller
(docs/gateway.md, "Engines and commit policies")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import awex
from conftest import TINY_F32
from test_pair import Pair


def test_the_commit_policy_is_chosen_at_connect_and_a_bad_one_is_refused_by_name(gateway, pair_name):
    ctl = awex.Controller(gateway)
    st = ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3",
                     transport="shm", commit="quorum:2")
    try:
        assert st["options"]["commit"] == "quorum:2", st["options"]
        assert ctl.status()["options"]["commit"] == "quorum:2"
        # one record per engine, each serving nothing yet
        assert [e["engine"] for e in st["engines"]] == [0, 1, 2], st["engines"]
        assert all(e["serving_version"] is None for e in st["engines"]), st["engines"]
    finally:
        ctl.disconnect()
    # the default is `all`, which a status leaves out
    st = ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3")
    try:
        assert st["options"].get("commit", "all") == "all", st["options"]
    finally:
        ctl.disconnect()
    # refused before anything is sent: a name that is no policy, a quorum of no engine
    for bad, why in [("most", "is not a commit policy"), ("quorum:0", "at least 1"), ("quorum:x", "whole number")]:
        with pytest.raises(ValueError, match=why):
            ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3",
                        commit=bad)
    # refused by the gateway: a quorum of more engines than the pair has
    with pytest.raises(awex.GatewayError, match="quorum"):
        ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3",
                    commit="quorum:4")


def test_a_quorum_commits_without_an_engine_whose_reader_is_gone_and_reports_it_behind(gateway, pair_name):
    # tcp: the trainer finds the gone Reader's engine unreachable and leaves it out at once
    # (over shm a Reader closed in this process is not seen gone: the trainer waits for it
    # until the deadline, and the version fails there)
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1,engines=3", "tcp",
             commit="quorum:2", update_deadline_s=60.0)
    try:
        for x in p.all():
            x.register({t["name"]: np.full(t["shape"], 1.0, np.float32) for t in x.layout()})
        p.join()
        assert all(r["state"] == "committed" for r in p.update(1))
        assert [(e["state"], e["serving_version"]) for e in p.ctl.status()["engines"]] == [("serving", 1)] * 3
        # engine 2's only Reader goes away (its process would have died): the gateway knows it
        # gone and leaves engine 2 out at once, and two engines still make the quorum
        p.readers[2].close()
        live = [p.writers[0], p.readers[0], p.readers[1]]
        with ThreadPoolExecutor(max_workers=len(live)) as ex:
            futures = [ex.submit(x.update, 2, timeout=60) for x in live]
            st = p.ctl.update(2, timeout=60)
            assert [f.result(timeout=60)["state"] for f in futures] == ["committed"] * 3
        assert st["state"] == "committed" and st["attempt"] == 1, st
        assert [e["engine"] for e in st["left_out"]] == [2], st
        status = p.ctl.status()
        assert status["serving_version"] == 2, status
        engines = status["engines"]
        # engine 2 still serves version 1, and is behind since version 2; an in-place version
        # announced to it may have written part of its weights, so it is reported torn (never
        # serving), as the gateway cannot know that nothing reached it
        assert [(e["engine"], e["state"], e["serving_version"]) for e in engines] == [
            (0, "serving", 2), (1, "serving", 2), (2, "torn", 1)], engines
        assert engines[2]["torn_version"] == 2, engines[2]
        assert isinstance(engines[2]["behind_since_unix_ms"], int), engines[2]
        assert "could not reach engine 2" in engines[2]["last_error"], engines[2]
        assert engines[0]["behind_since_unix_ms"] is None, engines[0]
        # engine 1 goes too: one engine cannot make a quorum of two, so version 3 fails at once
        # (well before the 60 s deadline) and no engine is reported serving it
        p.readers[1].close()
        live = [p.writers[0], p.readers[0]]
        with ThreadPoolExecutor(max_workers=len(live)) as ex:
            futures = [ex.submit(x.update, 3, timeout=60) for x in live]
            with pytest.raises(awex.UpdateFailed) as failed:
                p.ctl.update(3, timeout=30)
            for f in futures:
                try:
                    f.result(timeout=60)
                except awex.UpdateFailed:
                    pass
        assert failed.value.version == 3
        engines = p.ctl.status()["engines"]
        assert all(e["serving_version"] != 3 for e in engines), engines
        assert [e["serving_version"] for e in engines] == [2, 2, 1], engines
    finally:
        p.close()
