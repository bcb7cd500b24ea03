"""Load generation and measurement: the simulated vLLM engine, trace readers, workloads,
replay over the wire, the discrete-event simulator and benchmarks.

loadgen may import `router` and `cachemap` (the simulator runs their code); it reaches the
gateway only over the wire.
"""
