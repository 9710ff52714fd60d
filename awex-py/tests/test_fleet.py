"""Engines added to and removed from a running pair through the Python controller
(docs/gateway.md, "Engines joining and leaving")."""

from __future__ import annotations

import pytest

import awex
from conftest import TINY_F32


def test_an_engine_is_added_in_a_spare_slot_and_removed_and_all_refuses_both(gateway, pair_name):
    ctl = awex.Controller(gateway)
    st = ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=3",
                     commit="available", spare=1)
    try:
        assert [e["state"] for e in st["engines"]] == ["serving", "serving", "absent"], st["engines"]
        added = ctl.add_engine()
        assert (added["engine"], added["ranks"], added["status"]["state"]) == (2, 1, "joining"), added
        assert ctl.status()["engines"][2]["state"] == "joining"
        # no slot is free any more: refused, saying how to keep one
        with pytest.raises(awex.GatewayError, match="spare"):
            ctl.add_engine()
        removed = ctl.remove_engine(1)
        assert (removed["engine"], removed["status"]["state"]) == (1, "absent"), removed
        assert [e["state"] for e in ctl.status()["engines"]] == ["serving", "absent", "joining"]
        # the slot is free again: added back in it on request
        assert ctl.add_engine(1)["engine"] == 1
    finally:
        ctl.disconnect()
    ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=2")
    try:
        for call in (ctl.add_engine, lambda: ctl.remove_engine(1)):
            with pytest.raises(awex.GatewayError, match="commit policy `all`"):
                call()
    finally:
        ctl.disconnect()
    # spare slots need a policy other than `all`
    with pytest.raises(awex.GatewayError, match="spare"):
        ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1,engines=2",
                    spare=1)
