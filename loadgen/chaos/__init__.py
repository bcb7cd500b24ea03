"""`kvgate chaos`: faults injected into real processes on loopback, each with its goal measured.

One module per scenario; `runner` runs them and prints one table (docs/reliability.md).
"""
