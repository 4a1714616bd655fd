"""An α-β cost model of one training step: each method's predicted step time for p ranks on a
given network, from the model's layer shapes and its compute, timed on this machine or counted
at an accelerator's rates.

    step = compute + the method's own computation + communication - what hides behind backward

This package holds only what every method shares, a module each: the network (`network`: `Link`,
with Hockney's α-β costs of the collectives), the model's profile (`profile`: layer shapes,
compute and the methods' kernels), the devices it is costed for (`device`), and the prediction
with the choices made from it (`choose`: `predict`, `choose`, `break_even`). What one method
sends and computes in a step is described in the method's own module, as a `MethodCost`
registered with it (hvd_lowcomm.methods); this package asks the registry for it by name and
knows no method itself.

Communication (the algorithms MPI libraries and NCCL use for large messages: Rabenseifner's
reduce-scatter + allgather, recursive-doubling allgather; the bytes are the ring's, which the
traffic meter counts too), for a group of g ranks:

    allreduce of M bytes              2⌈log2 g⌉·α + 2(g-1)/g · M / β
    allgather of m bytes per rank     ⌈log2 g⌉·α + (g-1) · m / β
    point to point, M bytes           α + M / β

β is the bandwidth of the slowest link the ring crosses: the network's once the group spans
several nodes (a ring leaves each node once, so the node's ranks do not share its link), the
node's own (`intra_bandwidth`) inside one; for rings of one rank per node that every rank of a
node runs at once (DiLoCo's columns), the node's link shared among its ranks. α is the latency
of one message, by default the network kind's (`LATENCY_US`). On a *shared* medium
(benchmarks.compare --link without --nodes: one token bucket that every rank's bytes cross) the
bytes of all ranks add up instead.

Compute: forward + backward + optimiser step of one batch, and a method's own computation
(PowerSGD's compression cycle, rank-dAD's factors, AB's SVDs...) per layer with the method's own
kernels on data of the layer's shapes, as its cost asks (`MethodCost.layer_kernels`). Either
timed on this machine (`profile_model` without a device; a measured step of `--method local`
may replace it), or counted for a `Device` (an accelerator of `ACCELERATORS`, this CPU's measured
rates, or a given rate): every op runs on the meta device, shapes only, and its FLOPs and bytes
are costed. The step is three times the forward pass's FLOPs at the device's peak × UTILISATION; each
kernel op at the roofline (`Device.seconds`).
"""

from __future__ import annotations

from hvd_lowcomm.costmodel.network import (  # noqa: F401 - the package's names
    IB_FROM,
    LATENCY_US,
    Link,
    link_kind,
    sent_bytes,
)
from hvd_lowcomm.costmodel.device import (  # noqa: F401 - the package's names
    ACCELERATORS,
    Accelerator,
    Device,
    OP_SECONDS,
    TIMING_LIMIT,
    UTILISATION,
    compute_device,
    costing,
    count_ops,
    measured_device,
    median_seconds,
)
from hvd_lowcomm.costmodel.method_cost import (  # noqa: F401 - the package's names
    NODE,
    Memory,
    MethodCost,
    Prediction,
    RunAssumptions,
    replicated,
)
from hvd_lowcomm.costmodel.profile import (  # noqa: F401 - the package's names
    Layer,
    LayerSample,
    Profile,
    profile_model,
)
from hvd_lowcomm.costmodel.choose import (  # noqa: F401 - the package's names
    MIN_GAIN,
    break_even,
    choose,
    drop_in_methods,
    format_predictions,
    left_out,
    measured_quality,
    predict,
    predicted_methods,
    quality_keeping_methods,
    auto_candidates,
    steps_multiple,
    time_held_methods,
    quality_risk,
)
