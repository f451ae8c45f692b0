"""rollout/server_store.py: torch's C++ reports of a lost store connection are dropped from stderr where the call
raised DistNetworkError or succeeded, and nothing else is (hand-written torch output, written to file descriptor 2
as torch's C++ logging writes it)."""
import os

import pytest
import torch.distributed as dist

from megatron_gtpo.rollout.server_store import quietly, without_c10d_reports

# What torch 2.13 printed for a store call after its server was SIGKILLed (paths and frames shortened).
C10D_REPORT = """\
[W1127 20:43:21.724417173 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=4): Failed to recv, got 0 bytes. \
Connection was likely closed. Did the remote server shutdown or crash?
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call \
first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f4ad9b8eb8d in libc10.so)
frame #4: c10d::TCPStore::check(std::vector<std::string> const&) + 0x383 (0x7f4ac9d41af3 in libtorch_cpu.so)
<omitting python frames>
frame #18: _start + 0x21 (0x55dc91c45081 in python)

[E1127 20:44:02.699292800 socket.cpp:1028] [c10d] The client socket has timed out after 3000ms while trying to \
connect to (127.0.0.1, 29733).
"""
OTHER = "a line of the trainer's own\n[W1127 20:43:22.1 ProcessGroupGloo.cpp:9] not a c10d report\nframe #0: kept\n"


def test_only_c10d_reports_and_their_stacks_are_dropped():
    assert without_c10d_reports(C10D_REPORT) == ""
    assert without_c10d_reports("[rank1]:" + C10D_REPORT) == ""  # as torch prints it under torchrun
    assert without_c10d_reports("before\n" + C10D_REPORT + OTHER + C10D_REPORT + "after\n") == \
        "before\n" + OTHER + "after\n"


def _printing(then_raise=None):
    def call():
        os.write(2, (C10D_REPORT + OTHER).encode())
        if then_raise is not None:
            raise then_raise
        return 7
    return call


@pytest.mark.parametrize("error, kept", [
    (None, OTHER),  # a call that succeeded after torch's retries
    (dist.DistNetworkError("Broken pipe"), OTHER),  # the server died: the caller says so in its own line
    (RuntimeError("something else"), C10D_REPORT + OTHER),  # anything else: all of it
])
def test_a_calls_c10d_reports_are_dropped_unless_it_failed_otherwise(capfd, error, kept):
    if error is None:
        assert quietly(_printing()) == 7
    else:
        with pytest.raises(type(error)):
            quietly(_printing(error))
    assert capfd.readouterr().err == kept
