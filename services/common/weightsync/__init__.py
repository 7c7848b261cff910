"""Weight sync, the part both ends share: the learner sends a policy's weights to generator
replicas, bucket by bucket, over one of four transports. ``docs/weight-sync.md`` explains the
whole subsystem: the transports, the handshake, the failure modes.

==================  ==========================================================================
module              what it holds
==================  ==========================================================================
``plan``            the bucket plan (computed once per push by the learner) and its forms on
                    the wires it crosses: proto for gRPC, plain data for ``collective_rpc``
``buckets``         a bucket's bytes: pack, unpack, checksum, the NaN/infinity check
``transports``      which transport reaches a replica, from where both run (gloo, nccl, shm, ipc)
``group``           the private torch.distributed group of the gloo and NCCL transports
``groupwait``       leaving such a group when a push broke, without waiting out its timeout
``shm``             shared-memory segments and the ready table of a pipelined push
``cudaipc``         CUDA buffers shared between processes on one GPU, as plain fields
==================  ==========================================================================

The learner's side (registration, pushes, staging memory) is ``relayrl.learner.sync``; the
generator's is ``relayrl.generator.vllm_weights`` (the engine) and ``relayrl.generator.worker_ext``
(inside vLLM's workers). Importing this package imports nothing heavy (no torch).
"""
