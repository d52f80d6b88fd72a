"""Every public import of the stop before the engine had rooms still works: the move changed no user's script."""
import importlib

import pytest

# `manualdp.spmd.__all__` and `manualdp.distributed.__all__` as they were at 982eac7, before the move
BEFORE = {
    "manualdp.spmd": ["NaiveDDP", "FlatDDP", "OverlappedDDP", "BucketedDDP", "Bucket", "DistributedDataParallel",
                      "GradBucket", "PowerSGDState", "SyncBatchNorm", "convert_sync_batchnorm", "init_from_env",
                      "launch", "rank_device", "shard", "DEFAULT_SEGMENT_BYTES", "Message", "Round", "allreduce",
                      "plan", "DEFAULT_TIMEOUT", "PeerError", "ShardedBatchSampler", "shard_loader", "fully_shard",
                      "full_state_dict"],
    "manualdp.distributed": ["DEFAULT_SEGMENT_BYTES", "Message", "Round", "plan", "allreduce", "Bucket",
                             "DistributedDataParallel"],
}


@pytest.mark.parametrize("module, name", [(m, n) for m, names in BEFORE.items() for n in names])
def test_a_public_name_of_before_the_move_still_imports(module, name):
    assert name in importlib.import_module(module).__all__
    assert getattr(importlib.import_module(module), name) is not None


def test_the_front_door_offers_every_drop_in_and_they_are_the_engines():
    import manualdp.distributed as front
    import manualdp.spmd as engine
    for name in ("DistributedDataParallel", "ZeroRedundancyOptimizer", "fully_shard", "SyncBatchNorm"):
        assert getattr(front, name) is getattr(engine, name)


def test_the_drop_ins_bucket_is_the_ladders_bucket_plus_flags():
    from manualdp.spmd import Bucket
    from manualdp.spmd.ddp.bucket import FlaggedBucket
    assert issubclass(FlaggedBucket, Bucket)  # `isinstance(b, manualdp.spmd.Bucket)` holds for the drop-in's buckets


def test_the_book_and_the_engine_name_their_zero_classes_apart():
    import manualdp.spmd
    import manualdp.zero
    assert manualdp.zero.ShardedOptimizer is not manualdp.spmd.ZeroRedundancyOptimizer
    assert not hasattr(manualdp.zero, "ZeroRedundancyOptimizer")
