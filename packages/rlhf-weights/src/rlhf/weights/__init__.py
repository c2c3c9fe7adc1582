"""rlhf.weights: how a trainer's weights travel to inference engines.

The wire format (`WeightBucket`: a `BucketHeader` of tensor metadata and checksums beside one
flat byte buffer), packing (`iter_buckets`, streaming) and viewing (`iter_tensors`), whole-sync
validation (`validate_sync`), and the transports (`rlhf.weights.transports`: object store, shared
memory, CUDA IPC, gloo/NCCL broadcast), each registered with its facts (`TransportSpec` in
`TRANSPORTS`; `choose` picks one for a `Placement`, `Sender`/`Receiver` are its ends), and
the driving of a run's syncs from a learner (`WeightSource`) into its engines (`WeightSink`):
`open_transport`, `rlhf.weights.drivers`. Torch
only; Ray and CuPy are imported by the transports that need them. It imports no other rlhf
package: the learner sends and the rollout receives through it.
"""

from rlhf.weights.checksums import (
    CHECKSUMS,
    checksum,
    default_algorithm,
    digest_of,
    span_digests,
    wsum64_each,
)
from rlhf.weights.drivers import (
    GroupTransport,
    SenderTransport,
    SentSync,
    Transport,
    WeightSink,
    WeightSource,
    engine_sync_parts,
    load_alone,
    open_transport,
    sync_report,
)
from rlhf.weights.format import (
    ALIGN,
    DTYPE_NAMES,
    DTYPES,
    BucketHeader,
    TensorMeta,
    WeightBucket,
    WeightSyncError,
    as_uint8,
)
from rlhf.weights.packing import count_buckets, iter_buckets, iter_tensors, pack_buckets
from rlhf.weights.registry import (
    TRANSPORTS,
    GroupMember,
    Measured,
    Placement,
    Receiver,
    Sender,
    TransportSpec,
    choose,
    receivers,
    register,
    transport,
)
from rlhf.weights.transports.broadcast import (
    BroadcastGroup,
    BroadcastGroupSpec,
    new_broadcast_group,
)
from rlhf.weights.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender, CudaIpcSync
from rlhf.weights.transports.delta import (
    DeltaMember,
    DeltaReceiver,
    DeltaSender,
    DeltaStats,
    DeltaSync,
)
from rlhf.weights.transports.object_store import (
    ObjectStoreReceiver,
    ObjectStoreSender,
    ObjectStoreSync,
)
from rlhf.weights.transports.shared_memory import (
    SharedMemoryReceiver,
    SharedMemorySender,
    SharedMemorySync,
)
from rlhf.weights.validation import validate_sync

__all__ = [
    "ALIGN",
    "CHECKSUMS",
    "DTYPES",
    "DTYPE_NAMES",
    "TRANSPORTS",
    "BroadcastGroup",
    "BroadcastGroupSpec",
    "BucketHeader",
    "CudaIpcReceiver",
    "CudaIpcSender",
    "CudaIpcSync",
    "DeltaMember",
    "DeltaReceiver",
    "DeltaSender",
    "DeltaStats",
    "DeltaSync",
    "GroupMember",
    "GroupTransport",
    "Measured",
    "ObjectStoreReceiver",
    "ObjectStoreSender",
    "ObjectStoreSync",
    "Placement",
    "Receiver",
    "Sender",
    "SenderTransport",
    "SentSync",
    "SharedMemoryReceiver",
    "SharedMemorySender",
    "SharedMemorySync",
    "TensorMeta",
    "Transport",
    "TransportSpec",
    "WeightBucket",
    "WeightSink",
    "WeightSource",
    "WeightSyncError",
    "as_uint8",
    "checksum",
    "choose",
    "count_buckets",
    "default_algorithm",
    "digest_of",
    "engine_sync_parts",
    "iter_buckets",
    "iter_tensors",
    "load_alone",
    "new_broadcast_group",
    "open_transport",
    "pack_buckets",
    "receivers",
    "register",
    "span_digests",
    "sync_report",
    "transport",
    "validate_sync",
    "wsum64_each",
]
