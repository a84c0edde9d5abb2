"""Several processes and devices: sharding (FSDP1 / FSDP2 detection, `AnyDeviceFSDPStrategy`),
full-weight gathers, global gradient clipping, one failing rank ending the others, and the
CPU allocator setting.

May import `rlver.core` only. Knows tensors and process groups, never what is trained.
"""
