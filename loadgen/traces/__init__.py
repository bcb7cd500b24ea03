"""Public request traces: their readers, and the trace data with its license."""
