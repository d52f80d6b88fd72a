"""The call check's fingerprint, cached per call shape: the same row and tag as computed afresh, every call counted."""
from types import SimpleNamespace

import torch
from hypothesis import given, settings, strategies as st

from manualdp.schedule import ALGORITHMS, COLLECTIVES
from manualdp.spmd.transport.call_check import _DTYPES, _NAMES, _fingerprint, _tag

NAMES = sorted((*ALGORITHMS, "auto"))


@settings(max_examples=300, deadline=None)
@given(numel=st.integers(0, 1 << 40), dtype=st.sampled_from([torch.float32, torch.float64, torch.int8, torch.bfloat16]),
       algorithm=st.sampled_from(NAMES), segment=st.integers(1, 1 << 30), schedule=st.sampled_from([None, *ALGORITHMS]),
       collective=st.sampled_from(sorted(COLLECTIVES)), root=st.integers(0, 7), step=st.integers(-1, 1 << 62),
       identity=st.integers(0, 1 << 62), flag=st.booleans(), calls=st.integers(0, 1 << 40))
def test_a_cached_fingerprint_is_the_row_and_tag_computed_afresh(numel, dtype, algorithm, segment, schedule, collective,
                                                                 root, step, identity, flag, calls):
    state = SimpleNamespace(calls=calls)
    tensor = torch.empty(0, dtype=dtype)
    for call in (calls + 1, calls + 2):  # twice: the second from the cache, with the next call number
        row, tag = _fingerprint(state, tensor, algorithm, segment, numel=numel, flag=flag, schedule=schedule,
                                collective=collective, root=root, step=step, identity=identity)
        assert state.calls == call
        expected = [numel, _DTYPES.index(dtype), _NAMES.index(algorithm), segment, call,
                    -1 if schedule is None else _NAMES.index(schedule), sorted(COLLECTIVES).index(collective), root,
                    step, identity, tensor.element_size(), int(flag)]
        assert row == expected
        assert tag == _tag(expected)
