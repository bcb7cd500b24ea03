"""Public request traces: their readers, and the trace data with its license.

The Mooncake FAST'25 traces ship inside the package (`mooncake/`, Apache-2.0, provenance and
checksums in its README), so every default trace path is one of the constants below, in a clone
and in an installed package alike.
"""

from __future__ import annotations

from pathlib import Path

MOONCAKE_DIR = Path(__file__).resolve().parent / "mooncake"
"""The Mooncake traces, their license and their README (source, commit, sha256, format)."""
CONVERSATION_TRACE = MOONCAKE_DIR / "conversation_trace.jsonl"
"""An hour of production conversation traffic: 12,031 requests, the default trace."""
SYNTHETIC_TRACE = MOONCAKE_DIR / "synthetic_trace.jsonl"
"""Poisson arrivals of multi-turn conversations: 3,993 requests."""
