"""Pure routing decisions: a snapshot of candidates in, a ranking of replicas out.

No I/O, no clocks, no global state: the same code runs in the live gateway and in loadgen's
discrete-event simulator. Randomness comes in as a `random.Random`, time as numbers.
"""
