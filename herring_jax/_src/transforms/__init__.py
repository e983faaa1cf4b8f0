"""The gradient transformations built on the collectives: allreduce_gradients and its fusion
buckets, sharded_optimizer (ZeRO-1), fully_sharded (ZeRO-3), local SGD / DiLoCo and Streaming
DiLoCo, PowerSGD, top-k, Accordion, sparse rows.
"""
