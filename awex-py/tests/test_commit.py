"""A pair's commit policy across engines (docs/gateway.md, "Engines and commit policies"),
chosen at connect through the Python controller."""

from __future__ import annotations

import pytest

import awex
from conftest import TINY_F32


def test_the_commit_policy_is_chosen_at_connect_and_a_bad_one_is_refused_by_name(gateway, pair_name):
    ctl = awex.Controller(gateway)
    st = ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3",
                     transport="shm", commit="quorum:2")
    try:
        assert st["options"]["commit"] == "quorum:2", st["options"]
        assert ctl.status()["options"]["commit"] == "quorum:2"
    finally:
        ctl.disconnect()
    # the default is `all`, which a status leaves out (older ranks read such pairs)
    st = ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3")
    try:
        assert st["options"].get("commit", "all") == "all", st["options"]
    finally:
        ctl.disconnect()
    # refused before anything is sent: a name that is no policy, a quorum of no engine
    for bad, why in [("most", "is not a commit policy"), ("quorum:0", "at least 1")]:
        with pytest.raises(ValueError, match=why):
            ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3",
                        commit=bad)
    # refused by the gateway: more engines than the pair has
    with pytest.raises(awex.GatewayError, match="quorum"):
        ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3",
                    commit="quorum:4")
