"""A ``torchrun --max-restarts`` restart must not read the previous attempt's rendezvous keys.

torchrun keeps one TCPStore across restarts and lends it to the workers; a restarted worker that
reads the old attempt's gloo addresses fails in ``init_process_group`` ("connection refused":
every TP 2 x PP 2 restart of scripts/drill.py did). ``runtime._restart_store`` puts each single-node
attempt under ``zerotron/restart_<n>/``; the drill's ``restart`` scenario runs it for real.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from zerotron.parallel import runtime


@pytest.fixture
def agent_store(monkeypatch):
    """A TCPStore server standing in for torchrun's, holding a key of attempt 0."""
    # port 0: the OS gives one and the server holds it (a port found free, released and bound
    # again could be taken meanwhile)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    port = server.port
    server.set("default_pg/0//0", "address of attempt 0")
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(key, value)
    return server


def test_a_restart_sees_only_its_own_keys(agent_store):
    store = runtime._restart_store(datetime.timedelta(seconds=10))
    assert store is not None and not store.check(["default_pg/0//0"])  # attempt 0's address is invisible
    store.set("default_pg/0//0", "address of attempt 1")
    assert agent_store.check(["zerotron/restart_1/default_pg/0//0"])
    assert agent_store.get("zerotron/restart_1/default_pg/0//0") == b"address of attempt 1"
    assert agent_store.get("default_pg/0//0") == b"address of attempt 0"


@pytest.mark.parametrize("env", [{"TORCHELASTIC_RESTART_COUNT": "0"}, {"GROUP_WORLD_SIZE": "2"},
                                 {"TORCHELASTIC_USE_AGENT_STORE": "False"}])
def test_first_attempts_several_nodes_and_own_stores_are_left_to_torch(agent_store, monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert runtime._restart_store(datetime.timedelta(seconds=10)) is None
