"""Distributed Muon: owner planning and byte-counted collectives shared by the strategies."""

from lightning_muon.distributed.comm import CommStats, all_reduce_bytes, all_to_all_v
from lightning_muon.distributed.ddp import MuonDDPSharding
from lightning_muon.distributed.planning import OwnershipPlan, matrix_shapes, plan_ownership

__all__ = [
    "CommStats",
    "MuonDDPSharding",
    "OwnershipPlan",
    "all_reduce_bytes",
    "all_to_all_v",
    "matrix_shapes",
    "plan_ownership",
]
