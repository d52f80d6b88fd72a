"""A replica's stderr without torch's C++ store logs (`runners/cpp_log.py`): a lost coordinator is one line."""
import datetime
import os
import sys
import time

import pytest
import torch.distributed as dist

from manualdp.runners.cpp_log import is_store_log, store_logs_dropped


def test_a_store_client_that_lost_its_server_logs_nothing_while_the_replica_says_its_line(capfd):
    """Case 3 of issue 42's adversary: ~32 lines of `TCPStore.cpp:106 sendBytes failed ... frame #21` around one."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=2))
    client.set("x", "1")
    del master
    time.sleep(0.2)
    with store_logs_dropped():
        failed = 0
        for _ in range(3):  # the first send may still leave before the peer's reset arrives
            try:
                client.set("x", "2")
            except Exception:  # noqa: BLE001 - torch's DistNetworkError or RuntimeError, as it goes
                failed += 1
        assert failed
        sys.stderr.write("manualdp train: error: replica 'a': lost the coordinator\n")
        os.write(2, b"[W1129 06:44:12.7 ProcessGroupGloo.cpp:9] not a store's: kept\n")
    err = capfd.readouterr().err
    assert err.splitlines() == ["manualdp train: error: replica 'a': lost the coordinator",
                                "[W1129 06:44:12.7 ProcessGroupGloo.cpp:9] not a store's: kept"]


def test_a_store_log_and_its_trace_are_told_from_other_lines():
    head = b"[W1129 06:44:12.776744005 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=15): Broken pipe\n"
    assert is_store_log(head, False)
    assert is_store_log(b"frame #3: c10d::TCPStore::set + 0x9 (0x7f in libtorch.so)\n", True)
    assert not is_store_log(b"frame #3: a line of someone's own\n", False)
    assert not is_store_log(b"replica a: step 4\n", True)
    with pytest.raises(TypeError, match="line must be bytes, got str"):
        is_store_log("x", False)
