"""Prompt-cache billing: profiles, prices, the tenant-visible cache ledger, the meter, the
durable ledger and its exports (docs/billing.md).

The pricing engine (`model`, `rules`, `ledger`, `prices`, `usage`, `money`, `formulas`) is pure:
no I/O, no clock; `simulate` and the live `meter` run the same code.
"""
