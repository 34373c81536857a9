"""A rank that fails at once, before any launch gate: what a broken install looks like under a gated launch."""
import sys

sys.exit("failing_worker: this rank cannot start")
