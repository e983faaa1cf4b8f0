"""The collectives and their lowering to the engine's custom calls: allreduce, reduce_scatter /
allgather, broadcast, the lax drop-ins (psum, psum_scatter, all_gather), their batching and
transposes, the wire codecs, split and asynchronous reductions. Imports only the process
runtime.
"""
