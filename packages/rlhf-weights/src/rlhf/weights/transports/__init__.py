"""Transports: each moves a sync's buffers from one sender to its receivers, as one sender
class and one receiver class (or one group member class), registered with its facts at the
end of its module (`rlhf.weights.registry`).

- `object_store`: Ray's object store (any node of a Ray cluster).
- `shared_memory`: one POSIX shared-memory segment (one machine).
- `cuda_ipc`: GPU buffers shared by handle with processes on the same GPU.
- `broadcast`: a collective group, gloo on CPUs and NCCL (through CuPy) on GPUs.

A sender's ``send(buckets)`` returns a small picklable *sync* to hand to the receivers (the
broadcast group streams instead: its receivers call ``receive()`` while the sender sends).
A receiver's ``receive(...)`` returns the sync's `rlhf.weights.WeightBucket` s, to be checked
with `rlhf.weights.validate_sync` before anything is loaded.
"""
