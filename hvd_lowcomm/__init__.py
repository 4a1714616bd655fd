"""hvd_lowcomm: low-communication training on MPI clusters, in Horovod's idiom.

    import hvd_lowcomm
    hvd_lowcomm.init()                                    # MPI + Horovod (or engine="torch"), for hvd.init()
    opt = hvd_lowcomm.PowerSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters())  # Horovod's arguments
    ...
    loss.backward()                                       # .grad is now the pooled gradient (as DDP's)
    opt.step()
    print(hvd_lowcomm.meter.total("train"))               # bytes this rank sent

The names below are resolved on first use, so importing the package stays cheap (the command
line parses its options before torch and MPI load).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "init": "hvd_lowcomm.comm.runtime",  # start MPI and the engine (Horovod or torch)
    "rank": "hvd_lowcomm.comm.runtime",  # this process's global rank
    "size": "hvd_lowcomm.comm.runtime",  # the number of ranks
    "local_rank": "hvd_lowcomm.comm.runtime",  # this rank's index on its node (Horovod's names)
    "local_size": "hvd_lowcomm.comm.runtime",  # the ranks on its node
    "cross_rank": "hvd_lowcomm.comm.runtime",  # its node's index
    "cross_size": "hvd_lowcomm.comm.runtime",  # the number of nodes
    "device_mesh": "hvd_lowcomm.comm.mesh",  # groups as a DeviceMesh, for FSDP2 (torch engine)
    "fully_shard": "hvd_lowcomm.comm.mesh",  # torch's fully_shard, its collectives metered
    "shard_model": "hvd_lowcomm.comm.mesh",  # fully_shard on each repeated block, then the root
    "DistributedOptimizer": "hvd_lowcomm.methods.ddp",  # Horovod's, metered (fp32 / fp16)
    "PowerSGDOptimizer": "hvd_lowcomm.methods.powersgd",
    "PowerSGDState": "hvd_lowcomm.methods.powersgd",
    "DadOptimizer": "hvd_lowcomm.methods.dad",  # mode="exact" | "rank" (rank=r) | "edad"
    "ABTraining": "hvd_lowcomm.methods.ab",  # AB-training around the user's step
    "SIL": "hvd_lowcomm.methods.sil",  # synthetic intermediate labels, per partition
    "DiLoCo": "hvd_lowcomm.methods.diloco",  # local SGD in groups with an outer optimiser
    "muon_with_adamw": "hvd_lowcomm.optimizers",  # Muon for weight matrices, AdamW for the rest
    "CombinedOptimizer": "hvd_lowcomm.optimizers",  # several torch optimisers stepped as one
    "meter": "hvd_lowcomm.comm.traffic",  # the traffic meter: bytes per op/tensor
    "method_names": "hvd_lowcomm.registry",  # every registered method name (the --method choices)
    "broadcast_parameters": "hvd_lowcomm.methods.base",  # Horovod's, on either engine
    "broadcast_optimizer_state": "hvd_lowcomm.methods.base",
    "Compression": "hvd_lowcomm.methods.drop_in",  # Horovod's names, for `import hvd_lowcomm as hvd`
    "Average": "hvd_lowcomm.methods.drop_in",
    "Sum": "hvd_lowcomm.methods.drop_in",
    "Adasum": "hvd_lowcomm.methods.drop_in",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hvd_lowcomm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    """The exported API beside the module's own names (they load on first use)."""
    return sorted(set(globals()) | set(_EXPORTS))
