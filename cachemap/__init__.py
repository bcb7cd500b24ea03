"""Prefix identity and the cache directory: which replica holds which prefix blocks.

`keys` turns a canonical rendering into salted, chained block hashes; `rendering` produces
that rendering; `directory` is the one protocol every store implements; `memory` is the
in-process store. Nothing here imports the gateway, loadgen or the router.
"""
